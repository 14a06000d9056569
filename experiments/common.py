"""Shared by the experiment scripts: zoo models to start from, one CLI cell, and results rows."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from pbe import zoo
from pbe.results import ResultsTable, fixed, pct, target_cell
from pbe.utils import hardware_string, toolkit_version, write_json

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# where rows and run folders go: results/ beside the scripts and runs/ (relative to the repository root,
# where every cell's command runs), unless PBE_RESULTS / PBE_RUNS name other folders (tests; a cluster's
# shared disk)
RESULTS = Path(os.environ.get("PBE_RESULTS", HERE / "results"))
RUNS = Path(os.environ.get("PBE_RUNS", "runs"))


def provenance(command: str) -> dict:
    """The fields that say how a row was made: its command, the hardware and the toolkit's version."""
    return {"command": command, "hardware": hardware_string(), "toolkit_version": toolkit_version()}


def zoo_parser(doc: str, only_help: str = "zoo names") -> argparse.ArgumentParser:
    """A small analysis script's command line: its docstring's first line, and ``--only`` zoo names."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--only", nargs="*", help=only_help)
    return ap


def hardware_footer(rows: list[dict]) -> list[str]:
    """A small table's last lines: the hardware its first row ran on."""
    return ["", f"Hardware: {rows[0]['hardware']}." if rows else ""]


def run_missing(table: str, cells: list[dict], run, markdown, describe) -> list[dict]:
    """The small analysis scripts' loop: every cell (the keyword arguments of `run`, also the keys naming its row)
    without a row in ``RESULTS/<table>.json`` is run, its row appended (the file re-read first, so that two
    processes do not drop each other's rows) and ``<table>.md`` re-rendered by `markdown(rows)`; `describe(row)`
    is printed. Returns the rows."""
    path = RESULTS / f"{table}.json"
    read = lambda: json.loads(path.read_text()) if path.exists() else []  # noqa: E731
    for cell in cells:
        if any(all(r.get(k) == v for k, v in cell.items()) for r in read()):
            continue
        row = run(**cell)
        rows = read() + [row]
        print(describe(row), flush=True)
        write_json(path, rows)
        (RESULTS / f"{table}.md").write_text(markdown(rows) + "\n")
    return read()


def zoo_models(zoo_set: str | None = "dev", dataset: str | None = "cifar10", only: list[str] | None = None,
               infected: bool = True) -> list[zoo.Entry]:
    """Zoo entries of one set and dataset (None: every set / dataset; infected ones only by default), as
    `only` names them: a zoo name (``cifar10/badnets``), its last part (``badnets``) or an attack (``blend``)."""
    found = []
    for name in zoo.available(zoo_set):
        e = zoo.get(name)
        if (dataset and e.dataset != dataset) or (infected and not e.infected):
            continue
        if only and not {name, name.split("/")[-1], e.attack} & set(only):
            continue
        found.append(e)
    return found


def built_zoo_models(zoo_set: str | None = "dev", dataset: str | None = "cifar10", only: list[str] | None = None,
                     infected: bool = True):
    """``zoo_models`` that are built, saying which are skipped because they are not."""
    for entry in zoo_models(zoo_set, dataset, only, infected):
        if zoo.is_built(entry.name):
            yield entry
        else:
            print(f"skip {entry.name}: not built yet (pbe zoo build {entry.name})", flush=True)


def add_zoo_args(ap) -> None:
    """``--set``, ``--dataset`` and ``--only``: which zoo models a per-model table covers."""
    ap.add_argument("--set", choices=zoo.SETS, dest="zoo_set", help="one zoo set (default: both)")
    ap.add_argument("--dataset", help="one dataset (default: all)")
    ap.add_argument("--only", nargs="*", help="zoo names, their last part, or attacks")


def data_args(entry: zoo.Entry) -> list[str]:
    """``--dataset NAME --data-root PATH`` of an entry (path relative to the repository root)."""
    root = zoo.default_data_root(entry.dataset)
    return ["--dataset", entry.dataset] + ([] if root is None else ["--data-root", os.path.relpath(root, ROOT)])


def zoo_cell(entry: zoo.Entry, defense: str, setting: str | None, seed: int, **extra) -> dict:
    """The cell keys of a defence run on a zoo model (RESULTS.md keys plus zoo, zoo_set)."""
    r = zoo.row(entry.name)
    return dict(dataset=r["dataset"], model=r["model"], recipe=r["recipe"], attack=r["attack"], rate=r["rate"],
                target=r["target"], all_to_all=r["all_to_all"], defense=defense, setting=setting, seed=seed,
                zoo=entry.name, zoo_set=entry.set, **extra)


def _die_with_parent() -> None:
    """Linux: the command dies with the process that started it (a killed Ray worker leaves no orphan
    writing into the run folder that the retried cell runs again)."""
    import ctypes
    import signal
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


CELL_PROGRESS = "PBE_CELL_PROGRESS"  # set to 1 (by the grid, on a terminal): the commands show their progress bars


def toolkit_command(cmd: list[str]) -> list[str]:
    """``pbe ARGS`` as this interpreter runs it (``python -m pbe.cli ARGS``): no ``pbe`` looked up on PATH, which
    is another install's or none when the script runs with a venv's python without the venv activated."""
    if not cmd or cmd[0] != "pbe":
        raise ValueError(f"a toolkit command starts with 'pbe', got {cmd[:1]}")
    return [sys.executable, "-m", "pbe.cli", *cmd[1:]]


def run_cell(cmd: list[str], out: Path) -> dict:
    """Run a ``pbe ...`` command that writes ``out/metrics.json`` (with this interpreter: ``toolkit_command``);
    return those metrics + the command (as recorded: ``pbe ...`` with ``--no-progress``, which does not change
    the run)."""
    print("$", shlex.join(cmd), flush=True)
    shown = [c for c in cmd if c != "--no-progress"] if os.environ.get(CELL_PROGRESS) == "1" else cmd
    subprocess.run(toolkit_command(shown), check=True, cwd=ROOT,
                   preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    return {**json.loads((ROOT / out / "metrics.json").read_text()), "command": shlex.join(cmd)}


def trained_row(cell: dict, m: dict, out: Path) -> dict:
    """A RESULTS.md row for a model trained outside the zoo: no defence, no 'before'."""
    from pbe.checkpoint import read_meta
    log = ROOT / out / "train_log.jsonl"
    epochs = read_meta(ROOT / out / "model").get("recipe_fields", {}).get("epochs")
    return {**cell, "acc": m["acc"], "asr": m["asr"], "ra": m["ra"], "acc_before": None, "asr_before": None,
            "ra_before": None, "der": None, "detection": None, "wall_s": m["wall_s"],
            "epoch_equivalents": float(epochs) if epochs else None, "command": m["command"],
            "hardware": m["hardware"], "toolkit_version": toolkit_version(),
            "train_log": [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []}


# report keys a row keeps: why a defence failed (ABL), and where a killed run resumed (on what, with what code)
REPORT_DIAGNOSTICS = ("isolated_loss", "unlearning", "resumed", "augmentation")


def tracking(report: dict) -> dict:
    """A PBE report's erasure tracker (``pbe.tracker``) before and after every round, beside the true ASR then
    (``experiments/tracker_score.py`` scores one against the other), and its estimate of the accuracy drop (scored
    there against the measured one); empty for a report without a tracker."""
    if report.get("tracker_before") is None:
        return {}
    rounds = report.get("rounds", [])
    return {"tracker": [report["tracker_before"]] + [r.get("tracker") for r in rounds],
            "round_asr": [report["before"]["asr"]] + [(r.get("metrics") or {}).get("asr") for r in rounds],
            "acc_drop_estimate": (report.get("acc_drop_estimate") or {}).get("estimate")}


def defence_row(cell: dict, command: str, report: dict, entry: zoo.Entry | None, **extra) -> dict:
    """A RESULTS.md row from a defence report (``report.json`` of ``pbe erase`` / ``pbe defend``); on a
    zoo `entry`, with the sha256 of the weights it started from, and the ``REPORT_DIAGNOSTICS`` it has."""
    b, a = report["before"], report["after"]
    extra = {**{k: report[k] for k in REPORT_DIAGNOSTICS if k in report}, **tracking(report), **extra}
    return {**cell, "acc": a["acc"], "asr": a["asr"], "ra": a["ra"], "acc_before": b["acc"],
            "asr_before": b["asr"], "ra_before": b["ra"], "der": report.get("der"),
            "detection": report.get("detection"), "wall_s": report["wall_s"],
            "epoch_equivalents": report["epoch_equivalents"], "command": command, "hardware": report["hardware"],
            "toolkit_version": report.get("toolkit_version", toolkit_version()),  # the code that made the run
            **({} if entry is None else {"zoo_sha256": zoo.row(entry.name)["sha256"]}), **extra}


class TrainedTable(ResultsTable):
    """Trained models (clean or infected): what they reach and what training cost."""

    note = (" (cells with a row are skipped). Values in %, from the JSON beside this file; ACC drop: against the clean "
            "model of the same set and architecture.")

    def columns(self):
        return [("zoo", lambda r: r.get("zoo") or "–"), ("recipe", lambda r: r["recipe"]),
                ("attack", lambda r: r["attack"]),
                ("rate", lambda r: pct(r["rate"], 0)), ("target", target_cell), ("seed", lambda r: str(r["seed"])),
                ("ACC", lambda r: pct(r["acc"])), ("ASR", lambda r: pct(r["asr"])), ("RA", lambda r: pct(r["ra"])),
                ("ACC drop", lambda r: fixed(None if r.get("acc_drop_vs_clean") is None
                                             else 100 * r["acc_drop_vs_clean"])),
                ("epochs", lambda r: fixed(r.get("epoch_equivalents"), 0)), ("wall s", lambda r: fixed(r["wall_s"], 0))]


class DefenceTable(ResultsTable):
    """Defence rows (before / after), with a figure of ASR and ACC drop per model and defence."""

    def figure(self):
        """The rows of the schedules PBE still has, the zoo's dev models before its generalisation set: an
        earlier default's rows (``targeted_v2``, ...) stay in the table as its history, and out of the figure."""
        from pbe.defenses.pbe import SCHEDULES
        from pbe.plots import defence_bars
        rows = [r for r in self.rows if schedule_of(r) in (None, *SCHEDULES)]
        rows = [r for r in rows if not r["all_to_all"]] or rows
        rows = sorted(rows, key=lambda r: ZOO_SET_ORDER.index(r.get("zoo_set")))  # stable: row order within a set
        return defence_bars(rows, defence_name, highlight=is_pbe)


ZOO_SET_ORDER = [None, *zoo.SETS]  # rows of no zoo model (quick runs) first, then the zoo's sets in order


def row_schedule(r: dict) -> str | None:
    """The schedule a row names, as a key of its own or among its parameters (AFT rows name ``aft``)."""
    return r.get("schedule") or (r.get("params") or {}).get("schedule")


def schedule_of(r: dict) -> str | None:
    """A PBE row's schedule (None for another defence)."""
    return row_schedule(r) if r["defense"] == "pbe" else None


def is_pbe(name: str) -> bool:
    """Whether a figure's series (as `defence_name` names it) is PBE: the figures highlight it."""
    return name.split(" ")[0] == "pbe"


def defence_name(r: dict) -> str:
    """A defence as the figures name it: the PBE schedule beside it (``pbe (targeted)``)."""
    schedule = row_schedule(r)
    return f"{r['defense']} ({schedule})" if schedule and schedule != r["defense"] else r["defense"]
