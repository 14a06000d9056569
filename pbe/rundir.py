"""An output folder is one unit: everything a command writes belongs to one run.

A command (``pbe train | attack | erase | defend``) never writes into ``--out`` itself. It writes into a
staging folder beside it (``.NAME.partial``, which names the run it stages; the resumable states of a
training and of a defence live there too, taken up by a rerun of the same run by the same code), writes
``manifest.json`` last (the run's identity and the sha256 of every file), and then swaps the staging
folder into place with two renames (``out -> .NAME.old``, ``.NAME.partial -> out``). A kill at any
moment therefore leaves the old unit or the new one: the next command on that ``--out`` first calls
``recover``, which finishes or undoes a swap that was cut between its two renames and commits a staging
folder whose manifest is complete. Readers (``pbe.checkpoint.load``, ``attacks.load``, ``pbe.zoo``) call
``verify``: a folder whose manifest does not match its files is refused. A lock file beside ``--out``
keeps two commands from writing one unit at the same time.

Tests kill a command after its N-th write (``PBE_FAULT_AFTER_WRITES=N``: every atomic file write and
every rename of the swap calls ``write_boundary``).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from pbe.utils import PBEError, code_fingerprint, write_boundary, write_json

MANIFEST = "manifest.json"
STAGED = ".staged.json"  # in a staging folder: the run it stages (removed when the unit is committed)
FORMAT = "pbe-run-1"
CHUNK = 1 << 20


def _side(out: Path, tag: str) -> Path:
    return out.parent / f".{out.name}.{tag}"


PARTIAL = "partial"  # the staging folder's tag: .NAME.partial


def staging(out: str | os.PathLike) -> Path:
    """Where a command writes before its unit is swapped into `out`."""
    return _side(Path(out), PARTIAL)


def staged_out(stage: Path) -> Path:
    """The `out` a staging folder stages (``staging``'s inverse)."""
    return stage.with_name(stage.name[1:-len(PARTIAL) - 1])


def stage_for(out: str | os.PathLike, run: dict, replace: bool) -> Path:
    """The staging folder of `out`, made for `run`. One that an interrupted command left is kept when it
    staged the same run with the same code (``code_fingerprint``; the states in it resume, each checking
    its own run); one of another run is removed when `replace` (--overwrite) is given, and refused otherwise."""
    stage = staging(out)
    key = {**{k: v for k, v in run.items() if k != "toolkit_version"}, "code": code_fingerprint()}
    held = _staged(stage) if stage.exists() else key
    if held is not None and held != key:
        if not replace:
            raise PBEError(f"{stage} holds the unfinished state of another run on {out}; pass --overwrite to "
                           "discard it, or choose another --out")
        shutil.rmtree(stage)
    elif held is None and replace:  # staged by a version that did not say which run
        shutil.rmtree(stage)
    stage.mkdir(parents=True, exist_ok=True)
    if _staged(stage) is None:
        write_json(stage / STAGED, key)
    return stage


def _staged(stage: Path) -> dict | None:
    try:
        return json.loads((stage / STAGED).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST and not p.name.startswith("."))


def write_manifest(folder: Path, run: dict, drop: tuple[str, ...] = ()) -> None:
    """The last write of a unit: its run and the sha256 of every file in it, except `drop` (files or
    folders of the staging only, e.g. a training state: removed when the unit is committed)."""
    files = {p.relative_to(folder).as_posix(): sha256(p) for p in _files(folder)
             if p.relative_to(folder).parts[0] not in drop}
    write_json(folder / MANIFEST, {"format": FORMAT, "run": run, "files": files, "drop": list(drop)})


def read_manifest(folder: str | os.PathLike) -> dict | None:
    """The folder's manifest, or None when it has none (a folder written by hand or by ``pbe.save``)."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PBEError(f"{path} is not valid JSON ({err}); the run in {folder} is damaged: rerun its command") from err
    if (not isinstance(manifest, dict) or manifest.get("format") != FORMAT
            or not isinstance(manifest.get("files"), dict)):
        raise PBEError(f"{path} is not a pbe run manifest; rerun the command that made {folder}")
    return manifest


def complete(folder: Path) -> bool:
    """True when `folder` holds a manifest that every listed file matches."""
    try:
        manifest = read_manifest(folder)
    except PBEError:
        return False
    if manifest is None:
        return False
    return all((folder / name).is_file() and sha256(folder / name) == digest
               for name, digest in manifest["files"].items())


def verify(folder: str | os.PathLike) -> dict | None:
    """Refuse a run folder whose files are not the ones its manifest lists; return the manifest (None
    for a folder without one)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    for name, digest in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise PBEError(f"{path} is missing from the run in {folder} (its manifest lists it); rerun the command")
        if sha256(path) != digest:
            raise PBEError(f"{path} changed after the run in {folder} was written (sha256 differs from its "
                           "manifest): the folder mixes two runs; rerun the command")
    return manifest


def recover(out: str | os.PathLike) -> None:
    """Finish what a killed command left beside `out`: a swap cut between its renames, or a staging
    folder whose manifest is complete (committed). An incomplete staging folder stays (it may hold a
    training state to resume)."""
    out = Path(out)
    old, stage = _side(out, "old"), staging(out)
    if old.exists() and not out.exists():
        os.rename(stage if complete(stage) else old, out)
    if stage.exists() and complete(stage):
        commit(stage, out)
    if old.exists():
        shutil.rmtree(old)


def commit(stage: Path, out: Path) -> None:
    """Swap the finished staging folder into `out` (the old unit, if any, is removed after)."""
    for name in [*(read_manifest(stage) or {}).get("drop", []), STAGED]:
        if (stage / name).is_dir():
            shutil.rmtree(stage / name)
        else:
            (stage / name).unlink(missing_ok=True)
    old = _side(out, "old")
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        os.rename(out, old)
        write_boundary()
    os.rename(stage, out)
    write_boundary()
    if old.exists():
        shutil.rmtree(old)


@contextlib.contextmanager
def locked(out: str | os.PathLike) -> Iterator[None]:
    """Hold the lock of `out` (a file beside it) while a command writes its unit; a second command on
    the same `out` is refused at once instead of interleaving with the first."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = _side(out, "lock")
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise PBEError(f"another pbe command is writing into {out}; wait for it to end, or choose another --out") \
                from err
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
