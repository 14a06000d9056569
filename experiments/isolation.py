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
from common import HERE, add_zoo_args, same_zoo_model, selected_zoo_models, zoo_cell

from pbe import zoo
from pbe.models import penultimate
from pbe.isolation import MIN_FOOLING, MIN_MARGIN, SILHOUETTE_MIN, isolate
from pbe.results import ResultsTable
from pbe.utils import hardware_string, toolkit_version


class IsolationTable(ResultsTable):
    def markdown(self) -> str:
        lines = self.head(f". Candidate labels: silhouette >= {SILHOUETTE_MIN}; flagged when a cluster's estimated "
                          f"trigger moves >= {MIN_FOOLING:.0%} of held-out images of other labels and {MIN_MARGIN:.0%} "
                          "more than the other cluster's. Precision / recall: of the suspected samples against the "
                          "poison indices (%).",
                          ["zoo", "set", "attack", "target", "silhouettes (min / median / max)", "candidates",
                           "fooling (poison cluster / other)", "flagged", "suspected", "precision", "recall",
                           "epoch-eq.", "wall s", "hardware"])
        def pct(v):
            return "–" if v is None else f"{100 * v:.1f}"
        for r in self.rows:
            sil = sorted(r["silhouettes"])
            fool = "; ".join(f"{k}: {max(v):.2f} / {min(v):.2f}" for k, v in r["fooling"].items()) or "–"
            target = "all-to-all" if r["all_to_all"] else ("–" if r["target"] is None else r["target"])
            lines.append(f"| {r['zoo']} | {r['zoo_set']} | {r['attack']} | {target} | {sil[0]:.2f} / "
                         f"{sil[len(sil) // 2]:.2f} / {sil[-1]:.2f} | {len(r['fooling'])} | {fool} | "
                         f"{', '.join(map(str, r['flagged'])) or '–'} | {r['suspected']} | {pct(r['precision'])} | "
                         f"{pct(r['recall'])} | {r['epoch_equivalents']:.2f} | {r['wall_s']:.0f} | {r['hardware']} |")
        return "\n".join(lines) + "\n\nPer-label silhouettes and fooling rates, commands and seeds are in the JSON.\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_zoo_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    table = IsolationTable(HERE / "results" / "isolation", "Poison isolation on the zoo (training set, no clean data)",
                           "python experiments/isolation.py")
    for entry in selected_zoo_models(args):
        name = entry.name
        cell = zoo_cell(entry, "isolate", "train", args.seed)
        if same_zoo_model(table.find(**cell), entry):
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
        print(f"{name}: flagged {iso.flagged} suspected {int(s.sum())} precision {precision} recall {recall}",
              flush=True)


if __name__ == "__main__":
    main()
