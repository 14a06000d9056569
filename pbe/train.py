"""Fast, seeded training on in-memory uint8 datasets with batched tensor augmentation.

``train(model, train_set, recipe="cpu")`` runs SGD with momentum under a one-cycle or cosine
schedule, writes one JSON line of metrics per epoch, and shows a tqdm progress bar.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from pbe.data import ImageDataset, augment
from pbe.metrics import accuracy, predict
from pbe.checkpoint import load_state, save_state
from pbe.utils import PBEError, atomic_path, json_safe, resolve_device, seed_everything, use_all_cpus


MEMORY_FORMAT = torch.channels_last  # 20-40 % faster for conv nets on a CPU
LR_SCHEDULES = ("onecycle", "cosine", "constant")


def lr_factor(step: int, total: int, schedule: str, warmup: float = 0.0) -> float:
    """The one learning-rate schedule of the toolkit, as a multiplier of the base rate at `step` of
    `total`: linear warm-up over a `warmup` share then linear decay (onecycle), cosine, or constant.
    Training applies it per step; the defences' fine-tuning per epoch through ``LambdaLR``."""
    if schedule == "onecycle":
        peak = max(1, int(warmup * total))
        if step < peak:
            return 0.1 + 0.9 * step / peak
        return max(0.0, (total - step) / max(1, total - peak))
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * step / total))
    if schedule == "constant":
        return 1.0
    raise PBEError(f"unknown schedule {schedule!r}; use one of {', '.join(LR_SCHEDULES)}")


MAX_RECIPE_INT = 100_000  # epochs, batch size, width: larger is a typo, not a plan
MAX_LR = 10.0


@dataclass(frozen=True)
class Recipe:
    """Everything that decides a training run, besides data, model weights and seed."""

    model: str = "preact_resnet18"
    width: int = 16
    epochs: int = 12
    batch_size: int = 128
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    schedule: str = "onecycle"  # or "cosine"
    warmup: float = 0.25  # share of steps spent warming up (onecycle)
    label_smoothing: float = 0.1
    crop_padding: int = 4
    flip: bool = True  # random horizontal flips, where the dataset allows them

    def __post_init__(self):
        ints = {"epochs": self.epochs, "batch_size": self.batch_size, "width": self.width}
        for key, v in ints.items():
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_RECIPE_INT:
                raise PBEError(f"recipe {key} must be an integer in [1, {MAX_RECIPE_INT}], got {v!r}")
        if not 0 < self.lr <= MAX_LR:
            raise PBEError(f"recipe lr must be in (0, {MAX_LR:g}], got {self.lr}")
        if not (0 <= self.momentum < 1 and 0 <= self.weight_decay < 1 and 0 <= self.warmup < 1
                and 0 <= self.label_smoothing < 1 and 0 <= self.crop_padding <= MAX_RECIPE_INT):
            raise PBEError("recipe momentum, weight_decay, warmup and label_smoothing must be in [0, 1) and "
                           f"crop_padding >= 0; got {self.momentum}, {self.weight_decay}, {self.warmup}, "
                           f"{self.label_smoothing}, {self.crop_padding}")
        lr_factor(0, 1, self.schedule)  # an unknown schedule is named here, not after the first epoch


RECIPES = {
    # the paper's model; ~38 min per CIFAR-10 epoch on 2 CPU cores, so for GPUs
    "paper": Recipe(width=64, epochs=100, schedule="cosine", label_smoothing=0.0),
    # 12 epochs gave 84.9% in 26.7 min here; 15 keeps inside 45 min with margin
    "cpu": Recipe(width=16, epochs=15),
    "quick": Recipe(width=16, epochs=4),
    # GTSRB (39,209 images, 43 classes, no flips): the cpu recipe's model with fewer epochs; its
    # accuracy and time are measured by the zoo's gtsrb/clean entry
    "gtsrb": Recipe(width=16, epochs=10),
    # for the built-in 8x8 digits and other tiny data
    # a LeNet-5 without augmentation, as many published backdoor demos train theirs (60-70 % on CIFAR-10)
    "lenet": Recipe(model="lenet", width=6, epochs=30, lr=0.02, crop_padding=0, flip=False, label_smoothing=0.0),
    "tiny": Recipe(model="small_cnn", width=32, epochs=30, batch_size=64, lr=0.05, crop_padding=1),
}


def get_recipe(recipe: str | Recipe, **overrides) -> Recipe:
    if isinstance(recipe, str):
        if recipe not in RECIPES:
            raise PBEError(f"unknown recipe {recipe!r}; available: {', '.join(RECIPES)}")
        recipe = RECIPES[recipe]
    bad = set(overrides) - set(Recipe.__dataclass_fields__)
    if bad:
        raise PBEError(f"unknown recipe field(s) {sorted(bad)}; fields: {sorted(Recipe.__dataclass_fields__)}")
    return replace(recipe, **{k: v for k, v in overrides.items() if v is not None})


class TrainHook(Protocol):
    """Changes each training batch, e.g. an attack trained jointly with the classifier."""

    def before_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Return the batch to train on and an optional extra loss term."""

    def after_step(self) -> None:
        """Called after the classifier's optimiser step."""

    # Optional, for resumable training: ``state_dict() -> dict`` and ``load_state_dict(dict)`` carry
    # the hook's own tensors, optimiser and random-generator state across a restart.


def tensor_fingerprint(*tensors: torch.Tensor) -> str:
    """sha256 of tensors' bytes, one after the other (which data or model a resumable state belongs to)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def data_fingerprint(dataset: ImageDataset) -> str:
    """sha256 of a dataset's images and labels (which run a training state belongs to)."""
    return tensor_fingerprint(dataset.images, dataset.labels)


def rng_state(gen: torch.Generator) -> dict:
    """Every random generator a run draws from (`gen`, torch's, Python's, NumPy's, CUDA's): what a
    resumable state saves so that a resumed run draws what an uninterrupted one would."""
    state = {"gen": gen.get_state(), "torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(gen: torch.Generator, state: dict) -> None:
    """Restore what ``rng_state`` saved."""
    gen.set_state(state["gen"])
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def lr_at(step: int, total: int, recipe: Recipe) -> float:
    """Learning rate of a training recipe at a step."""
    return recipe.lr * lr_factor(step, total, recipe.schedule, recipe.warmup)


def make_optimizer(model: nn.Module, recipe: Recipe) -> torch.optim.SGD:
    """SGD; no weight decay on BatchNorm and bias parameters."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() <= 1]
    return torch.optim.SGD([{"params": decay, "weight_decay": recipe.weight_decay},
                            {"params": no_decay, "weight_decay": 0.0}],
                           lr=recipe.lr, momentum=recipe.momentum, nesterov=recipe.nesterov)


def batches(n: int, batch_size: int, generator: torch.Generator, shuffle: bool = True):
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    for s in range(0, n, batch_size):
        yield order[s:s + batch_size]


def train(model: nn.Module, train_set: ImageDataset, test_set: ImageDataset | None = None,
          recipe: str | Recipe = "cpu", *, seed: int = 0, device="auto", log_path=None,
          progress: bool = True, hook: TrainHook | None = None, eval_subset: int = 2000,
          state_path=None, **overrides) -> list[dict]:
    """Train `model` in place; return per-epoch metrics (also written to `log_path` as JSON lines).

    Test accuracy is measured each epoch on a fixed subset of `eval_subset` test images (cheap) and on
    the full test set after the last epoch (`test_acc`).

    With `state_path` (a ``.safetensors`` file) the whole training state (weights, optimiser, step,
    random generators, hook state, history) is written atomically after every epoch, and a run that
    finds a state of the same run there resumes after its last finished epoch, ending with the same
    weights bit for bit as an uninterrupted run (same machine and thread count). A state of another
    run (other recipe, seed or data) is an error.
    """
    recipe = get_recipe(recipe, **overrides)
    if len(train_set) == 0:
        raise PBEError("the training set is empty")
    dev = resolve_device(device)
    if dev.type == "cpu":
        use_all_cpus()
    gen = seed_everything(seed)
    model.to(dev).to(memory_format=MEMORY_FORMAT)
    opt = make_optimizer(model, recipe)
    steps_per_epoch = math.ceil(len(train_set) / recipe.batch_size)
    total = recipe.epochs * steps_per_epoch
    eval_idx = None
    if test_set is not None:
        eval_idx = torch.randperm(len(test_set), generator=torch.Generator().manual_seed(seed))[:eval_subset]
    log = Path(log_path) if log_path else None
    history, step, start, first = [], 0, time.time(), 0
    run = None
    if state_path is not None:
        state_path = Path(state_path)
        run = _state_run(recipe, seed, train_set)
        if state_path.exists():
            first, step, history, elapsed = _resume(state_path, run, model, opt, gen, hook)
            start -= elapsed
    bar = tqdm(total=total, initial=step, disable=not progress, desc="train", unit="batch", leave=False)
    for epoch in range(first, recipe.epochs):
        loss, acc, step = _train_epoch(model, opt, train_set, recipe, gen, dev, hook, step, total, bar)
        row = {"epoch": epoch + 1, "train_loss": loss, "train_acc": acc, "lr": lr_at(step - 1, total, recipe),
               "elapsed_s": round(time.time() - start, 1)}
        if test_set is not None:
            last = epoch == recipe.epochs - 1
            sub = slice(None) if last else eval_idx
            pred = predict(model, test_set.images[sub], device=dev)
            row["test_acc" if last else "test_acc_subset"] = accuracy(pred, test_set.labels[sub])
        history.append(row)
        if state_path is not None:
            _checkpoint(state_path, run, model, opt, gen, hook, epoch + 1, step, history, time.time() - start,
                        len(train_set))
        if log is not None:
            with atomic_path(log) as tmp:
                tmp.write_text("".join(json.dumps(r) + "\n" for r in history))
        if progress:
            bar.write(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    bar.close()
    model.eval()
    return history


def _train_epoch(model: nn.Module, opt, train_set: ImageDataset, recipe: Recipe, gen: torch.Generator, dev,
                 hook: TrainHook | None, step: int, total: int, bar) -> tuple[float, float, int]:
    """One epoch of `train`'s loop over augmented batches: (mean loss, accuracy on the batches, the step after)."""
    model.train()
    loss_sum = torch.zeros((), device=dev)  # summed on the device: no sync per batch
    correct = torch.zeros((), dtype=torch.long, device=dev)
    seen = 0
    for idx in batches(len(train_set), recipe.batch_size, gen):
        x = train_set.images[idx].to(dev, non_blocking=True).float().div_(255)
        y = train_set.labels[idx].to(dev, non_blocking=True)
        x = augment(x, recipe.crop_padding, train_set.flip and recipe.flip, gen)
        extra = None
        if hook is not None:
            x, y, extra = hook.before_step(x, y)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, recipe)
        logits = model(x.contiguous(memory_format=MEMORY_FORMAT))
        loss = F.cross_entropy(logits, y, label_smoothing=recipe.label_smoothing)
        if extra is not None:
            loss = loss + extra
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if hook is not None:
            hook.after_step()
        step += 1
        loss_sum += loss.detach() * len(y)
        correct += (logits.argmax(1) == y).sum()
        seen += len(y)
        bar.update(1)
    return float(loss_sum) / seen, int(correct) / seen, step


def _state_run(recipe: Recipe, seed: int, train_set: ImageDataset) -> dict:
    """What names a training state's run: recipe, seed and data."""
    fields = {k: v for k, v in asdict(recipe).items() if not (k == "flip" and v)}  # flip on: named as without it
    return {"recipe": fields, "seed": int(seed), "data": data_fingerprint(train_set)}


def resumable_epochs(path, recipe: str | Recipe, seed: int, train_set: ImageDataset) -> int:
    """The epochs done in `path`'s training state when ``train`` with these arguments would resume it; 0
    when there is none, it is unreadable, or it is another run's."""
    try:
        state = load_state(path)
    except PBEError:  # none, or unreadable
        return 0
    return state["epoch"] if state.get("run") == json_safe(_state_run(get_recipe(recipe), seed, train_set)) else 0


def _checkpoint(path: Path, run: dict, model, opt, gen, hook, epoch: int, step: int, history: list,
                elapsed: float, samples: int) -> None:
    state = {"run": run, "epoch": epoch, "step": step, "history": history, "elapsed_s": elapsed, "samples": samples,
             "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state(gen)}
    if hook is not None and hasattr(hook, "state_dict"):
        state["hook"] = hook.state_dict()
    save_state(path, state)


def _resume(path: Path, run: dict, model, opt, gen, hook) -> tuple[int, int, list, float]:
    state = load_state(path)
    if state.get("run") != json_safe(run):
        raise PBEError(f"{path} holds the training state of another run (other recipe, seed or data); "
                       "delete it, or use another output folder")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    set_rng_state(gen, state["rng"])
    if hook is not None and hasattr(hook, "load_state_dict"):
        hook.load_state_dict(state["hook"])
    return state["epoch"], state["step"], state["history"], state["elapsed_s"]

