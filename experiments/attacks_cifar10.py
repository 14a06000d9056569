"""Infected CIFAR-10 models of the zoo -> experiments/results/attacks_cifar10.{json,md}: one row per
built zoo model (clean ones included, as the ACC reference), with its ACC drop against the clean
model of the same set and architecture. `--build` first trains what is missing (resumable, through
`pbe zoo build`); without it the table is refreshed from what the zoo holds. Rows made before the zoo
existed (`quick` recipe, no "zoo" key) stay in the table.

    python experiments/attacks_cifar10.py [--set dev] [--build] [--only badnets wanet]
"""
from __future__ import annotations

import argparse

from common import RESULTS, TrainedTable, zoo_cell, zoo_models
from grid import Cell, execute, script_main

from pbe import zoo

def clean_reference(entry: zoo.Entry) -> dict | None:
    """The row of a built clean zoo model of the same architecture, the dev set's first."""
    clean = [e for e in zoo_models(None, entry.dataset, infected=False)
             if not e.infected and (e.model, e.width) == (entry.model, entry.width) and zoo.is_built(e.name)]
    clean.sort(key=lambda e: e.set != "dev")
    return zoo.row(clean[0].name) if clean else None


def results_table(cfg: dict | None = None) -> TrainedTable:
    """This script's table (``experiments/render.py`` re-renders it)."""
    return TrainedTable(RESULTS / "attacks_cifar10", "Infected CIFAR-10 models (the zoo)",
                        "python experiments/attacks_cifar10.py [--build]")


CONFIG = {"set": None, "only": None, "build": False}
EPOCHS_ESTIMATE = 15.0  # epoch-equivalents of building a zoo model (the cpu recipe's epochs)


def cells(cfg: dict) -> list[Cell]:
    out = []
    for entry in zoo_models(cfg["set"], "cifar10", cfg["only"], infected=False):
        if not (cfg["build"] or zoo.is_built(entry.name)):
            print(f"skip {entry.name}: not built (set build: true, or pbe zoo build {entry.name})", flush=True)
            continue
        built = zoo.is_built(entry.name)  # not built yet: a key no row has, so the cell is pending
        key = zoo_cell(entry, "none", None, entry.seed) if built else {"zoo": entry.name, "defense": "to build"}
        out.append(Cell("attacks_cifar10", f"{entry.name} {'row' if built else 'build'}", key,
                        {"name": entry.name, "build": cfg["build"]}, 0.0 if built else EPOCHS_ESTIMATE, zoo=None))
    return out


def stale(row: dict) -> bool:
    """A row whose zoo model was rebuilt since (its weights' sha256 changed) is refreshed."""
    return bool(row.get("zoo")) and zoo.is_built(row["zoo"]) and row.get("sha256") != zoo.row(row["zoo"])["sha256"]


def run_cell(name: str, build: bool) -> dict:
    """One row: a zoo model's committed row (built first when `build`), with its ACC drop against the
    clean model of the same set and architecture."""
    if build:
        zoo.build(name)
    entry = zoo.get(name)
    row = {k: v for k, v in zoo.row(name).items() if k != "train_log"}
    ref = clean_reference(entry)
    row["clean_model"] = ref and ref["zoo"]
    row["clean_model_acc"] = ref and ref["acc"]
    row["acc_drop_vs_clean"] = None if ref is None else ref["acc"] - row["acc"]
    asr = "–" if row["asr"] is None else f"{100 * row['asr']:.2f}"
    print(f"{name}: acc {100 * row['acc']:.2f} asr {asr}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default=None, choices=("dev", "generalisation"), dest="zoo_set",
                    help="one zoo set (default: both)")
    ap.add_argument("--build", action="store_true", help="train zoo models that are missing first")
    ap.add_argument("--only", nargs="*", help="zoo names or attacks")
    args = ap.parse_args()
    execute({"script": "attacks_cifar10", "set": args.zoo_set, "only": args.only, "build": args.build}, progress=False)


if __name__ == "__main__":
    script_main(main)
