"""Poison isolation (``pbe.isolation``) on every zoo model -> experiments/results/isolation.{json,md}: per
model, the per-label silhouettes of the activation clusters, the labels flagged, how much each
candidate cluster's estimated trigger moves the model, and the precision / recall of the suspected
samples against the true poison indices (used for this table only). Models with a row on the
committed weights are skipped (and rows made before the whole-label test where nothing was flagged).

    python experiments/isolation.py [--set dev] [--dataset cifar10] [--only badnets_a2a] [--seed 0]

``SILHOUETTE_MIN``, ``MIN_FOOLING`` and ``MIN_MARGIN`` were chosen on the CIFAR-10 dev rows; the
generalisation rows only report.
"""
from __future__ import annotations

import argparse
import time

import torch
from common import RESULTS, add_zoo_args, built_zoo_models, zoo_cell
from grid import Cell, execute, median_cost, script_main

from pbe import zoo
from pbe.models import penultimate
from pbe.isolation import MIN_CHANGE_RATIO, MIN_FOOLING, MIN_MARGIN, SILHOUETTE_MIN, isolate
from pbe.results import ResultsTable, fixed, pct, target_cell
from pbe.utils import hardware_string, toolkit_version


class IsolationTable(ResultsTable):
    note = (f". Candidate labels: silhouette >= {SILHOUETTE_MIN}; flagged when a cluster's estimated trigger moves >= "
            f"{MIN_FOOLING:.0%} of held-out images of other labels and {MIN_MARGIN:.0%} more than the other cluster's, "
            f"or at least as many at a change per pixel {MIN_CHANGE_RATIO:g} times smaller (change: mean absolute "
            "change per pixel of each estimate, in rows made since that rule). "
            "Whole label: where no cluster is flagged, a label whose all-sample trigger moves >= "
            f"{MIN_FOOLING:.0%}, {MIN_MARGIN:.0%} more than the next label's (rows made before that test: –). "
            "Precision / recall: of the suspected samples against the poison indices (%).")

    def columns(self):
        def silhouettes(r):
            sil = sorted(r["silhouettes"])
            return f"{sil[0]:.2f} / {sil[len(sil) // 2]:.2f} / {sil[-1]:.2f}"

        def whole(r):
            rates = r.get("whole_fooling")
            if rates is None:
                return "–"
            top = sorted(rates, reverse=True)
            return f"{'–' if r['whole_label'] is None else r['whole_label']} ({top[0]:.2f} / {top[1]:.2f})"

        def fooling(r):
            out = []
            for k, v in r["fooling"].items():
                hi = max(range(2), key=v.__getitem__)
                ch = r.get("change", {}).get(k)
                out.append(f"{k}: {v[hi]:.2f} / {v[1 - hi]:.2f}" + ("" if ch is None else
                                                                    f" ({ch[hi]:.3f} / {ch[1 - hi]:.3f})"))
            return "; ".join(out) or "–"
        return [("zoo", lambda r: r["zoo"]), ("set", lambda r: r["zoo_set"]), ("attack", lambda r: r["attack"]),
                ("target", target_cell), ("silhouettes (min / median / max)", silhouettes),
                ("candidates", lambda r: str(len(r["fooling"]))),
                ("fooling (higher / other) and change", fooling),
                ("flagged", lambda r: ", ".join(map(str, r["flagged"])) or "–"),
                ("whole label (its fooling / next)", whole), ("suspected", lambda r: str(r["suspected"])),
                ("precision", lambda r: pct(r["precision"], 1)), ("recall", lambda r: pct(r["recall"], 1)),
                ("epoch-eq.", lambda r: fixed(r["epoch_equivalents"])), ("wall s", lambda r: fixed(r["wall_s"], 0))]


def results_table(cfg: dict | None = None) -> IsolationTable:
    """This script's table (``experiments/render.py`` re-renders it)."""
    return IsolationTable(RESULTS / "isolation", "Poison isolation on the zoo (training set, no clean data)",
                          "python experiments/isolation.py")


CONFIG = {"set": None, "dataset": None, "only": None, "seeds": [0]}
DEFAULT_ESTIMATE = 0.4  # epoch-equivalents of an isolation without a row yet


def stale(row: dict) -> bool:
    """Rows made before the whole-label test (step 4), where no cluster was flagged, are redone."""
    return not row["flagged"] and "whole_label" not in row


def cells(cfg: dict) -> list[Cell]:
    table = results_table(cfg)
    return [Cell("isolation", f"{e.name} isolation seed {seed}", zoo_cell(e, "isolate", "train", seed),
                 {"name": e.name, "seed": seed}, median_cost(table, DEFAULT_ESTIMATE, dataset=e.dataset), zoo=e.name)
            for e in built_zoo_models(cfg["set"], cfg["dataset"], cfg["only"], infected=False) for seed in cfg["seeds"]]


def run_cell(name: str, seed: int) -> dict:
    """One row: ``pbe.isolation.isolate`` on a zoo model's training set, scored against its poison indices."""
    entry = zoo.get(name)
    z = zoo.load(name)
    start = time.time()
    data = z.train_set
    feats = penultimate(z.model, data.images)
    iso, passes = isolate(z.model, data.images, data.labels, feats, torch.Generator().manual_seed(seed), seed)
    poison = torch.zeros(len(data), dtype=torch.bool)
    indices = getattr(data, "poison_indices", None)
    if indices is not None:
        poison[indices] = True
    s = iso.suspected
    precision = float(poison[s].float().mean()) if s.any() else None
    recall = float(s[poison].float().mean()) if poison.any() else None
    print(f"{name}: flagged {iso.flagged} whole label {iso.whole_label} suspected {int(s.sum())} "
          f"precision {precision} recall {recall}", flush=True)
    r = z.row
    return {**zoo_cell(entry, "isolate", "train", seed), "acc": r["acc"], "asr": r["asr"], "ra": r["ra"],
            "acc_before": None, "asr_before": None, "ra_before": None, "der": None, "detection": None,
            **iso.as_dict(), "precision": precision, "recall": recall, "poison": int(poison.sum()),
            "wall_s": round(time.time() - start, 1), "epoch_equivalents": (len(data) + passes) / 3 / len(data),
            "command": f"python experiments/isolation.py --only {name} --seed {seed}",
            "hardware": hardware_string(), "toolkit_version": toolkit_version(), "zoo_sha256": r["sha256"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_zoo_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    execute({"script": "isolation", "set": args.zoo_set, "dataset": args.dataset, "only": args.only,
             "seeds": [args.seed]}, progress=False)


if __name__ == "__main__":
    script_main(main)
