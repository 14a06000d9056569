"""Infected CIFAR-10 models (cpu recipe, 10% poison, target 0) for the five attacks, plus BadNets
all-to-all -> experiments/results/attacks_cifar10.{json,md}. Cells with a row are skipped, so a run
cut short continues where it stopped (the longest cell is ~45 min on 2 CPU cores). A row whose
model is missing (a fresh clone) is retrained for the defence scripts; when the rebuilt model
differs from the row (made by an older toolkit), the row is replaced.

    python experiments/attacks_cifar10.py [--data-root ../shared/data/cifar10] [--only badnets wanet] [--seed 0]
"""
from __future__ import annotations

import argparse
import json

from common import HERE, ROOT, RUNS, run_cell, trained_row

from pbe.results import ResultsTable
from pbe.utils import toolkit_version

# (attack, all_to_all, extra CLI parameters)
CELLS = [
    ("badnets", False, []),
    ("blend", False, []),
    ("sig", False, []),  # clean-label, as in the SIG paper: 10% of N = every target-class image
    ("wanet", False, []),
    # the mask network's pre-training is cut from the paper's 25 epochs to 1 on CPUs
    ("input_aware", False, ["--param", "mask_epochs=1"]),
    ("badnets", True, []),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-root", default="../shared/data/cifar10")
    ap.add_argument("--recipe", default="cpu")
    ap.add_argument("--only", nargs="*", help="attack names to run (default: all cells)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    table = ResultsTable(HERE / "results" / "attacks_cifar10", "Infected CIFAR-10 models (10% poison, target 0)",
                         "python experiments/attacks_cifar10.py")
    clean = HERE / "results" / "clean_cifar10.json"
    clean_acc = {r["recipe"]: r["acc"] for r in json.loads(clean.read_text())} if clean.exists() else {}
    for attack, a2a, extra in CELLS:
        if args.only and attack not in args.only:
            continue
        cell = dict(dataset="cifar10", model="preact_resnet18(width=16)", recipe=args.recipe, attack=attack,
                    rate=0.1, target=None if a2a else 0, all_to_all=a2a, defense="none", setting=None,
                    seed=args.seed)
        out = RUNS / "attacks_cifar10" / f"{attack}{'_a2a' if a2a else ''}_{args.recipe}_seed{args.seed}"
        stored = table.find(**cell)
        if stored and (ROOT / out / "model.safetensors").exists():
            print(f"skip {attack}{' all-to-all' if a2a else ''}: already in the table")
            continue
        cmd = ["pbe", "attack", "--attack", attack, "--dataset", "cifar10", "--data-root", args.data_root,
               "--recipe", args.recipe, "--rate", "0.1", "--seed", str(args.seed), "--out", str(out),
               "--no-progress"] + (["--all-to-all"] if a2a else ["--target", "0"]) + extra
        m = run_cell(cmd, out)
        if stored:  # the row exists but its model does not (a fresh clone): rebuilt for the defence scripts
            same = all(abs(m[k] - stored[k]) < 1e-9 for k in ("acc", "asr", "ra"))
            print(f"{attack}: model rebuilt; " + ("it reproduces the stored row" if same else
                  f"it differs from the stored row (acc {stored['acc']:.4f} -> {m['acc']:.4f}, asr "
                  f"{stored['asr']:.4f} -> {m['asr']:.4f}; toolkit {stored.get('toolkit_version')} -> "
                  f"{toolkit_version()}): the row now describes the rebuilt model, and defence rows of the "
                  "old one are rerun by experiments/defenses_cifar10.py"), flush=True)
            if same:
                continue
        row = trained_row(cell, m, out)
        ref = clean_acc.get(args.recipe)
        row["clean_model_acc"] = ref
        row["acc_drop_vs_clean"] = None if ref is None else ref - m["acc"]
        table.add(row)
        print(f"{attack}: acc={m['acc']:.4f} asr={m['asr']:.4f} wall={m['wall_s']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
