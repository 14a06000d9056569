"""The model zoo: committed clean and infected models that every measurement starts from.

``available()`` lists the entries of ``experiments/zoo/zoo.yaml``; ``load("cifar10/badnets")`` returns
the model (its weights checked against the committed sha256), the attack, the poisoned training set
(rebuilt exactly from the attack state and poison indices, and checked against the stored checksum
of its images) and the test set; ``build(name)`` trains a missing entry (resumably, through
``pbe attack`` / ``pbe train``) and says whether the rebuilt weights reproduce the committed ones.

Each entry lives in ``experiments/zoo/<name>/``: ``model.safetensors`` + ``model.json``,
``attack.safetensors`` + ``attack.json`` and ``poison.json`` (infected models), ``train_log.jsonl``
and ``row.json`` (its row in the shape of RESULTS.md, with ``zoo`` and ``zoo_set``). All rows are
collected in ``experiments/zoo/zoo.json`` and rendered to ``experiments/zoo/README.md``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch.nn as nn

from pbe.data import ImageDataset
from pbe.registry import unknown_name
from pbe.utils import PBEError, atomic_path, toolkit_version, write_json

REPO = Path(__file__).resolve().parent.parent
SETS = ("dev", "generalisation")
ENTRY_FILES = ("model.safetensors", "model.json", "train_log.jsonl")
ATTACK_FILES = ("attack.safetensors", "attack.json", "poison.json")
DATA_DIRS = {"cifar10": "cifar10", "gtsrb": "gtsrb", "mnist": "mnist"}


def root() -> Path:
    """The zoo folder: ``$PBE_ZOO`` or ``experiments/zoo`` of this checkout."""
    return Path(os.environ.get("PBE_ZOO", REPO / "experiments" / "zoo"))


def default_data_root(dataset: str) -> Path | None:
    """``$PBE_DATA/<dataset>`` or the offline copy beside the checkout (``../shared/data``)."""
    if dataset not in DATA_DIRS:
        return None
    base = Path(os.environ.get("PBE_DATA", REPO.parent / "shared" / "data"))
    return base / DATA_DIRS[dataset]


@dataclass(frozen=True)
class Entry:
    name: str
    set: str
    dataset: str
    attack: str
    recipe: str
    rate: float
    target: int | None
    all_to_all: bool
    seed: int
    params: dict = field(default_factory=dict)
    model: str | None = None
    width: int | None = None
    epochs: int | None = None  # overrides the recipe's (small test zoos)

    @property
    def folder(self) -> Path:
        return root() / self.name

    @property
    def infected(self) -> bool:
        return self.attack != "none"

    def command(self, out: Path, data_root: Path | None) -> list[str]:
        """The ``pbe`` command that trains this entry into `out`."""
        cmd = ["pbe", "attack", "--attack", self.attack] if self.infected else ["pbe", "train"]
        cmd += ["--dataset", self.dataset, "--recipe", self.recipe, "--seed", str(self.seed)]
        if data_root is not None:
            cmd += ["--data-root", str(data_root)]
        if self.model:
            cmd += ["--model", self.model]
        if self.width:
            cmd += ["--width", str(self.width)]
        if self.epochs:
            cmd += ["--epochs", str(self.epochs)]
        if self.infected:
            cmd += ["--rate", str(self.rate)]
            cmd += ["--all-to-all"] if self.all_to_all else ["--target", str(self.target)]
            for k, v in sorted(self.params.items()):
                cmd += ["--param", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
        return cmd + ["--out", str(out), "--no-progress"]


def entries() -> dict[str, Entry]:
    """Every entry of ``zoo.yaml``, by name."""
    import yaml
    path = root() / "zoo.yaml"
    if not path.exists():
        raise PBEError(f"zoo config {path} not found; set PBE_ZOO to the folder holding zoo.yaml")
    doc = yaml.safe_load(path.read_text()) or {}
    defaults, found = doc.get("defaults", {}), {}
    for raw in doc.get("models", []):
        spec = {**defaults, **raw}
        if spec.get("set") not in SETS:
            raise PBEError(f"{path}: entry {spec.get('name')!r} has set {spec.get('set')!r}; use one of {SETS}")
        try:
            entry = Entry(**spec)
        except TypeError as err:
            raise PBEError(f"{path}: bad entry {raw}: {err}") from err
        if entry.name in found:
            raise PBEError(f"{path}: entry {entry.name!r} is listed twice")
        found[entry.name] = entry
    return found


def available(zoo_set: str | None = None) -> list[str]:
    """Names of the zoo's entries (of one set, if given), in the order of ``zoo.yaml``."""
    return [n for n, e in entries().items() if zoo_set in (None, e.set)]


def get(name: str) -> Entry:
    found = entries()
    if name not in found:
        raise unknown_name("zoo entry", name, list(found))
    return found[name]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def row(name: str) -> dict | None:
    """The committed row of an entry, or None when it is not built yet."""
    path = get(name).folder / "row.json"
    return json.loads(path.read_text()) if path.exists() else None


def is_built(name: str) -> bool:
    entry = get(name)
    files = ENTRY_FILES + (ATTACK_FILES if entry.infected else ())
    return (entry.folder / "row.json").exists() and all((entry.folder / f).exists() for f in files)


@dataclass
class ZooModel:
    """What ``load`` returns: everything a defence experiment starts from."""

    name: str
    model: nn.Module
    attack: object | None  # attacks.BackdoorAttack, or None for a clean model
    train_set: ImageDataset  # the poisoned training set (the clean one for a clean model)
    test_set: ImageDataset
    row: dict

    @property
    def zoo_keys(self) -> dict:
        return {"zoo": self.row["zoo"], "zoo_set": self.row["zoo_set"]}


def load(name: str, data_root: str | Path | None = None, device="cpu") -> ZooModel:
    """Model, attack, poisoned training set and test set of a built entry, all checked."""
    from pbe import checkpoint, data
    entry = get(name)
    if not is_built(name):
        raise PBEError(f"zoo entry {name!r} is not built; run `pbe zoo build {name}`")
    stored = row(name)
    weights = entry.folder / "model.safetensors"
    if sha256(weights) != stored["sha256"]:
        raise PBEError(f"{weights} does not match its committed sha256; restore it with `git checkout -- "
                       f"{weights}` or rebuild it with `pbe zoo build {name} --force`")
    data_root = Path(data_root) if data_root is not None else default_data_root(entry.dataset)
    if data_root is not None and not data_root.exists():
        raise PBEError(f"data root {data_root} of {entry.dataset} not found; pass data_root= (CLI: --data-root) "
                       "or set PBE_DATA to the folder holding it")
    model, _ = checkpoint.load(weights, device=device)
    train_set = data.load(entry.dataset, data_root, "train")
    test_set = data.load(entry.dataset, data_root, "test")
    attack = None
    if entry.infected:
        import attacks
        from pbe.train import data_fingerprint
        attack = attacks.load(entry.folder / "attack")
        info = json.loads((entry.folder / "poison.json").read_text())
        train_set = attack.poison(train_set, info["rate"], info["seed"])
        if train_set.poison_indices.tolist() != info["poison_indices"] or \
                data_fingerprint(train_set) != info["images_sha256"]:
            raise PBEError(f"the poisoned training set rebuilt for {name!r} differs from the one it was trained on "
                           f"(poison indices or image checksum); is {data_root} the dataset it was built from?")
    return ZooModel(name, model, attack, train_set, test_set, stored)


def _zoo_row(entry: Entry, out: Path, metrics: dict) -> dict:
    from pbe import checkpoint
    meta = checkpoint.read_meta(out / "model")
    arch = dict(meta["architecture"])
    arch_name = arch.pop("name")
    args = ", ".join(f"{k}={v}" for k, v in sorted(arch.items()) if k in ("width",))
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return {
        "dataset": entry.dataset, "model": f"{arch_name}({args})", "recipe": entry.recipe, "attack": entry.attack,
        "rate": entry.rate if entry.infected else 0.0, "target": entry.target if entry.infected else None,
        "all_to_all": entry.all_to_all, "defense": "none", "setting": None, "seed": entry.seed,
        "acc": metrics["acc"], "asr": metrics["asr"], "ra": metrics["ra"], "acc_before": None, "asr_before": None,
        "ra_before": None, "der": None, "detection": None, "wall_s": metrics["wall_s"],
        "epoch_equivalents": float(meta["recipe_fields"]["epochs"]), "command": metrics["command"],
        "hardware": metrics["hardware"], "toolkit_version": toolkit_version(), "zoo": entry.name,
        "zoo_set": entry.set, "params": entry.params, "sha256": sha256(out / "model.safetensors"),
        "train_log": log,
    }


# an infected entry whose trained model's ASR stays below this did not learn its backdoor and is not installed (the
# zoo's weakest learnt backdoors reach 78 %; a failed one stays near chance, e.g. Adap-Blend's noise key 1.9 %)
MIN_LEARNT_ASR = 0.5


def build(name: str, data_root: str | Path | None = None, runs: str | Path = "runs/zoo",
          force: bool = False) -> dict:
    """Train `name` (resuming an interrupted run in `runs`), copy it into the zoo and return its row.

    A built entry is not retrained unless `force`; then the rebuilt weights are compared with the
    committed sha256 and the result is said (``row["reproduces"]``).
    """
    entry = get(name)
    previous = row(name) if is_built(name) else None
    if previous and not force:
        asr = "–" if previous["asr"] is None else f"{previous['asr']:.4f}"
        print(f"{name}: built (acc {previous['acc']:.4f}, asr {asr}); skipped", flush=True)
        return previous
    data_root = Path(data_root) if data_root is not None else default_data_root(entry.dataset)
    if data_root is not None:
        data_root = Path(os.path.relpath(data_root))  # a command that reads well in the row
    out = Path(runs) / entry.name
    cmd = entry.command(out, data_root)
    print("$", shlex.join(cmd), flush=True)
    proc = subprocess.run([sys.executable, "-m", "pbe.cli", *cmd[1:]], cwd=Path.cwd())
    if proc.returncode != 0:
        raise PBEError(f"training {name!r} failed (exit {proc.returncode}); rerun `pbe zoo build {name}` to resume "
                       f"(a run interrupted under other code cannot resume: its error above names the folder to "
                       f"remove first)")
    metrics = json.loads((out / "metrics.json").read_text())
    new = _zoo_row(entry, out, metrics)
    if previous is not None:
        new["reproduces"] = new["sha256"] == previous["sha256"]
        print(f"{name}: rebuilt weights {'reproduce' if new['reproduces'] else 'DIFFER FROM'} the committed "
              f"sha256 {previous['sha256'][:12]}", flush=True)
        # either way the committed entry stays as it is; a differing rebuild is left in `runs` to inspect
        return {**previous, "reproduces": new["reproduces"], "rebuild_wall_s": new["wall_s"]}
    if entry.infected and new["asr"] is not None and new["asr"] < MIN_LEARNT_ASR:
        raise PBEError(f"{name}: the backdoor was not learnt (ASR {new['asr']:.2%} < {MIN_LEARNT_ASR:.0%} at ACC "
                       f"{new['acc']:.2%}); not installed. Change the entry's attack parameters, rate or recipe in "
                       f"zoo.yaml; the trained run stays in {out} to inspect")
    _install(entry, out, new)
    print(f"{name}: acc {new['acc']:.4f} asr {new['asr']} wall {new['wall_s']:.0f}s", flush=True)
    return new


def _install(entry: Entry, out: Path, new: dict) -> None:
    """Copy a finished run into its zoo folder (files first, row.json last) and re-render the index."""
    dest = entry.folder
    dest.mkdir(parents=True, exist_ok=True)
    for f in ENTRY_FILES + (ATTACK_FILES if entry.infected else ()):
        with atomic_path(dest / f) as tmp:
            shutil.copyfile(out / f, tmp)
    write_json(dest / "row.json", new)
    render()


def render() -> None:
    """Collect every row into ``zoo.json`` and render ``README.md``."""
    rows = [row(n) for n in available() if is_built(n)]
    write_json(root() / "zoo.json", [{k: v for k, v in r.items() if k != "train_log"} for r in rows])
    pct = lambda v: "–" if v is None else f"{100 * v:.2f}"  # noqa: E731
    lines = ["# Model zoo", "",
             "Regenerate: `pbe zoo build --all` (trains only what is missing; rows in `zoo.json`, one folder per "
             "model). Load one with `pbe.zoo.load(\"cifar10/badnets\")`. Tune defences on `dev` models only.", "",
             "| zoo | set | model | attack | params | rate | target | ACC % | ASR % | RA % | wall s | hardware "
             "| sha256 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        target = "all-to-all" if r["all_to_all"] else ("–" if r["target"] is None else r["target"])
        params = ", ".join(f"{k}={v}" for k, v in sorted(r.get("params", {}).items())) or "–"
        lines.append(f"| {r['zoo']} | {r['zoo_set']} | {r['model']} | {r['attack']} | {params} | {r['rate']} | "
                     f"{target} | {pct(r['acc'])} | {pct(r['asr'])} | {pct(r['ra'])} | {r['wall_s']:.0f} | "
                     f"{r['hardware']} | `{r['sha256'][:12]}` |")
    pending = [n for n in available() if not is_built(n)]
    if pending:
        lines += ["", "Not built yet: " + ", ".join(pending) + "."]
    lines += ["", "Commands (seed and data are in each command; data from `../shared/data`):", ""]
    lines += [f"- `{r['zoo']}`: `{r['command']}`" for r in rows]
    with atomic_path(root() / "README.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")
