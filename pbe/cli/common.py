"""What the command groups share: the common options, loading data and models, and the resumable
``train_and_save`` behind ``pbe train`` and ``pbe attack``."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pbe.utils import PBEError, check_writable


def add_common(p: argparse.ArgumentParser) -> None:
    """--device --seed --out --data-root --dataset --no-progress --overwrite."""
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default: auto)")
    p.add_argument("--seed", type=int, default=0, help="seed for every random draw (default: 0)")
    p.add_argument("--out", type=Path, help="output directory")
    p.add_argument("--data-root", type=Path, help="dataset folder (not needed for the built-in 'digits')")
    p.add_argument("--dataset", default="digits",
                   help="cifar10 | mnist | gtsrb | digits | imagefolder:PATH | npz:PATH (default: digits)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--overwrite", action="store_true", help="replace another run found in --out")


def load_both(args):
    from pbe import data
    train = data.load(args.dataset, args.data_root, "train", download=getattr(args, "download", False))
    test = data.load(args.dataset, args.data_root, "test", download=getattr(args, "download", False))
    return train, test


def build_model(recipe, train_set, dataset_name: str, seed: int):
    from pbe import models
    return models.create(recipe.model, train_set.num_classes, train_set.image_shape[0],
                         dataset=dataset_name, seed=seed, width=recipe.width)


TRAIN_STATE = "train_state.safetensors"  # resumable training state inside --out, removed when the run ends


def _finished_or_resumable(out: Path, run: dict, overwrite: bool) -> dict | None:
    """The stored metrics when `out` holds this very run, finished; None when it is empty or holds this
    run unfinished (training resumes). Another run in `out` is refused unless `overwrite`."""
    import shutil

    from pbe import checkpoint
    side, metrics_file = out / "model.json", out / "metrics.json"
    if side.exists() and metrics_file.exists():
        if checkpoint.read_meta(side).get("run") == run:
            return json.loads(metrics_file.read_text())
    elif (out / TRAIN_STATE).exists() or not out.exists() or not any(out.iterdir()):
        return None  # a state of another run is refused by train() itself, unless overwritten below
    if not overwrite:
        raise PBEError(f"{out} holds another run (other command, data, recipe, seed or attack); "
                       "choose another --out, or pass --overwrite to replace it")
    shutil.rmtree(out)
    return None


def train_and_save(args, recipe, fit, attack=None, extra_meta: dict | None = None, after=None) -> dict:
    """Shared by ``pbe train`` and ``pbe attack``: load data, build the model, ``fit(model, train_set,
    test_set, log_path, state_path)``, evaluate (with the attack, if any), save model and sidecar,
    ``after(model)`` (extra files), and metrics.json last. Rerunning the same command resumes an
    interrupted run from its last finished epoch and returns a finished one's metrics untouched."""
    from dataclasses import asdict

    from pbe import checkpoint, metrics
    from pbe.utils import hardware_string, write_json

    if args.out is None:
        raise PBEError(f"pbe {args.command} needs --out DIR for the model and its metrics")
    check_writable(args.out)
    run = {"command": args.command, "dataset": args.dataset, "seed": args.seed, "recipe_fields": asdict(recipe),
           **json.loads(json.dumps(extra_meta or {}))}
    if getattr(args, "overwrite", False) and (args.out / TRAIN_STATE).exists():
        (args.out / TRAIN_STATE).unlink()
    done = _finished_or_resumable(args.out, run, getattr(args, "overwrite", False))
    if done is not None:
        print(f"{args.out} already holds this finished run; nothing to do", file=sys.stderr)
        print(json.dumps(done))
        return done
    train_set, test_set = load_both(args)
    model = build_model(recipe, train_set, args.dataset, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    fit(model, train_set, test_set, args.out / "train_log.jsonl", args.out / TRAIN_STATE)
    history = [json.loads(line) for line in (args.out / "train_log.jsonl").read_text().splitlines()]
    wall = history[-1]["elapsed_s"] if history else round(time.time() - start, 1)
    result = {**metrics.evaluate(model, test_set, attack), "wall_s": wall,
              "hardware": hardware_string(), "command": " ".join(["pbe"] + sys.argv[1:])}
    meta = {"dataset": args.dataset, "classes": train_set.classes, "seed": args.seed, "recipe": args.recipe,
            "recipe_fields": asdict(recipe), **(extra_meta or {}), "run": run, "metrics": result}
    checkpoint.save(model, args.out / "model", meta)
    if after is not None:
        after(model)
    write_json(args.out / "metrics.json", result)
    (args.out / TRAIN_STATE).unlink(missing_ok=True)
    print(json.dumps(result))
    return result


def load_model_and_test(args):
    """The checkpoint named by --model and the test split of its dataset (the sidecar's, unless
    --dataset names another one than the default)."""
    from pbe import checkpoint, data
    model, meta = checkpoint.load(args.model, device="cpu")
    if args.dataset == "digits" and meta.get("dataset") not in (None, "digits"):
        args.dataset = meta["dataset"]
    return model, meta, data.load(args.dataset, args.data_root, "test")
