"""Clean CIFAR-10 models of the `quick` and `cpu` recipes -> experiments/results/clean_cifar10.{json,md}.

Each cell runs the exact CLI command recorded in its row; cells with a row are skipped.

    python experiments/clean_cifar10.py [--data-root ../shared/data/cifar10] [--recipes quick cpu] [--seed 0]
"""
from __future__ import annotations

import argparse

from common import RESULTS, RUNS, TrainedTable, run_cell, trained_row



def results_table() -> TrainedTable:
    """This script's table (``experiments/render.py`` re-renders it)."""
    return TrainedTable(RESULTS / "clean_cifar10", "Clean CIFAR-10 models",
                        "python experiments/clean_cifar10.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-root", default="../shared/data/cifar10")
    ap.add_argument("--recipes", nargs="+", default=["quick", "cpu"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    table = results_table()
    for recipe in args.recipes:
        cell = dict(dataset="cifar10", model="preact_resnet18(width=16)", recipe=recipe, attack="none", rate=0.0,
                    target=None, all_to_all=False, defense="none", setting=None, seed=args.seed)
        if table.find(**cell):
            print(f"skip {recipe}: already in the table")
            continue
        out = RUNS / "clean_cifar10" / f"{recipe}_seed{args.seed}"
        m = run_cell(["pbe", "train", "--dataset", "cifar10", "--data-root", args.data_root, "--recipe", recipe,
                      "--seed", str(args.seed), "--out", str(out), "--no-progress"], out)
        table.add(trained_row(cell, m, out))
        print(f"{recipe}: acc={m['acc']:.4f} wall={m['wall_s']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
