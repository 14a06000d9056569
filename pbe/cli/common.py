"""What the command groups share: the common options, loading data and models, and the resumable
``train_and_save`` behind ``pbe train`` and ``pbe attack``."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Iterator

from pbe.utils import PBEError, check_writable


def seed_arg(text: str) -> int:
    """argparse type of --seed: an integer in [0, 2**63)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a seed is an integer, got {text!r}") from None
    if not 0 <= value < 2 ** 63:
        raise argparse.ArgumentTypeError(f"a seed must be in [0, 2**63), got {value}")
    return value


COMMON = ("device", "seed", "out", "progress", "overwrite")  # add_common's options that a command may go without
DATASETS_HELP = "cifar10 | mnist | gtsrb | digits | imagefolder:PATH | npz:PATH"


def add_common(p: argparse.ArgumentParser, *, without: tuple[str, ...] = (), model: bool = False) -> None:
    """--device --seed --out --data-root --dataset --no-progress --overwrite, but those of ``COMMON`` named in
    `without`: a command offers no option it would ignore (argparse refuses it). With `model` (the command
    takes --model), --dataset defaults to the dataset recorded with the model (``resolve_dataset``)."""
    unknown = set(without) - set(COMMON)
    if unknown:
        raise ValueError(f"add_common: unknown options {sorted(unknown)}; known: {COMMON}")
    if "device" not in without:
        p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default: auto)")
    if "seed" not in without:
        p.add_argument("--seed", type=seed_arg, default=0,
                       help="seed for every random draw, in [0, 2**63) (default: 0)")
    if "out" not in without:
        p.add_argument("--out", type=Path, help="output directory")
    p.add_argument("--data-root", type=Path, help="dataset folder (not needed for the built-in 'digits')")
    if model:
        p.add_argument("--dataset", help=f"{DATASETS_HELP} (default: the dataset recorded with --model, else "
                       "digits); given, it wins over the recorded one, and must fit the model (channels, classes, "
                       "class names, image size)")
    else:
        p.add_argument("--dataset", default="digits", help=f"{DATASETS_HELP} (default: digits)")
    if "progress" not in without:
        p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    if "overwrite" not in without:
        p.add_argument("--overwrite", action="store_true", help="replace another run found in --out")


def add_model_arg(p: argparse.ArgumentParser, help: str = "checkpoint: directory, .safetensors or its .json") -> None:
    """--model and, for a legacy ``.pt`` state dict, --arch."""
    p.add_argument("--model", required=True, help=help)
    p.add_argument("--arch", help="for a legacy .pt state dict only: its architecture as JSON, e.g. "
                                  "'{\"name\": \"preact_resnet18\", \"num_classes\": 10, \"width\": 16}'")


def load_both(args):
    from pbe import data
    train = data.load(args.dataset, args.data_root, "train", download=getattr(args, "download", False))
    test = data.load(args.dataset, args.data_root, "test", download=getattr(args, "download", False))
    return train, test


def build_model(recipe, train_set, dataset_name: str, seed: int):
    from pbe import models
    return models.create(recipe.model, train_set.num_classes, train_set.image_shape[0],
                         dataset=dataset_name, seed=seed, width=recipe.width)


TRAIN_STATE = "train_state.safetensors"  # resumable training state in the staging folder, dropped at the end


def finished_run(out: Path, run: dict, overwrite: bool) -> dict | None:
    """The stored metrics when `out` holds this very run, finished; None when it is empty, missing, or
    (with `overwrite`) holds another run, which the new unit replaces when it is complete. Another
    run is refused without `overwrite`."""
    from pbe import checkpoint, rundir
    if not out.exists() or not any(out.iterdir()):
        return None
    manifest = rundir.read_manifest(out)
    metrics_file = out / "metrics.json"
    if manifest is not None:
        same = manifest["run"] == run
        if same:
            rundir.verify(out)
    else:  # a folder of an older version: its sidecar names the run
        same = (out / "model.json").exists() and checkpoint.read_meta(out / "model.json").get("run") == run
    if same and metrics_file.exists():
        return json.loads(metrics_file.read_text())
    if not overwrite:
        raise PBEError(f"{out} holds another run (other command, data, recipe, seed, attack, defence or, for a "
                       "defence, toolkit version); "
                       "choose another --out, or pass --overwrite to replace it")
    return None


@contextlib.contextmanager
def output_unit(args, run: dict, drop: tuple[str, ...] = ()) -> Iterator[Path | None]:
    """Where a command writes its unit (``pbe.rundir``): yields the staging folder, or None when --out
    already holds this finished run (its metrics printed; nothing to do). On success the unit gets its
    manifest (the files `drop` left out of it) and is swapped into --out."""
    from pbe import rundir
    from pbe.utils import json_safe
    if args.out is None:
        raise PBEError(f"pbe {args.command} needs --out DIR")
    run = json_safe(run)
    out = check_writable(args.out)
    with rundir.locked(out):
        rundir.recover(out)
        stage = rundir.staging(out)
        if TRAIN_STATE in drop and (out / TRAIN_STATE).exists() and not stage.exists():
            out.rename(stage)  # an unfinished run of a version that trained in --out itself: resume it there
        overwrite = getattr(args, "overwrite", False)
        done = finished_run(out, run, overwrite)
        if done is not None:
            print(f"{out} already holds this finished run; nothing to do", file=sys.stderr)
            print(json.dumps(done))
            yield None
            return
        stage = rundir.stage_for(out, run, replace=overwrite)  # an interrupted run of this command resumes
        yield stage
        rundir.write_manifest(stage, run, drop)
        rundir.commit(stage, out)


def train_and_save(args, recipe, fit, attack=None, extra_meta: dict | None = None, after=None) -> dict:
    """Shared by ``pbe train`` and ``pbe attack``: load data, build the model, ``fit(model, train_set,
    test_set, log_path, state_path)``, evaluate (with the attack, if any), save model and sidecar,
    ``after(model, folder)`` (extra files), and metrics.json, all in one unit (``output_unit``).
    Rerunning the same command resumes an interrupted run from its last finished epoch and returns a
    finished one's metrics untouched."""
    from dataclasses import asdict

    from pbe import checkpoint, metrics
    from pbe.utils import hardware_string, write_json

    run = {"command": args.command, "dataset": args.dataset, "seed": args.seed, "recipe_fields": asdict(recipe),
           **(extra_meta or {})}  # output_unit keeps it as it reads back from JSON
    with output_unit(args, run, drop=(TRAIN_STATE,)) as stage:
        if stage is None:
            return json.loads((args.out / "metrics.json").read_text())
        train_set, test_set = load_both(args)
        model = build_model(recipe, train_set, args.dataset, args.seed)
        start = time.time()
        fit(model, train_set, test_set, stage / "train_log.jsonl", stage / TRAIN_STATE)
        log = stage / "train_log.jsonl"
        history = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        wall = history[-1]["elapsed_s"] if history else round(time.time() - start, 1)
        result = {**metrics.evaluate(model, test_set, attack), "wall_s": wall,
                  "hardware": hardware_string(), "command": " ".join(["pbe"] + sys.argv[1:])}
        meta = {"dataset": args.dataset, "classes": train_set.classes, "image_shape": list(train_set.image_shape),
                "seed": args.seed, "recipe": args.recipe,
                "recipe_fields": asdict(recipe), **(extra_meta or {}), "run": run, "metrics": result}
        checkpoint.save(model, stage / "model", meta)
        if after is not None:
            after(model, stage)
        write_json(stage / "metrics.json", result)
    print(json.dumps(result))
    return result


def check_fits(model_meta: dict, data, where: str) -> None:
    """Refuse data the model was not built for: other channels, classes, class names or image size."""
    arch = model_meta.get("architecture") or {}
    problems = []
    if arch.get("in_channels", data.image_shape[0]) != data.image_shape[0]:
        problems.append(f"{data.image_shape[0]} channels, the model takes {arch['in_channels']}")
    if arch.get("num_classes", data.num_classes) != data.num_classes:
        problems.append(f"{data.num_classes} classes, the model has {arch['num_classes']}")
    elif model_meta.get("classes") not in (None, list(data.classes)):
        problems.append(f"classes {list(data.classes)[:5]}..., the model's {model_meta['classes'][:5]}...")
    if model_meta.get("image_shape") not in (None, list(data.image_shape)):
        problems.append(f"images of shape {list(data.image_shape)}, the model was trained on "
                        f"{model_meta['image_shape']}")
    if problems:
        raise PBEError(f"{where} does not fit the model: {'; '.join(problems)}; pass the --dataset the model was "
                       "trained on (or none: the one recorded with the model)")


def resolve_dataset(args) -> str:
    """``args.dataset``, set when --dataset was not given: the dataset recorded in --model's sidecar, else
    digits. A given --dataset wins (``load_model_and_test`` then checks that it fits the model)."""
    if args.dataset is None:
        from pbe import checkpoint
        recorded = None
        if Path(args.model).suffix not in (".pt", ".pth"):  # a legacy state dict has no sidecar
            with contextlib.suppress(PBEError):  # a bad checkpoint is named when it is loaded
                recorded = checkpoint.read_meta(args.model).get("dataset")
        args.dataset = recorded if isinstance(recorded, str) else "digits"
    return args.dataset


def load_model_and_test(args):
    """The checkpoint named by --model (a legacy ``.pt`` with --arch), on the CPU, and the test split of
    --dataset (``resolve_dataset``), checked to fit each other."""
    from pbe import checkpoint, data
    arch = getattr(args, "arch", None)
    if arch is not None:
        try:
            arch = json.loads(arch)
        except json.JSONDecodeError as err:
            raise PBEError(f"--arch must be JSON, e.g. '{{\"name\": \"preact_resnet18\", \"num_classes\": 10}}'; "
                           f"got {arch!r} ({err})") from err
    resolve_dataset(args)
    model, meta = checkpoint.load(args.model, device="cpu", architecture=arch)
    test = data.load(args.dataset, args.data_root, "test")
    check_fits(meta, test, f"the test split of {args.dataset}")
    return model, meta, test
