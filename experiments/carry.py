"""Carry the staged state of unfinished cells from one checkout to the next, through git.

A cell's command writes into a staging folder (``runs/.../.NAME.partial``, ``pbe.rundir``) that holds its
resumable states; a rerun of the same cell by the same code takes them up. ``runs/`` is not committed, so
a cell longer than a working session (the published-budget baselines take 3-5 h of one CPU thread) would
start over on every fresh checkout. ``save`` copies every staging folder under ``runs/`` into
``experiments/staged/`` (commit it), and drops the copies of cells that have finished here; ``restore``
puts the copies back where a fresh checkout lacks them, and the cell's next run resumes there. A state is
only taken up by the code that wrote it (``pbe.utils.code_fingerprint``): run the cell from that commit
(``experiments/staged/README.md`` names it).

    python experiments/carry.py save       # before the session ends, then commit experiments/staged/
    python experiments/carry.py restore    # on a fresh checkout, before rerunning the cells
    python experiments/carry.py rows OTHER/experiments/results/TABLE.json   # rows another checkout made

``rows`` adds to this checkout's table of that name the rows it lacks (a cell run from another checkout,
e.g. of an older commit), rendered by this checkout's code; the rows it has stay as they are.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from common import HERE, RUNS
from grid import script_main

from pbe.rundir import MANIFEST, STAGED, staged_out, staging
from pbe.utils import PBEError

STORE = HERE / "staged"  # committed: one folder per unfinished cell, named as its --out under runs/


def _staging_folders(root: Path) -> list[Path]:
    """The staging folders under `root` (each names the run it stages in its ``STAGED`` file)."""
    return sorted(p.parent for p in Path(root).rglob(STAGED))


def _replace(src: Path, dest: Path) -> None:
    """Copy folder `src` to `dest` as a whole: a copy cut short leaves the old one or none."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2 ** 20


def save(runs: Path = RUNS, store: Path = STORE) -> list[Path]:
    """Copy every staging folder under `runs` into `store`; drop the copies whose cell has finished in
    `runs` (its folder has a manifest). Returns the cells saved."""
    saved = []
    for partial in _staging_folders(runs):
        dest = store / staged_out(partial).relative_to(runs)
        dest.parent.mkdir(parents=True, exist_ok=True)
        _replace(partial, dest)
        saved.append(dest)
        print(f"saved {partial} -> {dest} ({_size_mb(dest):.1f} MB)")
    for carried in _staging_folders(store):
        out = Path(runs) / carried.relative_to(store)
        if (out / MANIFEST).is_file():
            shutil.rmtree(carried)
            print(f"dropped {carried}: its cell finished in {out}")
    return saved


def restore(runs: Path = RUNS, store: Path = STORE) -> list[Path]:
    """Copy the carried staging folders back under `runs`, where neither a staging folder nor a finished
    run of that cell exists. Returns the staging folders restored."""
    restored = []
    for carried in _staging_folders(store):
        out = Path(runs) / carried.relative_to(store)
        partial = staging(out)
        if partial.exists() or (out / MANIFEST).is_file():
            print(f"kept {partial if partial.exists() else out}: already here")
            continue
        partial.parent.mkdir(parents=True, exist_ok=True)
        _replace(carried, partial)
        restored.append(partial)
        print(f"restored {carried} -> {partial}")
    return restored


def add_missing(table, rows: list[dict]) -> list[dict]:
    """Add to `table` (a ``ResultsTable``) the `rows` whose cell it has no row for; returns those."""
    added = [r for r in rows if table.find(**r) is None]
    for r in added:
        table.add(r)
    return added


def rows(other: Path) -> list[dict]:
    """Add to this checkout's table named as `other` (another checkout's results JSON) the rows it lacks,
    rendered by this checkout's code; returns those."""
    import json

    from render import tables
    if other is None or not other.is_file():
        raise PBEError(f"carry.py rows needs another checkout's results JSON, got {other}")
    mine = tables().get(other.stem)
    if mine is None:
        raise PBEError(f"no table here is named {other.stem!r}; see experiments/results/")
    added = add_missing(mine, json.loads(other.read_text()))
    for r in added:
        print(f"added {r.get('zoo') or r.get('attack')} {r.get('defense')} seed {r.get('seed')} to {mine.json_path}")
    return added


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("save", "restore", "rows"))
    ap.add_argument("table", nargs="?", type=Path, help="rows: another checkout's results JSON")
    ap.add_argument("--runs", type=Path, default=RUNS, help="the run folders (default: runs/, or $PBE_RUNS)")
    ap.add_argument("--store", type=Path, default=STORE, help="the committed copies (default: experiments/staged)")
    args = ap.parse_args()
    if args.action == "rows":
        rows(args.table)
    else:
        (save if args.action == "save" else restore)(args.runs, args.store)

if __name__ == "__main__":
    script_main(main)
