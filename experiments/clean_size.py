"""How little clean data is enough: AFT's default and the two strongest clean-data defences of the defences table
(ANP, i-BAU) with 0.5, 1, 2 and 5 % of the clean training set, on the dev BadNets and Blend models, CPU budgets
-> experiments/results/clean_size.{json,md,csv,png}. Resumable: cells with a row are skipped.

    python experiments/clean_size.py [--only cifar10/badnets] [--defenses aft anp] [--fractions 0.01 0.05]

Each cell is ``pbe defend --defense NAME --clean-fraction F`` with the defences table's CPU budget (its
``cpu_budget``); the clean images are a seeded draw of F of the clean training set (the same draw for every
defence at one fraction and seed).
"""
from __future__ import annotations

import argparse
import json

from common import RESULTS, ROOT, RUNS, DefenceTable, built_zoo_models, data_args, defence_row, zoo_cell
from common import run_cell as run_command
from defenses_cifar10 import cpu_budget
from grid import Cell, execute, median_cost, script_main

from pbe import zoo

CONFIG = {"set": "dev", "only": ["cifar10/badnets", "cifar10/blend"], "defenses": ["aft", "anp", "ibau"],
          "fractions": [0.005, 0.01, 0.02, 0.05], "seeds": [0]}
DEFAULT_ESTIMATE = 2.0  # epoch-equivalents of a cell without a row yet


def results_table(cfg: dict | None = None) -> DefenceTable:
    return DefenceTable(RESULTS / "clean_size", "Clean-data defences by the size of the clean set",
                        "python experiments/clean_size.py", summarise=summary_markdown)


def summary_markdown(rows: list[dict]) -> str:
    """Per zoo model and defence: ACC / ASR after at each clean fraction (the latest row of each cell)."""
    latest = {(r["zoo"], r["defense"], r["clean_fraction"]): r for r in rows}
    fractions = sorted({f for _, _, f in latest})
    lines = ["## ACC / ASR after (%) by the clean set's share of the training set", "",
             "| zoo | defence | " + " | ".join(f"{100 * f:g} %" for f in fractions) + " |",
             "|---|---|" + "---|" * len(fractions)]
    for zoo_name, defense in sorted({(z, d) for z, d, _ in latest}):
        cells = [latest.get((zoo_name, defense, f)) for f in fractions]
        lines.append(f"| {zoo_name} | {defense} | " + " | ".join(
            "–" if r is None else f"{100 * r['acc']:.2f} / {100 * r['asr']:.2f}" for r in cells) + " |")
    return "\n".join(lines)


def cells(cfg: dict) -> list[Cell]:
    table = results_table(cfg)
    return [Cell("clean_size", f"{e.name} {defense} {fraction:g} seed {seed}",
                 zoo_cell(e, defense, "clean-extra", seed, clean_fraction=fraction),
                 {"name": e.name, "defense": defense, "fraction": fraction, "seed": seed},
                 median_cost(table, DEFAULT_ESTIMATE, defense=defense), zoo=e.name)
            for e in built_zoo_models(cfg["set"], "cifar10", cfg["only"]) for defense in cfg["defenses"]
            for fraction in cfg["fractions"] for seed in cfg["seeds"]]


def run_cell(name: str, defense: str, fraction: float, seed: int) -> dict:
    """One row: ``pbe defend`` with `fraction` of the clean training set."""
    entry = zoo.get(name)
    src = entry.folder.resolve().relative_to(ROOT)
    params = cpu_budget(defense, entry.recipe)
    out = RUNS / "clean_size" / entry.name / f"{defense}_{fraction:g}_seed{seed}"
    cmd = ["pbe", "defend", "--defense", defense, "--model", str(src), *data_args(entry), "--poison-from", str(src),
           "--seed", str(seed), "--out", str(out), "--no-progress", "--clean-fraction", str(fraction), "--overwrite"]
    for k, v in params.items():
        cmd += ["--param", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    m = run_command(cmd, out)
    report = json.loads((ROOT / out / "report.json").read_text())
    row = defence_row(zoo_cell(entry, defense, "clean-extra", seed, clean_fraction=fraction), m["command"], report,
                      entry, params=report["params"])
    print(f"{name} {defense} {fraction:g}: acc {row['acc_before']:.4f}->{row['acc']:.4f} "
          f"asr {row['asr_before']:.4f}->{row['asr']:.4f} ee={row['epoch_equivalents']:.2f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=CONFIG["only"], help="zoo names")
    ap.add_argument("--defenses", nargs="*", default=CONFIG["defenses"])
    ap.add_argument("--fractions", nargs="*", type=float, default=CONFIG["fractions"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    execute({"script": "clean_size", "set": "dev", "only": args.only, "defenses": args.defenses,
             "fractions": args.fractions, "seeds": [args.seed]}, progress=False)


if __name__ == "__main__":
    script_main(main)
