"""Small shared helpers: errors and warnings, devices, seeds, threads and atomic writes."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import platform
import random
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch


class PBEError(ValueError):
    """A user mistake (bad path, argument, file). The CLI prints it as one line."""


class PBEWarning(UserWarning):
    """Something a user handed the toolkit looks wrong but may be right (e.g. a model near chance on its
    data); ``warnings.simplefilter("error", PBEWarning)`` makes it an error. The CLI prints it as one line."""


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Map "auto" to CUDA when present, else CPU; reject a CUDA request without CUDA."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PBEError(f"device {device!r} was asked for but CUDA is not available; use --device cpu or auto")
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise PBEError(f"unknown device {device!r}; use auto, cpu or cuda[:N]") from err


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch; return a CPU generator for explicit draws."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63:
        raise PBEError(f"a seed must be an integer in [0, 2**63), got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def available_cpus() -> int:
    """CPUs this process may run on (cgroups/affinity aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def use_all_cpus() -> int:
    """Let torch use every available CPU, unless OMP_NUM_THREADS sets a number (e.g. to share the
    machine with another run)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        n = int(os.environ["OMP_NUM_THREADS"])
    else:
        n = available_cpus()
    torch.set_num_threads(n)
    return n


def cpu_model() -> str:
    """The CPU's model name and the vector instructions torch's kernels use on it, e.g. "AMD EPYC 7B13
    (AVX2)". The same seeded run gives different floats on an AVX2 and an AVX-512 CPU, and a training run
    amplifies them, so a result row names its CPU."""
    name = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
                break
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def hardware_string() -> str:
    """What a timed row ran on: the GPU, or the threads used of the CPUs available and the CPU's model."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    n, cores = torch.get_num_threads(), available_cpus()
    used = (f"{n} CPU core{'s' if n > 1 else ''}" if n >= cores
            else f"{n} thread{'s' if n > 1 else ''} on {cores} CPU cores")
    return f"{used} of {cpu_model()}, torch {torch.__version__.split('+')[0]}"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        if tmp.exists():
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the result gets the user's umask
        os.replace(tmp, path)
        write_boundary()
    finally:
        if tmp.exists():
            tmp.unlink()


FAULT_ENV = "PBE_FAULT_AFTER_WRITES"  # tests: the process dies right after its N-th write
FAULT_EXIT = 75
_writes = 0


def write_boundary() -> None:
    """Called after every file the toolkit writes and every rename of a run folder: with
    ``PBE_FAULT_AFTER_WRITES=N`` the process dies (as from a kill -9, no cleanup) after the N-th one."""
    global _writes
    _writes += 1
    fault = os.environ.get(FAULT_ENV, "")
    if fault.isdigit() and _writes == int(fault):
        os._exit(FAULT_EXIT)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_writable(folder: str | os.PathLike, flag: str = "--out") -> Path:
    """Prove, before any work starts, that `folder` can be written: its parent (where a run folder is
    staged and swapped into place) and the folder itself when it exists. Creates only the parent."""
    folder = Path(folder)
    try:
        if folder.exists() and not folder.is_dir():
            raise PBEError(f"{flag} {folder} is a file, not a folder; choose another {flag}")
        for place in (folder.parent, folder) if folder.exists() else (folder.parent,):
            place.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".pbe-write-check.", dir=place)
            os.close(fd)
            os.unlink(probe)
    except OSError as err:
        raise PBEError(f"{flag} {folder} is not writable ({err.strerror}); choose another folder") from err
    return folder


def regular_file(path: str | os.PathLike, what: str = "file") -> Path:
    """`path` as a Path when it is an existing regular file; a FIFO, device or folder is refused
    (reading one would hang or fail deep inside a decoder)."""
    p = Path(path)
    if not p.exists():
        raise PBEError(f"{what} {p} does not exist")
    if not p.is_file():
        raise PBEError(f"{what} {p} is not a regular file (a folder, FIFO or device); point to the file itself")
    return p


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")


def json_safe(obj: Any) -> Any:
    """`obj` as it reads back from JSON (dataclasses as dicts, tuples as lists)."""
    return json.loads(json.dumps(obj, default=_json_default))


def parse_params(items: list[str] | None) -> dict:
    """``--param KEY=VALUE`` options as a dict; values are read as JSON when they parse (numbers,
    lists, null), else kept as strings."""
    params = {}
    for text in items or []:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise PBEError(f"--param takes KEY=VALUE, got {text!r}")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


@functools.lru_cache(maxsize=None)
def code_fingerprint() -> str:
    """sha256 (16 hex digits) of the library's source, every ``.py`` file of ``pbe/`` and ``attacks/``,
    read once per process: a resumable state is taken up only by the code that wrote it (commits that
    change no code keep it)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for package in ("pbe", "attacks"):
        for path in sorted((root / package).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def toolkit_version() -> str:
    """Package version plus the git commit when run from a checkout, and ".dirty" when the library's
    code (``pbe/``, ``attacks/``) differs from that commit: a row made by uncommitted code says so."""
    from pbe import __version__

    return __version__ + checkout_suffix(Path(__file__).resolve().parent.parent)


def checkout_suffix(root: Path) -> str:
    """``"+g<commit>"`` (10 hex digits) of the git checkout or worktree whose top is `root`, plus ``".dirty"``
    where its ``pbe/`` or ``attacks/`` differ from that commit; ``""`` where `root` is no checkout's top
    (an installed package) or git cannot tell."""
    import subprocess

    if not (root / ".git").exists():  # a folder in a checkout, a file ("gitdir: ...") in a worktree
        return ""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        ref = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", "pbe", "attacks")
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"+g{ref[:10]}" + (".dirty" if changed else "")


@dataclasses.dataclass
class Cost:
    """Image passes spent, the one cost unit of scans, isolation and defences (../shared/PERF.md):
    epoch-equivalents are (forward+backward passes, every PGD step included, plus forward-only passes / 3)
    divided by the training-set size."""

    forward_backward: int = 0
    forward: int = 0

    def add(self, other: "Cost") -> None:
        self.forward_backward += other.forward_backward
        self.forward += other.forward

    def epoch_equivalents(self, train_size: int) -> float:
        return (self.forward_backward + self.forward / 3) / train_size
