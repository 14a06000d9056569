"""The grid behind every results table. A table script names its cells (``cells(config)``: one row
each) and runs one (``run_cell(**params)`` -> the row); this module skips the cells that already have
a row, estimates what the rest will cost, and runs them here or as Ray tasks. Only the driver writes
rows, so a worker that dies loses nothing and duplicates nothing: its task is retried, and a cell
counts once, when its row is added.

A table script provides ``CONFIG`` (its keys and their defaults), ``results_table(config)``,
``cells(config)``, ``run_cell(**params)`` and optionally ``stale(row)`` (a row it no longer accepts,
e.g. made by an older method) and ``staged(**params)`` (the epoch-equivalents that a cell's interrupted
run has staged and its rerun takes up: left out of the estimates); ``reproduce.py`` runs a YAML config
of one, and the script's own command line builds the same config from its arguments.
"""
from __future__ import annotations

import fnmatch
import importlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from pbe import zoo
from pbe.utils import PBEError

HERE = Path(__file__).resolve().parent
# the table scripts (each runs its cells on this grid)
SCRIPTS = ("clean_cifar10", "attacks_cifar10", "premise_cifar10", "scan_families", "scan_budget", "detect", "isolation",
           "pbe_cifar10", "pbe_ablation_cifar10", "defenses_cifar10", "digits", "clean_size")
RETRIES = 3  # Ray: how often a cell whose worker died is run again
RESOURCES = ("num_cpus", "num_gpus")  # what a config may ask of Ray per cell
OBJECT_STORE_BYTES = 256 * 2 ** 20  # a local Ray instance: rows are small, the default (30 % of RAM) is not


@dataclass(frozen=True)
class Cell:
    """One row to make: `key` its cell keys (``ResultsTable.find``), `params` ``run_cell``'s arguments,
    `estimate` its expected cost in epoch-equivalents (``../shared/PERF.md``)."""

    script: str
    name: str
    key: dict
    params: dict
    estimate: float
    zoo: str | None = None  # a zoo entry: a row counts only if made on its committed weights
    resources: dict = field(default_factory=lambda: {"num_cpus": 1})


def module(script: str):
    if script not in SCRIPTS:
        raise PBEError(f"unknown table script {script!r}; available: {', '.join(SCRIPTS)}")
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module(script)


def script_main(main) -> None:
    """Run a script's `main()`: a PBEError (a bad config, option or zoo name) is one line on stderr naming the
    problem and the fix, exit status 2, as the ``pbe`` command line reports it; never a traceback."""
    try:
        main()
    except PBEError as err:
        script = Path(sys.argv[0]).name
        print(f"{script}: error: {'; '.join(s.strip() for s in str(err).splitlines() if s.strip())}", file=sys.stderr)
        sys.exit(2)


def load_config(path: str | Path) -> dict:
    """A YAML config: ``script`` (one of SCRIPTS) and that script's CONFIG keys; the rest default."""
    path = Path(path)
    if not path.is_file():
        raise PBEError(f"config {path} not found; the committed ones are in {HERE / 'configs'}")
    cfg = yaml.safe_load(path.read_text()) or {}
    if not isinstance(cfg, dict) or "script" not in cfg:
        raise PBEError(f"config {path}: a mapping with a 'script' key (one of {', '.join(SCRIPTS)}) is needed")
    return complete(cfg, str(path))


def complete(cfg: dict, where: str = "config") -> dict:
    """`cfg` with its script's defaults filled in; unknown keys are an error naming the known ones.
    Besides the script's keys a config may give ``resources``: what each cell asks of Ray
    (``{num_cpus: 1, num_gpus: 0}``; a GPU cell runs its commands there with ``--device auto``)."""
    defaults = module(cfg["script"]).CONFIG
    unknown = set(cfg) - set(defaults) - {"script", "resources"}
    if unknown:
        raise PBEError(f"{where}: unknown keys {sorted(unknown)} for {cfg['script']}; known: "
                       f"{sorted(defaults) + ['resources']}")
    res = cfg.get("resources", {})
    if not isinstance(res, dict) or set(res) - set(RESOURCES) or \
            any(not isinstance(v, (int, float)) or v < 0 for v in res.values()):
        raise PBEError(f"{where}: resources must map {' / '.join(RESOURCES)} to numbers >= 0, got {res!r}")
    return {**defaults, **cfg}


def run_one(script: str, params: dict) -> dict:
    """Make one row (what a worker runs)."""
    return module(script).run_cell(**params)


def pending(table, cells: list[Cell], stale=None) -> list[Cell]:
    """The cells without a row (on a zoo model: without one made on its committed weights; with a
    script's ``stale(row)``: without one it still accepts, e.g. made by the current method)."""
    todo = []
    for c in cells:
        row = table.find(**c.key)
        if row is None or (c.zoo is not None and row.get("zoo_sha256") != zoo.row(c.zoo)["sha256"]) or \
                (stale is not None and stale(row)):
            todo.append(c)
    return todo


def median_cost(table, default: float, **match) -> float:
    """The median epoch-equivalents of the table's rows with these key values (`default` without any):
    a cell's cost estimate."""
    costs = [r["epoch_equivalents"] for r in table.rows
             if r.get("epoch_equivalents") and all(r.get(k) == v for k, v in match.items())]
    return statistics.median(costs) if costs else default


def seconds_per_epoch_equivalent(table) -> float | None:
    """The median wall time per epoch-equivalent of the table's rows (None without any)."""
    rates = [r["wall_s"] / r["epoch_equivalents"] for r in table.rows
             if r.get("epoch_equivalents") and r.get("wall_s")]
    return statistics.median(rates) if rates else None


def execute(cfg: dict, executor: str = "local", address: str | None = None, only: list[str] | None = None,
            dry_run: bool = False, progress: bool = True) -> list[dict]:
    """Run a config's cells that have no row; returns the rows made (dry run: none)."""
    if executor not in ("local", "ray"):
        raise PBEError(f"unknown executor {executor!r}; use 'local' or 'ray'")
    cfg = complete(cfg)
    mod = module(cfg["script"])
    table = mod.results_table(cfg)
    cells = mod.cells(cfg)
    if cfg.get("resources"):
        cells = [replace(c, resources={"num_cpus": 1, **cfg["resources"]}) for c in cells]
    if only:
        cells = [c for c in cells if any(fnmatch.fnmatch(c.name, p) or p in c.name for p in only)]
    todo = pending(table, cells, getattr(mod, "stale", None))
    rate = seconds_per_epoch_equivalent(table)
    done = {c.name: min(c.estimate, mod.staged(**c.params)) if hasattr(mod, "staged") else 0.0 for c in todo}
    total = sum(c.estimate - done[c.name] for c in todo)
    resuming = sum(1 for d in done.values() if d > 0)
    print(f"{table.json_path.stem}: {len(cells)} cells, {len(cells) - len(todo)} done, {len(todo)} to run"
          + (f" ({resuming} resuming from a staged state)" if resuming else "") + f", about {total:.1f} "
          "epoch-equivalents left" + (f" (~{total * rate / 3600:.1f} h at this table's median "
                                      f"{rate:.0f} s per epoch-equivalent)" if rate else ""), flush=True)
    if dry_run:
        for c in todo:
            print(f"  {c.name}: ~{c.estimate - done[c.name]:.1f} epoch-eq."
                  + (f" ({done[c.name]:.1f} done in its staged state)" if done[c.name] else ""))
        return []
    if not todo:
        return []
    if executor == "local":
        return _run_local(table, todo, progress, getattr(mod, "stale", None))
    return _run_ray(table, todo, address, progress)


VOLATILE = ("hardware", "toolkit_version", "command")  # what a rerun may change (and every "...wall_s" time)


def differences(old: dict, new: dict) -> dict:
    """The fields (VOLATILE ones and wall times aside) whose values differ between a row and its rerun:
    name -> (old, new)."""
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if k not in VOLATILE and not k.endswith("wall_s") and old.get(k) != new.get(k)}


def verify(cfg: dict, only: list[str] | None = None) -> list[dict]:
    """Rerun the config's cells that have a row (those `only` selects) into a temporary results and runs
    folder, nothing committed touched, and compare each new row with its committed one. Returns one
    ``{"cell", "differences", "hardware"}`` per cell (``differences`` empty: identical)."""
    import subprocess
    import tempfile
    cfg = complete(cfg)
    mod = module(cfg["script"])
    table = mod.results_table(cfg)
    cells = [c for c in mod.cells(cfg) if not only or any(fnmatch.fnmatch(c.name, p) or p in c.name for p in only)]
    done = [c for c in cells if not pending(table, [c], getattr(mod, "stale", None))]
    print(f"{table.json_path.stem}: {len(done)} of {len(cells)} selected cells have a row to verify", flush=True)
    if not done:
        return []
    out = []
    with tempfile.TemporaryDirectory(prefix="pbe-verify-") as tmp:
        config = Path(tmp) / "config.yaml"
        config.write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "PBE_RESULTS": str(Path(tmp) / "results"), "PBE_RUNS": str(Path(tmp) / "runs")}
        for c in done:  # one process per cell: the scripts read PBE_RESULTS / PBE_RUNS when imported
            subprocess.run([sys.executable, str(HERE / "reproduce.py"), str(config), "--only", c.name, "--no-progress"],
                           env=env, check=True)
        path = Path(tmp) / "results" / table.json_path.name
        fresh = {table.cell(row): row for row in (json.loads(path.read_text()) if path.is_file() else [])}
        for c in done:
            old = table.find(**c.key)
            new = fresh.get(table.cell(old))
            if new is None:
                raise PBEError(f"verify: the rerun of {c.name!r} wrote no row")
            diff = differences(old, new)
            out.append({"cell": c.name, "differences": diff, "hardware": (old.get("hardware"), new.get("hardware"))})
            said = "identical" if not diff else f"{len(diff)} fields differ: " + "; ".join(
                f"{k}: {str(a)[:60]} -> {str(b)[:60]}" for k, (a, b) in diff.items())
            print(f"{c.name}: {said} (committed on {old.get('hardware')}; rerun on {new.get('hardware')})", flush=True)
    same = sum(not r["differences"] for r in out)
    print(f"{table.json_path.stem}: {same} of {len(out)} rows reproduced identically", flush=True)
    return out


def _bar(todo: list[Cell], progress: bool):
    from tqdm import tqdm
    return tqdm(total=sum(c.estimate for c in todo), disable=not progress, unit="ep-eq",
                bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} epoch-eq. [{elapsed}<{remaining}] {postfix}")


def _run_local(table, todo: list[Cell], progress: bool, stale=None) -> list[dict]:
    """Run the cells in turn; a cell that another process (e.g. one started with another ``--only``) has
    made meanwhile is skipped: the table is re-read before each."""
    from common import CELL_PROGRESS
    if progress and sys.stderr.isatty():  # each cell's own bars under the overall one
        os.environ[CELL_PROGRESS] = "1"
    made = []
    with _bar(todo, progress) as bar:
        for i, c in enumerate(todo, 1):
            bar.set_postfix_str(f"cell {i}/{len(todo)}: {c.name}")
            table.reload()
            if not pending(table, [c], stale):
                bar.update(c.estimate)
                bar.write(f"{c.name}: made meanwhile by another process, skipped")
                continue
            start = time.time()
            row = run_one(c.script, c.params)
            table.add(row)
            made.append(row)
            bar.update(c.estimate)
            bar.write(f"{c.name}: done in {time.time() - start:.0f} s")
    return made


def _run_ray(table, todo: list[Cell], address: str | None, progress: bool) -> list[dict]:
    try:
        import ray
    except ImportError as e:
        raise PBEError("the Ray executor needs Ray: pip install -e '.[ray]'") from e
    path = os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {"PYTHONPATH": path, **{k: os.environ[k] for k in ("PBE_RESULTS", "PBE_RUNS", "OMP_NUM_THREADS")
                                  if k in os.environ}}
    started = not ray.is_initialized()
    if started:
        local = {} if address else {"object_store_memory": OBJECT_STORE_BYTES}
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False, **local)
    try:
        task = ray.remote(run_one)
        refs = {task.options(max_retries=RETRIES, **c.resources).remote(c.script, c.params): c for c in todo}
        made, waiting = [], list(refs)
        with _bar(todo, progress) as bar:
            while waiting:
                done, waiting = ray.wait(waiting, num_returns=1)
                c = refs[done[0]]
                row = ray.get(done[0])  # a cell that failed RETRIES + 1 times raises here: nothing half-written
                table.add(row)
                made.append(row)
                bar.update(c.estimate)
                bar.set_postfix_str(f"{len(made)}/{len(todo)} cells; last: {c.name}")
        return made
    finally:
        if started:
            ray.shutdown()
