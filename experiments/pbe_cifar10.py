"""PBE (no clean data, one row per schedule) and AFT (5% clean extra set) on the infected CIFAR-10
zoo models -> experiments/results/pbe_cifar10.{json,md}. Resumable: cells with a row measured on the
committed zoo model are skipped; a zoo model not built yet is reported and skipped.

    python experiments/pbe_cifar10.py [--set dev] [--schedules fast paper] [--only badnets blend]

Rows carry "schedule" (the registered name; ``DEFAULT_SCHEDULE`` is pbe.erase's default) and the zoo keys.
"""
from __future__ import annotations

import argparse
import json

from common import HERE, ROOT, RUNS, data_args, defence_row, run_cell, same_zoo_model, zoo_cell, zoo_models, zoo_source

from pbe.defenses.pbe import DEFAULT_SCHEDULE
from pbe.results import ResultsTable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="dev", choices=("dev", "generalisation"), dest="zoo_set")
    ap.add_argument("--schedules", nargs="*", default=[DEFAULT_SCHEDULE],
                    help=f"PBE schedules (default {DEFAULT_SCHEDULE}; paper: the authors')")
    ap.add_argument("--no-aft", action="store_true", help="only PBE rows")
    ap.add_argument("--only", nargs="*", help="zoo names or attacks to run")
    ap.add_argument("--seed", type=int, default=0, help="seed of the defence")
    args = ap.parse_args()
    table = ResultsTable(HERE / "results" / "pbe_cifar10", "PBE and AFT on infected CIFAR-10 zoo models",
                         "python experiments/pbe_cifar10.py")
    runs = [("pbe", "no-clean", s) for s in args.schedules] + ([] if args.no_aft else [("aft", "clean-extra", "aft")])
    for entry in zoo_models(args.zoo_set, "cifar10", args.only):
        src = zoo_source(entry)
        if src is None:
            continue
        for defense, setting, schedule in runs:
            cell = zoo_cell(entry, defense, setting, args.seed, schedule=schedule)
            if same_zoo_model(table.find(**cell), entry):
                print(f"skip {entry.name} {defense} {schedule}: already in the table")
                continue
            out = RUNS / "pbe_cifar10" / entry.name / f"{defense}_{schedule}_seed{args.seed}"
            cmd = ["pbe", "erase", "--model", str(src), *data_args(entry), "--setting", setting,
                   "--poison-from", str(src), "--seed", str(args.seed), "--out", str(out), "--no-progress",
                   *(["--schedule", schedule] if defense == "pbe" else ["--clean-fraction", "0.05"])]
            m = run_cell(cmd, out)
            report = json.loads((ROOT / out / "report.json").read_text())
            row = defence_row(cell, m["command"], report, entry, rounds=len(report["rounds"]),
                              stopped_early=report.get("stopped_early"),
                              monitor_before=report["monitor_before"]["top_kappa"],
                              monitor_after=report["monitor_after"]["top_kappa"])
            row["detection"] = report["rounds"][-1].get("detection")
            table.add(row)
            print(f"{entry.name} {defense} {schedule}: acc {row['acc_before']:.4f}->{row['acc']:.4f} "
                  f"asr {row['asr_before']:.4f}->{row['asr']:.4f} ee={row['epoch_equivalents']:.2f}", flush=True)


if __name__ == "__main__":
    main()
