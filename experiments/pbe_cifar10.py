"""PBE (no clean data) and AFT (5% clean extra set) on the infected CIFAR-10 models of
experiments/attacks_cifar10.py -> experiments/results/pbe_cifar10.{json,md}. Resumable: cells with a
row are skipped; an infected model that does not exist yet is reported and skipped.

    python experiments/pbe_cifar10.py [--data-root ../shared/data/cifar10] [--schedule fast] [--only badnets]
"""
from __future__ import annotations

import argparse
import json

from attacks_cifar10 import CELLS
from common import HERE, ROOT, RUNS, run_cell

from pbe.results import ResultsTable
from pbe.utils import toolkit_version

DEFENSES = [("pbe", "no-clean"), ("aft", "clean-extra")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-root", default="../shared/data/cifar10")
    ap.add_argument("--recipe", default="cpu", help="recipe of the infected models")
    ap.add_argument("--schedule", default="fast", help="PBE schedule (fast or paper)")
    ap.add_argument("--only", nargs="*", help="attack names to run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    table = ResultsTable(HERE / "results" / "pbe_cifar10", "PBE and AFT on infected CIFAR-10 models",
                         "python experiments/pbe_cifar10.py")
    for attack, a2a, _ in CELLS:
        if args.only and attack not in args.only:
            continue
        src = RUNS / "attacks_cifar10" / f"{attack}{'_a2a' if a2a else ''}_{args.recipe}_seed{args.seed}"
        if not (ROOT / src / "model.safetensors").exists():
            print(f"skip {src.name}: infected model missing (run experiments/attacks_cifar10.py first)")
            continue
        for defense, setting in DEFENSES:
            schedule = args.schedule if defense == "pbe" else "aft"
            cell = dict(dataset="cifar10", model="preact_resnet18(width=16)", recipe=args.recipe, attack=attack,
                        rate=0.1, target=None if a2a else 0, all_to_all=a2a, defense=defense, setting=setting,
                        seed=args.seed)
            if table.find(**cell) and table.find(**cell).get("schedule") == schedule:
                print(f"skip {src.name} {defense}: already in the table")
                continue
            out = RUNS / "pbe_cifar10" / f"{src.name}_{defense}_{schedule}"
            cmd = ["pbe", "erase", "--model", str(src), "--dataset", "cifar10", "--data-root", args.data_root,
                   "--setting", setting, "--poison-from", str(src), "--seed", str(args.seed), "--out", str(out),
                   "--no-progress"] + (["--schedule", schedule] if defense == "pbe" else ["--clean-fraction", "0.05"])
            m = run_cell(cmd, out)
            report = json.loads((ROOT / out / "report.json").read_text())
            b, a = report["before"], report["after"]
            table.add({**cell, "acc": a["acc"], "asr": a["asr"], "ra": a["ra"], "acc_before": b["acc"],
                       "asr_before": b["asr"], "ra_before": b["ra"], "der": report.get("der"),
                       "detection": report["rounds"][-1].get("detection"), "wall_s": report["wall_s"],
                       "epoch_equivalents": report["epoch_equivalents"], "command": m["command"],
                       "hardware": report["hardware"], "toolkit_version": toolkit_version(), "schedule": schedule,
                       "rounds": len(report["rounds"]), "stopped_early": report.get("stopped_early"),
                       "monitor_before": report["monitor_before"]["top_kappa"],
                       "monitor_after": report["monitor_after"]["top_kappa"]})
            print(f"{src.name} {defense}: acc {b['acc']:.4f}->{a['acc']:.4f} asr {b['asr']:.4f}->{a['asr']:.4f} "
                  f"ee={report['epoch_equivalents']:.2f}", flush=True)


if __name__ == "__main__":
    main()
