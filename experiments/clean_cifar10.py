"""Clean CIFAR-10 models of the `quick` and `cpu` recipes -> experiments/results/clean_cifar10.{json,md}.

Each cell runs the exact CLI command recorded in its row; cells with a row are skipped.

    python experiments/clean_cifar10.py [--data-root ../shared/data/cifar10] [--recipes quick cpu] [--seed 0]
"""
from __future__ import annotations

import argparse

from common import RESULTS, RUNS, TrainedTable, trained_row
from common import run_cell as run_command
from grid import Cell, execute, script_main



def results_table(cfg: dict | None = None) -> TrainedTable:
    """This script's table (``experiments/render.py`` re-renders it)."""
    return TrainedTable(RESULTS / "clean_cifar10", "Clean CIFAR-10 models",
                        "python experiments/clean_cifar10.py")


CONFIG = {"data_root": "../shared/data/cifar10", "recipes": ["quick", "cpu"], "seeds": [0]}


def _key(recipe: str, seed: int) -> dict:
    return dict(dataset="cifar10", model="preact_resnet18(width=16)", recipe=recipe, attack="none", rate=0.0,
                target=None, all_to_all=False, defense="none", setting=None, seed=seed)


def cells(cfg: dict) -> list[Cell]:
    from pbe.train import RECIPES
    return [Cell("clean_cifar10", f"clean {recipe} seed {seed}", _key(recipe, seed),
                 {"recipe": recipe, "seed": seed, "data_root": cfg["data_root"]}, float(RECIPES[recipe].epochs))
            for recipe in cfg["recipes"] for seed in cfg["seeds"]]


def run_cell(recipe: str, seed: int, data_root: str) -> dict:
    """One row: ``pbe train`` of a clean model with a recipe."""
    out = RUNS / "clean_cifar10" / f"{recipe}_seed{seed}"
    m = run_command(["pbe", "train", "--dataset", "cifar10", "--data-root", data_root, "--recipe", recipe,
                     "--seed", str(seed), "--out", str(out), "--no-progress"], out)
    print(f"{recipe}: acc={m['acc']:.4f} wall={m['wall_s']:.0f}s", flush=True)
    return trained_row(_key(recipe, seed), m, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-root", default=CONFIG["data_root"])
    ap.add_argument("--recipes", nargs="+", default=CONFIG["recipes"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    execute({"script": "clean_cifar10", "data_root": args.data_root, "recipes": args.recipes, "seeds": [args.seed]},
            progress=False)


if __name__ == "__main__":
    script_main(main)
