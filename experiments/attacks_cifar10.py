"""Infected CIFAR-10 models of the zoo -> experiments/results/attacks_cifar10.{json,md}: one row per
built zoo model (clean ones included, as the ACC reference), with its ACC drop against the clean
model of the same set and architecture. `--build` first trains what is missing (resumable, through
`pbe zoo build`); without it the table is refreshed from what the zoo holds. Rows made before the zoo
existed (`quick` recipe, no "zoo" key) stay in the table.

    python experiments/attacks_cifar10.py [--set dev] [--build] [--only badnets wanet]
"""
from __future__ import annotations

import argparse

from common import RESULTS, TrainedTable, zoo_models

from pbe import zoo

def clean_reference(entry: zoo.Entry) -> dict | None:
    """The row of a built clean zoo model of the same architecture, the dev set's first."""
    clean = [e for e in zoo_models(None, entry.dataset, infected=False)
             if not e.infected and (e.model, e.width) == (entry.model, entry.width) and zoo.is_built(e.name)]
    clean.sort(key=lambda e: e.set != "dev")
    return zoo.row(clean[0].name) if clean else None


def results_table() -> TrainedTable:
    """This script's table (``experiments/render.py`` re-renders it)."""
    return TrainedTable(RESULTS / "attacks_cifar10", "Infected CIFAR-10 models (the zoo)",
                        "python experiments/attacks_cifar10.py [--build]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default=None, choices=("dev", "generalisation"), dest="zoo_set",
                    help="one zoo set (default: both)")
    ap.add_argument("--build", action="store_true", help="train zoo models that are missing first")
    ap.add_argument("--only", nargs="*", help="zoo names or attacks")
    args = ap.parse_args()
    table = results_table()
    entries = zoo_models(args.zoo_set, "cifar10", args.only, infected=False)
    for entry in entries:
        if args.build:
            zoo.build(entry.name)
        if not zoo.is_built(entry.name):
            print(f"skip {entry.name}: not built (pass --build, or pbe zoo build {entry.name})")
            continue
        row = {k: v for k, v in zoo.row(entry.name).items() if k != "train_log"}
        ref = clean_reference(entry)
        row["clean_model"] = ref and ref["zoo"]
        row["clean_model_acc"] = ref and ref["acc"]
        row["acc_drop_vs_clean"] = None if ref is None else ref["acc"] - row["acc"]
        table.add(row)
        asr = "–" if row["asr"] is None else f"{100 * row['asr']:.2f}"
        print(f"{entry.name}: acc {100 * row['acc']:.2f} asr {asr}", flush=True)


if __name__ == "__main__":
    main()
