"""Which universal perturbation family reaches a backdoor's target? For every dev-set zoo model
(CIFAR-10 and GTSRB, clean ones included) and every family below, one targeted universal
perturbation per label is fitted on half of `--images` test images (none of that label) and applied
to the other half; the row holds each label's held-out rate and the robust z of the top label
(``pbe.detection``'s statistic) -> experiments/results/scan_families.{json,md}. A family that names
the target on an infected model and nothing on a clean one is a candidate for detection and for
PBE's targeted levers. Cells with a row on the committed weights are skipped.

    python experiments/scan_families.py [--dataset gtsrb] [--only badnets clean] [--families mask l2]
"""
from __future__ import annotations

import argparse
import time

import torch
from common import RESULTS, built_zoo_models, zoo_cell
from grid import Cell, execute, median_cost, script_main

from pbe import zoo
from pbe.adversarial import UniversalConfig
from pbe.detection import SCAN_L2_RMS, label_scores, reached
from pbe.results import ResultsTable, fixed, pct
from pbe.utils import PBEError, hardware_string, toolkit_version

FAMILIES = {  # name -> config; budgets as a share of the image (l2: rms per pixel; mask: of the pixels)
    "l2": UniversalConfig(kind="l2", eps=SCAN_L2_RMS, per_pixel=True, epochs=2),
    "patch3": UniversalConfig(kind="patch", size=3, epochs=2),
    "mask1pc": UniversalConfig(kind="mask", eps=0.01, epochs=2, batch_size=16),
}


def rates(model, test_set, cfg: UniversalConfig, images: int, seed: int) -> list[float]:
    """Per label: the held-out share of other labels' images one targeted perturbation sends there."""
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(test_set), generator=gen)[:2 * images]
    x, y = test_set.images[pick], test_set.labels[pick]
    xo, yo, xh, yh = x[:images], y[:images], x[images:].float() / 255, y[images:]
    return [round(float(reached(model, xo, yo, xh, yh, cfg, label, gen).sum() / (yh != label).sum().clamp_min(1)), 4)
            for label in range(test_set.num_classes)]


class FamilyTable(ResultsTable):
    note = ". Rates in % of held-out images of other labels; z: robust z of the top label (pbe.detection)."

    def columns(self):
        def to_target(r):
            return "–" if r["target"] is None else f"{100 * r['rates'][r['target']]:.1f}"
        return [("zoo", lambda r: r["zoo"]), ("family", lambda r: r["family"]),
                ("target", lambda r: "–" if r["target"] is None else str(r["target"])), ("rate to target", to_target),
                ("top label", lambda r: str(r["top_label"])), ("its rate", lambda r: pct(max(r["rates"]), 1)),
                ("median rate", lambda r: pct(float(torch.tensor(r["rates"]).median()), 1)),
                ("z", lambda r: fixed(r["score"])), ("wall s", lambda r: fixed(r["wall_s"], 0))]


def results_table(cfg: dict | None = None) -> FamilyTable:
    """This script's table (``experiments/render.py`` re-renders it)."""
    return FamilyTable(RESULTS / "scan_families", "Universal families toward each label, dev-set zoo",
                       "python experiments/scan_families.py")


CONFIG = {"datasets": ["cifar10", "gtsrb"], "only": None, "families": list(FAMILIES), "images": 256, "seeds": [0]}
DEFAULT_ESTIMATE = 0.5  # epoch-equivalents of a family scan without a row yet


def cells(cfg: dict) -> list[Cell]:
    unknown = set(cfg["families"]) - set(FAMILIES)
    if unknown:
        raise PBEError(f"scan_families: unknown families {sorted(unknown)}; available: {', '.join(FAMILIES)}")
    table = results_table(cfg)
    return [Cell("scan_families", f"{e.name} {family} seed {seed}",
                 zoo_cell(e, "scan", "test", seed, schedule=f"family:{family}"),
                 {"name": e.name, "family": family, "images": cfg["images"], "seed": seed},
                 median_cost(table, DEFAULT_ESTIMATE, family=family), zoo=e.name)
            for dataset in cfg["datasets"] for e in built_zoo_models("dev", dataset, cfg["only"], infected=False)
            for family in cfg["families"] for seed in cfg["seeds"]]


def run_cell(name: str, family: str, images: int, seed: int) -> dict:
    """One row: one universal family toward each label of a zoo model, and the robust z of the top one."""
    entry = zoo.get(name)
    z = zoo.load(name)
    start = time.time()
    v = rates(z.model, z.test_set, FAMILIES[family], images, seed)
    top, score, p = label_scores(torch.tensor(v), int(images * (1 - 1 / len(v))))
    passes = len(v) * images * (FAMILIES[family].epochs + 1 / 3)  # fit (forward+backward), measure (forward)
    print(f"{name} {family}: top {top} z {score:.2f} target {entry.target}", flush=True)
    return {**zoo_cell(entry, "scan", "test", seed, schedule=f"family:{family}"), "family": family, "rates": v,
            "top_label": top, "score": round(score, 3), "p_value": p, "images": 2 * images, "ra": None,
            "acc_before": None, "asr_before": None, "ra_before": None, "der": None, "detection": None,
            "epoch_equivalents": passes / len(z.train_set), "wall_s": round(time.time() - start, 1),
            "zoo_sha256": z.row["sha256"],
            "command": f"python experiments/scan_families.py --dataset {entry.dataset} --only {name} "
                       f"--families {family} --images {images} --seed {seed}",
            "hardware": hardware_string(), "toolkit_version": toolkit_version(),
            "acc": z.row.get("acc"), "asr": z.row.get("asr")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", nargs="*", default=CONFIG["datasets"])
    ap.add_argument("--only", nargs="*", help="zoo names or attacks")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--images", type=int, default=256, help="images that fit each perturbation (as many measure it)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    execute({"script": "scan_families", "datasets": args.dataset, "only": args.only, "families": args.families,
             "images": args.images, "seeds": [args.seed]}, progress=False)


if __name__ == "__main__":
    script_main(main)
