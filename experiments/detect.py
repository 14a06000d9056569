"""Trigger-free detection on every zoo model -> experiments/results/detect.{json,md}: one row per model
(CIFAR-10 and GTSRB, dev and generalisation sets, clean ones included) with the verdict, the named
label, the score and its p-value, and the cost; the summary gives the ROC-AUC of the score over all
models and each model's margin to the threshold. Models with a row on the committed weights are skipped.

    python experiments/detect.py [--set dev] [--dataset cifar10] [--only badnets] [--split test] [--seed 0]

The defaults of ``pbe.detection`` were chosen on the dev set; the generalisation rows only report.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
from common import RESULTS, add_zoo_args, built_zoo_models, zoo_cell
from grid import Cell, execute, median_cost, script_main
from sklearn.metrics import roc_auc_score

from pbe import zoo
from pbe.detection import ALPHA, METHOD, detect
from pbe.results import ResultsTable, fixed, target_cell
from pbe.utils import PBEError, hardware_string, toolkit_version


def threshold_z(alpha: float, num_classes: int) -> float:
    """The score at which the p-value of the max of `num_classes` normals equals `alpha`."""
    lo, hi = 0.0, 40.0
    for _ in range(100):
        mid = (lo + hi) / 2
        p = 1 - (0.5 * (1 + math.erf(mid / math.sqrt(2)))) ** num_classes
        lo, hi = (mid, hi) if p > alpha else (lo, mid)
    return hi


def verdict_ok(r: dict, model_only: bool = False) -> bool:
    """Infected: flagged with its target (all-to-all: flagged, a label map or no single target);
    clean: not flagged. `model_only`: a verdict the training labels' share decided counts as no flag."""
    suspected = r["suspected"] and not (model_only and r.get("evidence") == "label_share")
    if r["attack"] == "none":
        return not suspected
    if r["all_to_all"]:
        return suspected or r["label_map"] is not None
    return suspected and r["label"] == r["target"]


def _method(row: dict) -> str:
    """The detection method's number (``pbe.detection.METHOD``; rows before it was recorded: 1)."""
    return row.get("method", "1").split(":")[0]


class DetectTable(ResultsTable):
    note = (f". Score: robust z of the most reachable label (pbe.detection); suspected when p < {ALPHA}. Margin: "
            f"score minus the score at p = {ALPHA} (Bonferroni over the statistics tried). Methods: 1 universal L2 "
            f"(+ gap); {METHOD}. Share z: robust z of the training labels' share over the test labels' (a tell of the "
            f"data, not the model: it decides only where nothing else does, evidence \"label_share\"). ok: infected "
            f"flagged with its target, clean not flagged; model only: the same without the label share.")

    def columns(self):
        def label(r):
            return str(r["label"]) if r["label"] is not None else ("map" if r.get("label_map") else "–")
        return [("zoo", lambda r: r["zoo"]), ("set", lambda r: r["zoo_set"]), ("data", lambda r: r["setting"]),
                ("method", _method), ("attack", lambda r: r["attack"]), ("target", target_cell),
                ("suspected", lambda r: "yes" if r["suspected"] else "no"), ("label", label),
                ("evidence", lambda r: r.get("evidence", "universal")), ("score", lambda r: fixed(r["score"])),
                ("p-value", lambda r: f"{r['p_value']:.2g}"), ("margin", lambda r: f"{r['margin']:+.2f}"),
                ("share z", lambda r: fixed(r.get("share_score"))),
                ("ok", lambda r: "yes" if verdict_ok(r) else "**no**"),
                ("ok, model only", lambda r: "yes" if verdict_ok(r, model_only=True) else "**no**"),
                ("epoch-eq.", lambda r: fixed(r["epoch_equivalents"])), ("wall s", lambda r: fixed(r["wall_s"], 0))]

    def summary(self) -> str:
        def group(r):  # rows compare only within one dataset, set, data and detection method
            return r["dataset"], r["zoo_set"], r["setting"], _method(r)
        lines = []
        for key in sorted({group(r) for r in self.rows}):
            dataset, zoo_set, split, method = key
            rows = [r for r in self.rows if group(r) == key]
            infected = torch.tensor([r["attack"] != "none" for r in rows])
            scores = torch.tensor([r["score"] for r in rows])
            auc = roc_auc_score(infected.numpy(), scores.numpy()) if 0 < int(infected.sum()) < len(rows) else None
            lines.append(f"- {dataset} {zoo_set}, {split} data, method {method}: {sum(verdict_ok(r) for r in rows)} "
                         f"of {len(rows)} verdicts right ({sum(verdict_ok(r, True) for r in rows)} without the label "
                         f"share); ROC-AUC of the score, infected vs clean: {fixed(auc, 3)}; "
                         f"mean cost {sum(r['epoch_equivalents'] for r in rows) / len(rows):.2f} epoch-equivalents.")
        breakdown = self.breakdown()
        return "\n".join(lines) + ("\n" + breakdown if breakdown else "")

    def breakdown(self) -> str:
        """Per zoo set, with the current method and the defender's test and training data: the verdicts right per
        attack, architecture family and poison rate, clean models apart."""
        current = [r for r in self.rows if r.get("method") == METHOD and r["setting"] == "test+train"]
        lines = []
        for dataset, zoo_set in sorted({(r["dataset"], r["zoo_set"]) for r in current}):
            rows = [r for r in current if (r["dataset"], r["zoo_set"]) == (dataset, zoo_set)]
            lines += ["", f"### {dataset} {zoo_set} set: verdicts right", "", "| group | models | right |",
                      "|---|---|---|"]
            groups = [("attack", lambda r: "none (clean)" if r["attack"] == "none" else
                       r["attack"] + (" all-to-all" if r["all_to_all"] else "")),
                      ("architecture", lambda r: r["model"].split("(")[0]),
                      ("poison rate", lambda r: "clean" if r["attack"] == "none" else f"{100 * r['rate']:g} %")]
            for title, key in groups:
                for value in sorted({key(r) for r in rows}):
                    rs = [r for r in rows if key(r) == value]
                    lines.append(f"| {title}: {value} | {len(rs)} | {sum(map(verdict_ok, rs))} of {len(rs)} |")
        return "\n".join(lines)


def results_table(cfg: dict | None = None) -> DetectTable:
    """This script's table (``experiments/render.py`` re-renders it)."""
    return DetectTable(RESULTS / "detect", "Trigger-free detection on the zoo",
                       "python experiments/detect.py")


CONFIG = {"set": None, "dataset": None, "only": None, "split": "test+train", "seeds": [0]}
SPLITS = ("test+train", "test", "train")
DEFAULT_ESTIMATE = 0.5  # epoch-equivalents of a detection without a row yet (CIFAR-10 dev, method 7: 0.47-0.50)


def stale(row: dict) -> bool:
    """Rows of an older detection method are redone."""
    return row.get("method") != METHOD


def cells(cfg: dict) -> list[Cell]:
    if cfg["split"] not in SPLITS:
        raise PBEError(f"detect: split must be one of {SPLITS}, got {cfg['split']!r}")
    table = results_table(cfg)
    return [Cell("detect", f"{e.name} detect {cfg['split']} seed {seed}", zoo_cell(e, "detect", cfg["split"], seed),
                 {"name": e.name, "split": cfg["split"], "seed": seed},
                 median_cost(table, DEFAULT_ESTIMATE, dataset=e.dataset, method=METHOD), zoo=e.name)
            for e in built_zoo_models(cfg["set"], cfg["dataset"], cfg["only"], infected=False) for seed in cfg["seeds"]]


def run_cell(name: str, split: str, seed: int) -> dict:
    """One row: ``pbe.detect`` on a zoo model with the defender's data of `split` (the `setting` key)."""
    entry = zoo.get(name)
    z = zoo.load(name)
    start = time.time()
    images = z.train_set if split == "train" else z.test_set
    d = detect(z.model, images, seed=seed, train_data=z.train_set if split == "test+train" else None)
    r = z.row
    print(f"{name}: suspected {d.suspected} label {d.label} (target {entry.target}) score {d.score:.2f} "
          f"p {d.p_value:.2g} ee {d.epoch_equivalents(len(z.train_set)):.2f}", flush=True)
    return {**zoo_cell(entry, "detect", split, seed), "acc": r["acc"], "asr": r["asr"], "ra": r["ra"],
            "acc_before": None, "asr_before": None, "ra_before": None, "der": None, "detection": None,
            "suspected": d.suspected, "label": d.label, "top_label": d.top_label, "score": d.score,
            "p_value": d.p_value, "alpha": d.alpha,
            "margin": d.score - threshold_z(d.alpha / len(d.scores), len(d.rates)), "rates": d.rates,
            "label_map": d.label_map, "method": METHOD, "evidence": d.evidence,
            "per_image_rates": d.per_image_rates, "scores": d.scores, "gap": d.gap, "gap_score": d.gap_score,
            "cluster_labels": d.cluster_labels, "share": d.share, "share_score": d.share_score, "images": d.images,
            "wall_s": round(time.time() - start, 1),
            "epoch_equivalents": d.epoch_equivalents(len(z.train_set)),
            "command": f"python experiments/detect.py --only {name} --split {split} --seed {seed}",
            "hardware": hardware_string(), "toolkit_version": toolkit_version(), "zoo_sha256": r["sha256"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_zoo_args(ap)
    ap.add_argument("--split", choices=SPLITS, default="test+train",
                    help="the defender's data: the test set and the labelled, possibly poisoned training set "
                    "(default), the test set only, or the training set only")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    execute({"script": "detect", "set": args.zoo_set, "dataset": args.dataset, "only": args.only, "split": args.split,
             "seeds": [args.seed]}, progress=False)


if __name__ == "__main__":
    script_main(main)
