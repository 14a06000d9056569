"""Poison isolation (``pbe.isolation``) on every zoo model -> experiments/results/isolation.{json,md}: per
model, the per-label silhouettes of the activation clusters, the labels flagged, how much each
candidate cluster's estimated trigger moves the model, and the precision / recall of the suspected
samples against the true poison indices (used for this table only). Models with a row on the
committed weights are skipped.

    python experiments/isolation.py [--set dev] [--dataset cifar10] [--only badnets_a2a] [--seed 0]

``SILHOUETTE_MIN``, ``MIN_FOOLING`` and ``MIN_MARGIN`` were chosen on the CIFAR-10 dev rows; the
generalisation rows only report.
"""
from __future__ import annotations

import argparse
import time

import torch
from common import RESULTS, add_zoo_args, same_zoo_model, selected_zoo_models, zoo_cell

from pbe import zoo
from pbe.models import penultimate
from pbe.isolation import MIN_FOOLING, MIN_MARGIN, SILHOUETTE_MIN, isolate
from pbe.results import ResultsTable, fixed, pct, target_cell
from pbe.utils import hardware_string, toolkit_version


class IsolationTable(ResultsTable):
    note = (f". Candidate labels: silhouette >= {SILHOUETTE_MIN}; flagged when a cluster's estimated trigger moves >= "
            f"{MIN_FOOLING:.0%} of held-out images of other labels and {MIN_MARGIN:.0%} more than the other cluster's. "
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
        return [("zoo", lambda r: r["zoo"]), ("set", lambda r: r["zoo_set"]), ("attack", lambda r: r["attack"]),
                ("target", target_cell), ("silhouettes (min / median / max)", silhouettes),
                ("candidates", lambda r: str(len(r["fooling"]))),
                ("fooling (poison cluster / other)",
                 lambda r: "; ".join(f"{k}: {max(v):.2f} / {min(v):.2f}" for k, v in r["fooling"].items()) or "–"),
                ("flagged", lambda r: ", ".join(map(str, r["flagged"])) or "–"),
                ("whole label (its fooling / next)", whole), ("suspected", lambda r: str(r["suspected"])),
                ("precision", lambda r: pct(r["precision"], 1)), ("recall", lambda r: pct(r["recall"], 1)),
                ("epoch-eq.", lambda r: fixed(r["epoch_equivalents"])), ("wall s", lambda r: fixed(r["wall_s"], 0))]


def results_table() -> IsolationTable:
    """This script's table (``experiments/render.py`` re-renders it)."""
    return IsolationTable(RESULTS / "isolation", "Poison isolation on the zoo (training set, no clean data)",
                          "python experiments/isolation.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_zoo_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    table = results_table()
    for entry in selected_zoo_models(args):
        name = entry.name
        cell = zoo_cell(entry, "isolate", "train", args.seed)
        old = table.find(**cell)
        if same_zoo_model(old, entry) and (old["flagged"] or "whole_label" in old):  # else: made before step 4
            print(f"skip {name}: already in the table", flush=True)
            continue
        z = zoo.load(name)
        start = time.time()
        data = z.train_set
        feats = penultimate(z.model, data.images)
        iso, passes = isolate(z.model, data.images, data.labels, feats, torch.Generator().manual_seed(args.seed),
                              args.seed)
        poison = torch.zeros(len(data), dtype=torch.bool)
        indices = getattr(data, "poison_indices", None)
        if indices is not None:
            poison[indices] = True
        s = iso.suspected
        precision = float(poison[s].float().mean()) if s.any() else None
        recall = float(s[poison].float().mean()) if poison.any() else None
        r = z.row
        table.add({**cell, "acc": r["acc"], "asr": r["asr"], "ra": r["ra"], "acc_before": None, "asr_before": None,
                   "ra_before": None, "der": None, "detection": None, **iso.as_dict(), "precision": precision,
                   "recall": recall, "poison": int(poison.sum()), "wall_s": round(time.time() - start, 1),
                   "epoch_equivalents": (len(data) + passes) / 3 / len(data),
                   "command": f"python experiments/isolation.py --only {name} --seed {args.seed}",
                   "hardware": hardware_string(), "toolkit_version": toolkit_version(), "zoo_sha256": r["sha256"]})
        print(f"{name}: flagged {iso.flagged} whole label {iso.whole_label} suspected {int(s.sum())} "
              f"precision {precision} recall {recall}",
              flush=True)


if __name__ == "__main__":
    main()
