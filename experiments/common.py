"""Shared by the experiment scripts: run one CLI cell, read what it wrote, build a results row."""
from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

from pbe.checkpoint import read_meta
from pbe.utils import toolkit_version

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RUNS = Path("runs")  # relative to the repository root, where every cell's command runs


def run_cell(cmd: list[str], out: Path) -> dict:
    """Run a ``pbe ...`` command that writes ``out/metrics.json``; return those metrics + the command."""
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return {**json.loads((ROOT / out / "metrics.json").read_text()), "command": shlex.join(cmd)}


def trained_row(cell: dict, m: dict, out: Path) -> dict:
    """A RESULTS.md row for a trained (clean or infected) model: no defence, no 'before'."""
    log = ROOT / out / "train_log.jsonl"
    epochs = read_meta(ROOT / out / "model").get("recipe_fields", {}).get("epochs")
    return {**cell, "acc": m["acc"], "asr": m["asr"], "ra": m["ra"], "acc_before": None, "asr_before": None,
            "ra_before": None, "der": None, "detection": None, "wall_s": m["wall_s"],
            "epoch_equivalents": float(epochs) if epochs else None, "command": m["command"],
            "hardware": m["hardware"], "toolkit_version": toolkit_version(),
            "train_log": [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []}
