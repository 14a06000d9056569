"""PBE's premise per zoo model -> experiments/results/premise_cifar10.{json,md,png}: for every CIFAR-10
zoo model (dev and generalisation sets, clean ones included), the share of untargeted adversarial
labels that land on the backdoor's target vs the share natural confusion predicts, for per-image
L-inf (2/4/6/8/16 /255), L2 and sparse-patch perturbations and for universal ones; plus the neuron
overlap of triggered, adversarial (L-inf 6/255, the paper's budget) and clean inputs at the last
convolution. One row per model; models with a row (on the committed weights) are skipped.

    python experiments/premise_cifar10.py [--set dev] [--only badnets] [--probe 500] [--seed 0]
"""
from __future__ import annotations

import argparse
import time

import torch
from common import RESULTS, built_zoo_models, zoo_cell
from grid import Cell, execute, median_cost, script_main

from pbe import models, zoo
from pbe.activations import neuron_overlap, probe_indices
from pbe.adversarial import PAPER_PGD, adversarial_examples
from pbe.metrics import predict
from pbe.premise import FAMILIES, label_shares
from pbe.results import ResultsTable, target_cell
from pbe.utils import hardware_string, toolkit_version, use_all_cpus

TOP_K = 10


class PremiseTable(ResultsTable):
    note = (". Each cell: share (%) of the fooled images that land on the target / share natural confusion predicts "
            "(the clean runner-up); clean models: the most attracting label and its share. Neuron overlap: Jaccard "
            f"of the top-{TOP_K} channels at the last convolution (triggered-adversarial vs clean-adversarial).")

    def columns(self):
        def family(i):
            def cell(r):
                m = r["measurements"][i]
                if m["success"] == 0:
                    return "none fooled"
                if m["target_share"] is None:
                    return "–" if m["top_label"] is None else f"[{m['top_label']}] {100 * m['top_share']:.0f}"
                return f"**{100 * m['target_share']:.0f}** / {100 * m['expected_share']:.0f}"
            return cell

        def overlap(r):
            ov = r.get("overlap")
            return "–" if not ov else f"{ov['triggered_adversarial']:.2f} / {ov['clean_adversarial']:.2f}"
        return [("zoo", lambda r: r["zoo"]), ("set", lambda r: r["zoo_set"]), ("attack", lambda r: r["attack"]),
                ("target", target_cell)] + [(f.label, family(i)) for i, f in enumerate(FAMILIES)] + \
            [("overlap trig-adv / clean-adv", overlap)]

    def figure(self):
        """Per infected model and perturbation family, the share of untargeted adversarial labels on the target
        against natural confusion, in one heatmap (``pbe.plots.premise_map``)."""
        from pbe.plots import premise_map
        return premise_map(self.rows)


def run_cell(name: str, probe: int, seed: int) -> dict:
    """One row: the premise probe (every family) and the neuron overlap on a zoo model."""
    entry = zoo.get(name)
    z = zoo.load(name)
    start = time.time()
    test = z.test_set
    keep = torch.ones(len(test), dtype=torch.bool)
    if entry.infected and not entry.all_to_all:
        keep = test.labels != entry.target  # images the backdoor would move
    correct = predict(z.model, test.images) == test.labels
    pool = torch.nonzero(keep & correct).flatten()
    idx = pool[probe_indices(test.labels[pool], probe, seed)]
    x, y = test.images[idx].float() / 255, test.labels[idx]
    shares, passes = label_shares(z.model, x, y, test.num_classes, entry.target if entry.infected else None,
                                  entry.all_to_all, seed=seed)
    overlap = None
    if z.attack is not None:
        x_adv = adversarial_examples(z.model, x, y, PAPER_PGD)
        layer = models.last_conv_name(z.model)
        ov = neuron_overlap(z.model, x, z.attack.apply(x), x_adv, [layer], k=TOP_K)[layer]
        overlap = {**ov["jaccard"], "centroid_distance": ov["centroid_distance"], "layer": layer}
        passes += PAPER_PGD.steps * len(x) + len(x)
    r = z.row
    return {"dataset": r["dataset"], "model": r["model"], "recipe": r["recipe"], "attack": r["attack"],
            "rate": r["rate"], "target": r["target"], "all_to_all": r["all_to_all"], "defense": "none",
            "setting": None, "seed": seed, "acc": r["acc"], "asr": r["asr"], "ra": r["ra"], "acc_before": None,
            "asr_before": None, "ra_before": None, "der": None, "detection": None,
            "wall_s": round(time.time() - start, 1), "epoch_equivalents": passes / len(z.train_set),
            "command": f"python experiments/premise_cifar10.py --only {entry.name} --probe {probe} --seed {seed}",
            "hardware": hardware_string(), "toolkit_version": toolkit_version(), "zoo": entry.name,
            "zoo_set": entry.set, "zoo_sha256": r["sha256"], "probe_size": len(idx),
            "probe_indices": idx.tolist(), "measurements": shares, "overlap": overlap}


def results_table(cfg: dict | None = None) -> PremiseTable:
    """This script's table (``experiments/render.py`` re-renders it)."""
    return PremiseTable(RESULTS / "premise_cifar10", "PBE's premise per zoo model (CIFAR-10)",
                        "python experiments/premise_cifar10.py")


CONFIG = {"set": None, "dataset": "cifar10", "only": None, "probe": 500, "seeds": [0]}
DEFAULT_ESTIMATE = 0.3  # epoch-equivalents of a premise row without one yet


def cells(cfg: dict) -> list[Cell]:
    table = results_table(cfg)
    return [Cell("premise_cifar10", f"{e.name} premise seed {seed}", zoo_cell(e, "none", None, seed),
                 {"name": e.name, "probe": cfg["probe"], "seed": seed}, median_cost(table, DEFAULT_ESTIMATE),
                 zoo=e.name)
            for e in built_zoo_models(cfg["set"], cfg["dataset"], cfg["only"], infected=False) for seed in cfg["seeds"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=("dev", "generalisation"), dest="zoo_set", help="one zoo set (default: both)")
    ap.add_argument("--only", nargs="*", help="zoo names or attacks")
    ap.add_argument("--probe", type=int, default=500, help="test images attacked per model (default 500)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dataset", default="cifar10", help="zoo models of this dataset (default cifar10)")
    args = ap.parse_args()
    use_all_cpus()
    execute({"script": "premise_cifar10", "set": args.zoo_set, "dataset": args.dataset, "only": args.only,
             "probe": args.probe, "seeds": [args.seed]}, progress=False)


if __name__ == "__main__":
    script_main(main)
