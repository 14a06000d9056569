"""Clean CIFAR-10 models of the `quick` and `cpu` recipes -> experiments/results/clean_cifar10.{json,md}.

Each cell runs the exact CLI command recorded in its row. Finished cells are skipped.

    python experiments/clean_cifar10.py [--data-root ../shared/data/cifar10] [--recipes quick cpu] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from pbe.checkpoint import read_meta
from pbe.results import ResultsTable
from pbe.utils import toolkit_version

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-root", default="../shared/data/cifar10")
    ap.add_argument("--recipes", nargs="+", default=["quick", "cpu"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default=str(HERE.parent / "runs" / "clean_cifar10"))
    args = ap.parse_args()
    table = ResultsTable(HERE / "results" / "clean_cifar10", "Clean CIFAR-10 models",
                         "python experiments/clean_cifar10.py")
    for recipe in args.recipes:
        cell = dict(dataset="cifar10", model="preact_resnet18(width=16)", recipe=recipe, attack="none", rate=0.0,
                    target=None, all_to_all=False, defense="none", setting=None, seed=args.seed)
        if table.find(**cell):
            print(f"skip {recipe}: already in the table")
            continue
        out = Path(args.runs) / f"{recipe}_seed{args.seed}"
        cmd = ["pbe", "train", "--dataset", "cifar10", "--data-root", args.data_root, "--recipe", recipe,
               "--seed", str(args.seed), "--out", str(out), "--no-progress"]
        print("$", shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        m = json.loads((out / "metrics.json").read_text())
        epochs = read_meta(out / "model")["recipe_fields"]["epochs"]
        table.add({**cell, "acc": m["acc"], "asr": None, "ra": None, "acc_before": None, "asr_before": None,
                   "ra_before": None, "der": None, "detection": None, "wall_s": m["wall_s"],
                   "epoch_equivalents": float(epochs), "command": shlex.join(cmd), "hardware": m["hardware"],
                   "toolkit_version": toolkit_version(), "epochs": epochs,
                   "train_log": [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines()]})
        print(f"{recipe}: acc={m['acc']:.4f} wall={m['wall_s']:.0f}s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
