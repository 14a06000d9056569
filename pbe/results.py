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
# have no "zoo", PBE rows of two schedules are two cells)
CELL_KEYS = ["dataset", "model", "recipe", "attack", "rate", "target", "all_to_all", "defense", "setting", "seed",
             "zoo", "schedule"]


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


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.2f}"


class ResultsTable:
    def __init__(self, path: str | Path, title: str, regenerate: str,
                 footer: Callable[[list[dict]], str] | None = None):
        """`footer(rows)` returns Markdown appended below the table (summaries, references)."""
        self.json_path = Path(path).with_suffix(".json")
        self.title, self.regenerate, self.footer = title, regenerate, footer
        self.rows: list[dict] = json.loads(self.json_path.read_text()) if self.json_path.exists() else []

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
            if self.json_path.exists():
                self.rows = json.loads(self.json_path.read_text())
            self.rows = [r for r in self.rows if self.cell(r) != self.cell(row)] + [row]
            self.write()

    def write(self) -> None:
        write_json(self.json_path, self.rows)
        with atomic_path(self.json_path.with_suffix(".md")) as tmp:
            tmp.write_text(self.markdown())

    def head(self, note: str, columns: list[str]) -> list[str]:
        """The first lines of a rendered table: title, how to regenerate it (+ `note`), the column header."""
        return [f"# {self.title}", "", f"Regenerate: `{self.regenerate}`{note}", "",
                "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]

    def markdown(self) -> str:
        head = ["zoo", "attack", "a2a", "defense", "setting", "seed", "ACC before", "ASR before", "ACC %", "ASR %",
                "RA %", "DER", "det. P / R %", "wall s", "epoch-eq.", "hardware", "command"]
        lines = self.head(" (cells with a row are skipped; delete a row from the JSON to rerun it). Values in %, "
                          "from the JSON beside this file.", head)
        for r in self.rows:
            der = "–" if r.get("der") is None else f"{r['der']:.3f}"
            ee = "–" if r.get("epoch_equivalents") is None else f"{r['epoch_equivalents']:.2f}"
            det = r.get("detection") or {}
            pr = f"{_pct(det['precision'])} / {_pct(det['recall'])}" if "precision" in det else "–"
            lines.append("| " + " | ".join([
                str(r.get("zoo") or "–"), str(r["attack"]), "yes" if r["all_to_all"] else "no", str(r["defense"]), str(r["setting"] or "–"),
                str(r["seed"]), _pct(r.get("acc_before")), _pct(r.get("asr_before")), _pct(r["acc"]),
                _pct(r["asr"]), _pct(r["ra"]), der, pr, f"{r['wall_s']:.0f}", ee, r["hardware"],
                f"`{r['command']}`"]) + " |")
        first = self.rows[0] if self.rows else {}
        if first:
            lines += ["", f"Dataset `{first['dataset']}`, model `{first['model']}`, recipe `{first['recipe']}`, "
                      f"toolkit {first['toolkit_version']}."]
        if self.footer is not None:
            lines += ["", self.footer(self.rows)]
        return "\n".join(lines) + "\n"
