"""Does PBE's target scan still name the target at a fraction of its cost? On every GTSRB dev-set zoo model
(the clean one included) PBE's scan (``pbe.detect`` on the possibly poisoned training set, the default
schedule's budget) is run at cheaper budgets (``budget_of``): its fitting images shared
out as if the data had `scan_labels` labels (the steps and the held-out images stay; on 10 labels or fewer,
CIFAR-10's, nothing changes), or fewer passes of smaller steps over all of them (every dataset's scan
changes) -> experiments/results/scan_budget.{json,md,csv}. On 43 labels the full scan is ~2.4 of PBE's
~4.9 epoch-equivalents. A row says which label PBE would act on: the scan's top
label where it is suspected or its robust z reaches the weak-evidence threshold, as in ``PBE``.

    python experiments/scan_budget.py [--only blend clean] [--variants labels10]

Chosen on the GTSRB dev set only; the generalisation set is for reporting.
"""
from __future__ import annotations

import argparse
import time

from common import RESULTS, built_zoo_models, zoo_cell
from grid import Cell, execute, median_cost, script_main

from pbe import zoo
from pbe.defenses.pbe import DEFAULT_SCHEDULE, SCHEDULES, scan_target, weak_evidence_threshold
from pbe.detection import ScanBudget, detect
from pbe.results import ResultsTable, fixed, pct
from pbe.utils import PBEError, hardware_string, toolkit_version

VARIANTS = {  # name -> how the variant changes the table's reference budget (none: every label at 4 x 128)
    "all": {},
    "labels16": {"scan_labels": 16},  # each label's perturbation fitted on 16 labels' images shared out (95 of 256)
    "labels10": {"scan_labels": 10},  # ... on 10 labels' (60 of 256): each step's batch shrinks alike
    "pass1_b16": {"scan_epochs": 1, "scan_batch": 16},  # all 256 images, once, in 16 steps of 16 (~0.3 x the cost)
}
PBE_SCAN = ScanBudget(epochs=4, batch_size=128, label_budget=None)  # PBE's scan when this table was made


def budget_of(fields: dict, num_classes: int) -> dict:
    """The scan budget of a variant's `fields` on `num_classes` labels: PBE's with `scan_epochs` passes of
    `scan_batch`-image steps where given; with more than `scan_labels` labels, its fitting images and each step's
    batch are those of `scan_labels` labels shared out (the steps and the held-out images stay, so the
    optimisation and the rates' precision do)."""
    budget = {"epochs": fields.get("scan_epochs", PBE_SCAN.epochs),
              "batch_size": fields.get("scan_batch", PBE_SCAN.batch_size), "label_budget": PBE_SCAN.label_budget}
    labels = fields.get("scan_labels")
    if labels is None or labels >= num_classes:
        return budget
    return {**budget, "label_budget": labels, "scale_held_out": False,
            "batch_size": max(1, round(budget["batch_size"] * labels / num_classes))}


DEFAULT_ESTIMATE = 1.0  # epoch-equivalents of a scan without a row yet (GTSRB, labels10: ~0.7; all: ~2.4)


def acted_on(r: dict) -> int | None:
    """The label PBE would name from this scan (None: none, so PBE takes the isolation's path)."""
    return r["named"]


def same_path(r: dict, full: dict | None) -> bool | None:
    """Whether PBE takes the same path after this scan as after the full one (`full`, the "all" row of the
    same model; None without one): the same label named by the same family, or none by either."""
    if full is None:
        return None
    named = acted_on(r)
    return named == acted_on(full) and (named is None or r["evidence"] == full["evidence"])


class ScanBudgetTable(ResultsTable):
    note = (". PBE's target scan on the training set at a cheaper budget; z: robust z of the top label; "
            "min z: the weak-evidence threshold at this label count; named: the label PBE acts on (– : none, "
            "the isolation decides); ok: the target named on an infected model (BadNets' path is the isolation's "
            "either way), none on the clean one; as all: PBE takes the same path after this scan as after the "
            "full one (the same label named by the same family, or none), so its run after the scan is the "
            "same. Rates in % of held-out images of other labels.")

    def full(self, r: dict) -> dict | None:
        """The "all" row of `r`'s model and seed."""
        return next((f for f in self.rows if f["variant"] == "all" and f["zoo"] == r["zoo"] and f["seed"] == r["seed"]),
                    None)

    def columns(self):
        def to_target(r):
            if r["target"] is None:
                return "–"
            return pct(r["warp_rates"][r["target"]] if r["evidence"] == "warp" else r["rates"][r["target"]], 1)

        def ok(r):
            named = acted_on(r)
            return "yes" if named == r["target"] or (r["target"] is None and named is None) else "**no**"
        return [("zoo", lambda r: r["zoo"]), ("variant", lambda r: r["variant"]),
                ("target", lambda r: "–" if r["target"] is None else str(r["target"])),
                ("evidence", lambda r: r["evidence"]), ("top label", lambda r: str(r["top_label"])),
                ("z", lambda r: fixed(r["score"])), ("min z", lambda r: fixed(r["min_z"])),
                ("rate to target", to_target),
                ("named", lambda r: "–" if acted_on(r) is None else str(acted_on(r))), ("ok", ok),
                ("as all", lambda r: {None: "–", True: "yes", False: "**no**"}[same_path(r, self.full(r))]),
                ("epoch-eq.", lambda r: fixed(r["epoch_equivalents"])), ("wall s", lambda r: fixed(r["wall_s"], 0))]

    def summary(self) -> str:
        lines = []
        for dataset in sorted({r["dataset"] for r in self.rows}):
            for v in VARIANTS:
                rows = [r for r in self.rows if r["dataset"] == dataset and r["variant"] == v]
                if rows:
                    same = [same_path(r, self.full(r)) for r in rows]
                    cost = sum(r["epoch_equivalents"] for r in rows) / len(rows)
                    lines.append(f"- {dataset}, {v}: PBE's path as after the full scan on {same.count(True)} of "
                                 f"{len(same) - same.count(None)} models; mean cost {cost:.2f} epoch-equivalents.")
        return "\n".join(lines)


def results_table(cfg: dict | None = None) -> ScanBudgetTable:
    """This script's table (``experiments/render.py`` re-renders it)."""
    return ScanBudgetTable(RESULTS / "scan_budget", "PBE's target scan at cheaper budgets, dev-set zoo",
                           "python experiments/scan_budget.py")


CONFIG = {"dataset": "gtsrb", "only": None, "variants": list(VARIANTS), "seeds": [0]}


def cells(cfg: dict) -> list[Cell]:
    unknown = set(cfg["variants"]) - set(VARIANTS)
    if unknown:
        raise PBEError(f"scan_budget: unknown variants {sorted(unknown)}; available: {', '.join(VARIANTS)}")
    table = results_table(cfg)
    return [Cell("scan_budget", f"{e.name} {v} seed {seed}", zoo_cell(e, "scan", "train", seed, schedule=f"scan:{v}"),
                 {"name": e.name, "variant": v, "seed": seed}, median_cost(table, DEFAULT_ESTIMATE, variant=v),
                 zoo=e.name)
            for e in built_zoo_models("dev", cfg["dataset"], cfg["only"], infected=False)
            for v in cfg["variants"] for seed in cfg["seeds"]]


def run_cell(name: str, variant: str, seed: int) -> dict:
    """One row: PBE's scan on a zoo model's training set at one variant's budget."""
    entry = zoo.get(name)
    z = zoo.load(name)
    data = z.train_set
    s = SCHEDULES[DEFAULT_SCHEDULE]
    budget = budget_of(VARIANTS[variant], data.num_classes)
    start = time.time()
    d = detect(z.model, data, budget=ScanBudget(**budget), l2_rms=s.scan_l2_rms, seed=seed)  # as PBE calls it
    ee = d.epoch_equivalents(len(data))
    print(f"{name} {variant}: top {d.top_label} z {d.score:.2f} ({d.evidence}) target {entry.target} "
          f"ee {ee:.2f}", flush=True)
    return {**zoo_cell(entry, "scan", "train", seed, schedule=f"scan:{variant}"), "variant": variant,
            "scan_fields": VARIANTS[variant], "budget": budget, "suspected": d.suspected, "top_label": d.top_label,
            "score": d.score, "p_value": d.p_value, "evidence": d.evidence, "scores": d.scores,
            "named": scan_target(d, data.num_classes),
            "min_z": round(weak_evidence_threshold(data.num_classes), 3),
            "rates": d.rates, "warp_rates": d.warp_rates, "images": d.images,
            "forward_backward": d.forward_backward, "forward": d.forward, "epoch_equivalents": ee,
            "wall_s": round(time.time() - start, 1), "acc": z.row.get("acc"), "asr": z.row.get("asr"), "ra": None,
            "acc_before": None, "asr_before": None, "ra_before": None, "der": None, "detection": None,
            "zoo_sha256": z.row["sha256"],
            "command": f"python experiments/scan_budget.py --dataset {entry.dataset} --only {name} "
                       f"--variants {variant} --seed {seed}",
            "hardware": hardware_string(), "toolkit_version": toolkit_version()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default=CONFIG["dataset"], choices=("cifar10", "gtsrb"))
    ap.add_argument("--only", nargs="*", help="zoo names or attacks")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    args = vars(ap.parse_args())
    execute({"script": "scan_budget", "seeds": [args.pop("seed")], **args}, progress=False)


if __name__ == "__main__":
    script_main(main)
