"""Results tables in the shape of RESULTS.md: a JSON list of rows plus a rendered Markdown table.

Experiment scripts use ``ResultsTable`` to skip cells that already have a row, so an interrupted
run continues where it stopped, and to write both files atomically after every row.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterator

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

from pbe.utils import PBEError, atomic_path, write_json

REQUIRED = ["dataset", "model", "recipe", "attack", "rate", "target", "all_to_all", "defense", "setting",
            "seed", "acc", "asr", "ra", "acc_before", "asr_before", "ra_before", "der", "detection",
            "wall_s", "epoch_equivalents", "command", "hardware", "toolkit_version"]
# what makes a row a cell of its own (a missing key counts as null: rows made before the zoo existed
# have no "zoo", PBE rows of two schedules are two cells, and one told the target another)
CELL_KEYS = ["dataset", "model", "recipe", "attack", "rate", "target", "all_to_all", "defense", "setting", "seed",
             "zoo", "schedule", "given_target"]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside `path`, so that parallel experiment scripts sharing one table do not
    overwrite each other's rows (POSIX; elsewhere, run one script per table at a time)."""
    if fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def pct(v, digits: int = 2) -> str:
    """A share as a percentage for a rendered table ("–" when not measured)."""
    return "–" if v is None else f"{100 * v:.{digits}f}"


def fixed(v, digits: int = 2) -> str:
    """A number with `digits` decimals for a rendered table ("–" when not measured)."""
    return "–" if v is None else f"{v:.{digits}f}"


def target_cell(r: dict) -> str:
    """A row's target as a reader names it."""
    return "all-to-all" if r.get("all_to_all") else ("–" if r.get("target") is None else str(r["target"]))


Column = tuple[str, Callable[[dict], str]]  # header, the cell of a row


def schedule_cell(r: dict) -> str:
    """A defence row's schedule, and whether the defence was told the target."""
    name = r.get("schedule") or (r.get("params") or {}).get("schedule") or "–"
    return f"{name}, target given" if r.get("given_target") else name


class ResultsTable:
    """A JSON list of rows (one per cell, the keys of RESULTS.md), rendered beside it as Markdown: the
    figure and the summary a reader looks for first, where the table has them, then every row with the
    numbers a reader compares (commands, hardware and versions folded below); a CSV of the same columns
    plus those; and, where a subclass draws one, a PNG figure.

    Subclasses change ``note`` (what the columns mean), ``columns`` and, for a summary or a figure,
    ``summary`` and ``figure``."""

    note = (" (cells with a row are skipped; delete a row from the JSON to rerun it). Values in %, from the JSON "
            "beside this file.")

    def __init__(self, path: str | Path, title: str, regenerate: str,
                 summarise: Callable[[list[dict]], str] | None = None):
        """`summarise(rows)` returns the Markdown set before the rows (means, rankings, references)."""
        self.json_path = Path(path).with_suffix(".json")
        self.title, self.regenerate, self.summarise = title, regenerate, summarise
        self.rows: list[dict] = self._read()

    def _read(self) -> list[dict]:
        return json.loads(self.json_path.read_text()) if self.json_path.exists() else []

    def reload(self) -> None:
        """Re-read the rows from disk (another process may have added some)."""
        with _locked(self.json_path):
            self.rows = self._read()

    @staticmethod
    def cell(row: dict) -> tuple:
        return tuple(json.dumps(row.get(k)) for k in CELL_KEYS)

    def find(self, **cell) -> dict | None:
        key = self.cell(cell)
        return next((r for r in self.rows if self.cell(r) == key), None)

    def add(self, row: dict) -> None:
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise PBEError(f"result row lacks keys {missing}")
        with _locked(self.json_path):  # another process may have added rows since we read the file
            rows = self._read() if self.json_path.exists() else self.rows
            self.rows = [r for r in rows if self.cell(r) != self.cell(row)] + [row]
            self.write()

    def write(self) -> None:
        """The JSON, and the Markdown, CSV and figure rendered from it, each written atomically."""
        write_json(self.json_path, self.rows)
        with atomic_path(self.json_path.with_suffix(".md")) as tmp:
            tmp.write_text(self.markdown())
        with atomic_path(self.json_path.with_suffix(".csv")) as tmp:
            tmp.write_text(self.csv())
        fig = self.figure() if self.rows else None
        if fig is not None:
            from pbe.plots import _save
            _save(fig, self.json_path.with_suffix(".png"))

    def columns(self) -> list[Column]:
        """The columns a reader compares (defence rows: before / after, cost)."""
        def detection(r):
            det = r.get("detection") or {}
            return f"{pct(det['precision'])} / {pct(det['recall'])}" if "precision" in det else "–"
        return [("zoo", lambda r: r.get("zoo") or "–"), ("set", lambda r: r.get("zoo_set") or "–"),
                ("attack", lambda r: str(r["attack"])),
                ("rate", lambda r: pct(r.get("rate"), 0)), ("target", target_cell),
                ("defense", lambda r: str(r["defense"])),
                ("schedule", schedule_cell), ("setting", lambda r: r["setting"] or "–"),
                ("seed", lambda r: str(r["seed"])), ("ACC before", lambda r: pct(r.get("acc_before"))),
                ("ASR before", lambda r: pct(r.get("asr_before"))), ("ACC", lambda r: pct(r["acc"])),
                ("ASR", lambda r: pct(r["asr"])), ("RA", lambda r: pct(r["ra"])),
                ("DER", lambda r: fixed(r.get("der"), 3)), ("det. P / R", detection),
                ("epoch-eq.", lambda r: fixed(r.get("epoch_equivalents"))), ("wall s", lambda r: fixed(r["wall_s"], 0))]

    def summary(self) -> str | None:
        """Markdown before the rows (the constructor's `summarise`, if any)."""
        return None if self.summarise is None else self.summarise(self.rows)

    def figure(self):
        """A matplotlib figure of the rows, or None (no figure for this table)."""
        return None

    @staticmethod
    def details(r: dict) -> str:
        """What a row was made with: command, hardware, toolkit version."""
        return f"`{r.get('command')}` ({r.get('hardware')}; toolkit {r.get('toolkit_version')})"

    def markdown(self) -> str:
        cols = self.columns()
        lines = [f"# {self.title}", "", f"Regenerate: `{self.regenerate}`{self.note}", ""]
        if self.rows and type(self).figure is not ResultsTable.figure:
            lines += [f"![{self.title}]({self.json_path.with_suffix('.png').name})", ""]
        summary = self.summary()
        if summary:
            lines += [summary, "", "# Every row", ""]
        lines += ["| # | " + " | ".join(h for h, _ in cols) + " |", "|---" + "|---" * len(cols) + "|"]
        for i, r in enumerate(self.rows, 1):
            lines.append(f"| {i} | " + " | ".join(str(f(r)) for _, f in cols) + " |")
        if self.rows:
            lines += ["", "<details><summary>Command, hardware and toolkit version of each row (every other field "
                      f"is in <code>{self.json_path.name}</code>; the table as CSV: <code>"
                      f"{self.json_path.with_suffix('.csv').name}</code>)</summary>", ""]
            lines += [f"{i}. {self.details(r)}" for i, r in enumerate(self.rows, 1)] + ["", "</details>"]
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        """The rendered columns, then command, hardware and toolkit version, one line per row."""
        import csv
        import io
        cols = self.columns()
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        extra = ("command", "hardware", "toolkit_version")
        w.writerow(["#"] + [h for h, _ in cols] + list(extra))
        for i, r in enumerate(self.rows, 1):
            w.writerow([i] + [f(r) for _, f in cols] + [r.get(k) for k in extra])
        return out.getvalue()
