"""Rebuild a results table from its config: one YAML per table in ``experiments/configs/``, each
naming the table script, the zoo models, the defences and their parameters. Cells (one row of
``../shared/RESULTS.md`` each) with a row already are skipped; a cell cut short resumes from the state
its command staged under ``runs/`` when rerun by the same code, or starts again cleanly (rows are written
whole, by this driver only; ``carry.py`` carries staged states to a fresh checkout through git).
``--dry-run`` lists the cells left and an estimate of their cost. ``--verify`` reruns the selected cells
that *have* a row, in a temporary folder, and says per row whether the rerun is identical (wall time,
hardware, version and command aside).

    python experiments/reproduce.py experiments/configs/pbe_cifar10.yaml [...] [--only PATTERN ...] [--dry-run]
    python experiments/reproduce.py CONFIG --executor ray [--address HOST:PORT]   # pip install -e '.[ray]'
    python experiments/reproduce.py CONFIG --only PATTERN --verify                # does a committed row reproduce?

On a Ray cluster every cell is a task (its CPU / GPU request from the script), retried if its worker
dies; the repository, the zoo and ``runs/`` must be on a path every node shares (same absolute path).
"""
from __future__ import annotations

import argparse

import sys

from grid import execute, load_config, script_main, verify


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+", help="YAML configs (experiments/configs/*.yaml), run one after the other")
    ap.add_argument("--executor", choices=("local", "ray"), default="local")
    ap.add_argument("--address", help="Ray: the cluster's address (default: start a local Ray instance)")
    ap.add_argument("--only", nargs="*", help="cells whose name contains or matches (fnmatch) one of these")
    ap.add_argument("--dry-run", action="store_true", help="list the cells left and their estimated cost")
    ap.add_argument("--verify", action="store_true",
                    help="rerun the selected cells that have a row (in a temporary folder) and compare the rows")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    configs = [load_config(path) for path in args.configs]  # every config checked before any cell runs
    if args.verify:
        if any(r["differences"] for cfg in configs for r in verify(cfg, args.only)):
            sys.exit(1)
        return
    for cfg in configs:
        execute(cfg, args.executor, args.address, args.only, args.dry_run, progress=not args.no_progress)


if __name__ == "__main__":
    script_main(main)
