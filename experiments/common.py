"""Shared by the experiment scripts: run one CLI cell, read what it wrote, build a results row."""
from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

from pbe.checkpoint import read_meta
from pbe.utils import toolkit_version

HERE = Path(__file__).resolve().parent
RUNS = HERE.parent / "runs"


def run_cell(cmd: list[str], out: Path) -> dict:
    """Run a ``pbe ...`` command that writes ``out/metrics.json``; return those metrics + the log."""
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    m = json.loads((out / "metrics.json").read_text())
    log = out / "train_log.jsonl"
    m["train_log"] = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    m["epochs"] = read_meta(out / "model").get("recipe_fields", {}).get("epochs")
    m["command"] = shlex.join(cmd)
    return m


def trained_row(cell: dict, m: dict) -> dict:
    """A RESULTS.md row for a trained (clean or infected) model: no defence, before = after."""
    return {**cell, "acc": m["acc"], "asr": m["asr"], "ra": m["ra"], "acc_before": None, "asr_before": None,
            "ra_before": None, "der": None, "detection": None, "wall_s": m["wall_s"],
            "epoch_equivalents": float(m["epochs"]) if m.get("epochs") else None, "command": m["command"],
            "hardware": m["hardware"], "toolkit_version": toolkit_version(), "train_log": m["train_log"]}
