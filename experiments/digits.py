"""Attacks and defences on the built-in 8x8 digits (scikit-learn; no download, seconds per cell)
-> experiments/results/digits.{json,md,csv,png}: per (attack, defence, seed) cell, the `tiny` infected
model (``pbe attack``, shared by the cell's defences) and the defence run by the command line with its
registered defaults (``pbe defend``). The smallest complete table: what the CI's Ray test runs, and a
check of the command-line defaults on a dataset they were not chosen on.

    python experiments/digits.py [--attacks badnets blend] [--defenses pbe ft] [--rates 0.1 0.05] [--seeds 0 1]
"""
from __future__ import annotations

import argparse
import json

from common import RESULTS, ROOT, RUNS, DefenceTable, defence_row
from common import run_cell as run_command
from grid import Cell, execute, script_main

from pbe.defenses import REGISTRY

CONFIG = {"attacks": ["badnets", "blend"], "defenses": ["pbe", "ft"], "seeds": [0], "rates": [0.1], "target": 0}
RECIPE, MODEL = "tiny", "small_cnn"
ESTIMATE = 1.0  # epoch-equivalents of a digits cell without a row of its defence yet
CLEAN_FRACTION = 0.05


def results_table(cfg: dict | None = None) -> DefenceTable:
    return DefenceTable(RESULTS / "digits", "Attacks and defences on the built-in 8x8 digits",
                        "python experiments/digits.py (or python experiments/reproduce.py "
                        "experiments/configs/digits.yaml)")


def _key(attack: str, defense: str, seed: int, rate: float, target: int) -> dict:
    return dict(dataset="digits", model=MODEL, recipe=RECIPE, attack=attack, rate=rate, target=target,
                all_to_all=False, defense=defense, setting=REGISTRY[defense].setting, seed=seed)


def cells(cfg: dict) -> list[Cell]:
    unknown = [d for d in cfg["defenses"] if d not in REGISTRY]
    if unknown:
        from pbe.utils import PBEError
        raise PBEError(f"digits: unknown defences {unknown}; available: {', '.join(sorted(REGISTRY))}")
    rows = results_table().rows
    out = []
    for attack in cfg["attacks"]:
        for rate in cfg["rates"]:
            for seed in cfg["seeds"]:
                for defense in cfg["defenses"]:
                    costs = [r["epoch_equivalents"] for r in rows if r["defense"] == defense]
                    out.append(Cell("digits", f"digits {attack} {rate:g} {defense} seed {seed}",
                                    _key(attack, defense, seed, rate, cfg["target"]),
                                    {"attack": attack, "defense": defense, "seed": seed, "rate": rate,
                                     "target": cfg["target"]}, max(costs) if costs else ESTIMATE))
    return out


def run_cell(attack: str, defense: str, seed: int, rate: float, target: int) -> dict:
    """One row: the infected digits model (trained once per attack and seed) and one defence of it."""
    infected = RUNS / "digits" / f"{attack}_r{rate}_t{target}_seed{seed}"
    train = run_command(["pbe", "attack", "--attack", attack, "--dataset", "digits", "--recipe", RECIPE, "--rate",
                         str(rate), "--target", str(target), "--seed", str(seed), "--out", str(infected),
                         "--no-progress"], infected)
    out = infected.with_name(f"{infected.name}_{defense}")
    clean = ["--clean-fraction", str(CLEAN_FRACTION)] if REGISTRY[defense].setting == "clean-extra" else []
    m = run_command(["pbe", "defend", "--defense", defense, "--model", str(infected), "--dataset", "digits",
                     "--poison-from", str(infected), *clean, "--seed", str(seed), "--out", str(out), "--no-progress",
                     "--overwrite"],  # the folder caches this cell: a run of other settings is replaced
                    out)
    report = json.loads((ROOT / out / "report.json").read_text())
    return defence_row(_key(attack, defense, seed, rate, target), f"{train['command']} && {m['command']}", report,
                       None, train_wall_s=train["wall_s"], params=report["params"],
                       detection=report.get("detection") or (report.get("rounds") or [{}])[-1].get("detection"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attacks", nargs="*", default=CONFIG["attacks"])
    ap.add_argument("--defenses", nargs="*", default=CONFIG["defenses"])
    ap.add_argument("--rates", nargs="*", type=float, default=CONFIG["rates"])
    ap.add_argument("--seeds", nargs="*", type=int, default=CONFIG["seeds"])
    args = ap.parse_args()
    execute({"script": "digits", "attacks": args.attacks, "defenses": args.defenses, "rates": args.rates,
             "seeds": args.seeds})


if __name__ == "__main__":
    script_main(main)
