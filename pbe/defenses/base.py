"""What every defence shares: parameters checked at construction, one call that seeds, copies the
model, times and counts the work, measures before/after (only with an `Evaluation`), and returns a
`DefenseResult`. A subclass writes `_defend` only.

Given a `state_dir`, a call resumes where an interrupted call of the same defence on the same model and
data stopped: each long loop is a `Stage` that writes its state after every epoch.

Two settings (PBE.md): ``clean-extra`` defences get a small clean set (5% of the clean training set
by default, as in BackdoorBench); ``no-clean`` defences get the possibly poisoned training set.
"""
from __future__ import annotations

import copy
import hashlib
import inspect
import json
import math
import shutil
import time
import types
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from pbe.checkpoint import load_state, save_state
from pbe.checks import check_dataset, check_evaluation, check_model_and_data
from pbe.data import ImageDataset, augment
from pbe.metrics import der, evaluate, predict, ranking_quality
from pbe.train import batches, data_fingerprint, lr_factor, rng_state, set_rng_state, tensor_fingerprint
from pbe.utils import (Cost, PBEError, code_fingerprint, hardware_string, json_safe, resolve_device, seed_everything,
                       toolkit_version, use_all_cpus, write_json)

SETTINGS = ("clean-extra", "no-clean")


@dataclass
class Evaluation:
    """Ground truth the *caller* may pass to have the report measure the defence (never used by it)."""

    test_set: ImageDataset | None = None
    attack: object | None = None  # has apply(x), target, all_to_all
    poison_indices: torch.Tensor | None = None


def measure(model: nn.Module, ev: Evaluation | None) -> dict:
    """ACC / ASR / RA of `model` on the evaluation's test set ({} without one)."""
    return evaluate(model, ev.test_set, ev.attack, check=False) if ev is not None and ev.test_set is not None else {}


@dataclass
class DefenseResult:
    model: nn.Module  # purified (repair) or retrained without the flagged samples (filtering)
    report: dict
    suspected: torch.Tensor | None = None  # filtering defences: indices flagged as poisoned


@dataclass
class Context:
    """Per-call state handed to `_defend`: device, the seeded generator, the cost counter, and where
    its `Stage`s keep their state (None: nowhere, nothing resumes)."""

    device: torch.device
    gen: torch.Generator
    seed: int
    progress: bool
    cost: Cost = field(default_factory=Cost)
    evaluation: Evaluation | None = None  # for per-round reports only: a defence must not use it
    state_dir: Path | None = None
    start: float = field(default_factory=time.time)  # moved back by a resumed stage's elapsed time
    stages: int = 0  # the call's Stages so far (each one's number)
    resumed: list = field(default_factory=list)  # where each resumed stage took up
    replaying: bool = True  # every Stage so far ended as its state did: a later one may load its own


class Stage:
    """One resumable loop of a defence call (epochs over data, or batches of a long scoring pass).

    Without ``ctx.state_dir`` it only counts. With it, after every epoch ``done(epoch)`` writes the loop's
    state to ``stageN.safetensors`` (N: the loop's number in the call): the epochs done, `model`'s,
    `optimizer`'s and `scheduler`'s states, the filled `tensors`, the loop's `log`, every random
    generator, the cost counters, and the hardware and code version that wrote it (``ctx.resumed`` names
    them: a run resumed on another CPU or code is not bit-identical to one that was not). A rerun of the
    same call then takes each loop up where its state ends: a finished loop is skipped with its end state
    loaded (what follows it recomputes from there), an unfinished one resumes after its last epoch
    (``first``), and ``ctx.gen``, the costs and the wall time continue as in an uninterrupted run. A loop
    whose epochs depend on more than these (callbacks, stateful transforms) passes ``resumable=False``: it
    runs whole again.

    Example::

        >>> stage = Stage(ctx, epochs, model=model, optimizer=opt)
        >>> for epoch in range(stage.first, epochs):
        ...     ...  # one epoch; stage.log.append(...) for what the report says per epoch
        ...     stage.done(epoch + 1)
    """

    def __init__(self, ctx: Context, epochs: int, *, data: ImageDataset | torch.Tensor | None = None,
                 model: nn.Module | None = None, optimizer=None, scheduler=None,
                 tensors: dict[str, torch.Tensor] | None = None, resumable: bool = True):
        ctx.stages += 1
        self.ctx, self.epochs, self.first, self.log = ctx, epochs, 0, []
        self.parts = {k: v for k, v in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler))
                      if v is not None}
        self.tensors = tensors or {}
        self.path = (ctx.state_dir / STAGE_FILE.format(ctx.stages)
                     if ctx.state_dir is not None and resumable else None)
        if self.path is None:
            ctx.replaying = False  # this loop runs whole again: what follows may differ from the states
            return
        # which loop a state belongs to: its number, length and data (a loop given other data starts over)
        self.loop = {"stage": ctx.stages, "epochs": epochs, "data": None if data is None else (
            data_fingerprint(data) if isinstance(data, ImageDataset) else tensor_fingerprint(data))}
        self.origin = {"hardware": hardware_string(), "toolkit_version": toolkit_version()}  # who writes
        state = self._read() if ctx.replaying else None
        if state is None:
            ctx.replaying = False  # this loop starts over, so every later one does too
        else:
            self._load(state)

    def _read(self) -> dict | None:
        """This loop's state, or None (none, unreadable, or another loop's)."""
        if not self.path.exists():
            return None
        try:
            state = load_state(self.path)
        except PBEError:
            return None
        return state if state.get("loop") == json_safe(self.loop) else None

    def _load(self, state: dict) -> None:
        for key, part in self.parts.items():
            part.load_state_dict(state[key])
        for key, tensor in self.tensors.items():
            tensor.copy_(state["tensors"][key])
        set_rng_state(self.ctx.gen, state["rng"])
        self.ctx.cost.forward_backward, self.ctx.cost.forward = state["cost"]
        self.ctx.start = time.time() - state["elapsed_s"]
        self.first, self.log = state["epoch"], state["log"]
        self.ctx.resumed.append({"stage": self.ctx.stages, "epochs_done": self.first, "epochs": self.epochs,
                                 "written_on": state.get("hardware"), "toolkit_version": state.get("toolkit_version")})

    def done(self, epoch: int) -> None:
        """Record that `epoch` epochs are done (a no-op without a state folder)."""
        if self.path is None:
            return
        save_state(self.path, {"loop": self.loop, "epoch": epoch, "log": self.log, "rng": rng_state(self.ctx.gen),
                               "cost": [self.ctx.cost.forward_backward, self.ctx.cost.forward],
                               "elapsed_s": time.time() - self.ctx.start, "tensors": self.tensors,
                               **self.origin,
                               **{key: part.state_dict() for key, part in self.parts.items()}})


def model_fingerprint(model: nn.Module) -> str:
    """sha256 of a model's parameter and buffer names and values."""
    state = model.state_dict()
    return tensor_fingerprint(*state.values()) + hashlib.sha256(" ".join(state).encode()).hexdigest()[:16]


def claim_state_dir(state_dir, identity: dict) -> Path:
    """Make `state_dir` this call's: create it and write the call's identity (defence, parameters, seed,
    model, data and code). States there of another call (or unreadable) are discarded: this call starts
    over and writes its own."""
    folder = Path(state_dir)
    path = folder / STATE_IDENTITY
    identity = json_safe(identity)
    try:
        held = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        held = None
    if held != identity:
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        write_json(path, identity)
    return folder


STATE_IDENTITY = "call.json"  # in a state_dir: the call its stages belong to
STAGE_FILE = "stage{}.safetensors"  # in a state_dir: the state of the call's N-th Stage
RETRAIN_STATE = "retrain.safetensors"  # in a state_dir: a filtering defence's retrain (pbe.train's state)


@dataclass
class StagedProgress:
    """The work an interrupted call's states account for: epoch-equivalents and wall seconds, and per
    loop (``stage`` N, or ``"retrain"``) its epochs done of its epochs."""

    epoch_equivalents: float
    elapsed_s: float
    loops: list[dict]


def staged_progress(state_dir: str | Path, **expected) -> StagedProgress | None:
    """What a rerun would take up of the call staged in `state_dir` (``Defense.__call__``'s): its Stages in
    order (each state holds the call's counts so far; nothing after an unfinished loop ran), then a
    filtering defence's retrain. None without a state, or when the states were written by other code or
    by a call whose identity differs from `expected` (e.g. ``defense=``, ``params=``, ``seed=``): a rerun
    would start over. For estimates: a rerun also checks each loop's data (``Stage``)."""
    folder = Path(state_dir)
    try:
        identity = json.loads((folder / STATE_IDENTITY).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if identity.get("code") != code_fingerprint() or not identity.get("train_size") or \
            any(identity.get(k) != json_safe(v) for k, v in expected.items()):
        return None
    cost, elapsed, loops = Cost(), 0.0, []
    while (folder / STAGE_FILE.format(len(loops) + 1)).exists():
        try:
            state = load_state(folder / STAGE_FILE.format(len(loops) + 1))
        except PBEError:
            break
        cost.forward_backward, cost.forward = state["cost"]
        elapsed = state["elapsed_s"]
        loops.append({"stage": len(loops) + 1, "epochs_done": state["epoch"], "epochs": state["loop"]["epochs"]})
        if state["epoch"] < state["loop"]["epochs"]:
            break
    finished = all(loop["epochs_done"] == loop["epochs"] for loop in loops)
    if finished and (folder / RETRAIN_STATE).exists():
        try:
            state = load_state(folder / RETRAIN_STATE)
        except PBEError:
            state = None
        if state is not None and "samples" in state:
            cost.forward_backward += state["epoch"] * state["samples"]
            elapsed += state["elapsed_s"]
            loops.append({"stage": "retrain", "epochs_done": state["epoch"],
                          "epochs": state["run"]["recipe"]["epochs"]})
    if not loops:
        return None
    return StagedProgress(cost.epoch_equivalents(identity["train_size"]), elapsed, loops)


def _type_ok(value, hint) -> bool:
    """Whether `value` fits a simple annotation (int, float, str, bool, tuple, list, a class, their
    unions with None); an int is a float, a bool is not an int, a list stands for a tuple (JSON)."""
    if hint is typing.Any:
        return True
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    hint = typing.get_origin(hint) or hint
    if not isinstance(hint, type):
        return True
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is tuple:
        return isinstance(value, (tuple, list))
    return isinstance(value, hint)


def _hint_name(hint) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


# ranges every defence's parameters of these names must respect (a subclass's _check adds its own)
COUNTS = {"epochs", "adv_epochs", "teacher_epochs", "retrain_epochs", "batch_size", "unlearning_batch_size",
          "iterations", "rounds", "k", "n", "nb_dims", "steps"}
MAX_COUNT = 10 ** 6
RATES = {"lr", "delta_lr", "inner_step"}
MAX_RATE = 100.0


def check_ranges(name: str, params: dict) -> None:
    """Refuse degenerate values of the parameters every defence names the same way, naming the range."""
    for key, v in params.items():
        if v is None or isinstance(v, bool):
            continue
        if key in COUNTS and not (isinstance(v, int) and 1 <= v <= MAX_COUNT):
            raise PBEError(f"{name}: {key} must be an integer in [1, {MAX_COUNT}], got {v!r}")
        if key in RATES and not (isinstance(v, (int, float)) and 0 < v <= MAX_RATE):
            raise PBEError(f"{name}: {key} must be in (0, {MAX_RATE:g}], got {v!r}")
        if key == "momentum" and not 0 <= v < 1:
            raise PBEError(f"{name}: momentum must be in [0, 1), got {v!r}")
        if key in ("weight_decay", "crop_padding") and not (0 <= v < MAX_RATE):
            raise PBEError(f"{name}: {key} must be >= 0, got {v!r}")


class Defense(ABC):
    """Base class. A subclass sets `name` and `setting`, takes its hyperparameters (its paper's or
    BackdoorBench's defaults) as explicit keyword arguments of ``__init__`` that it passes on to
    ``super().__init__``, and implements `_defend(model, data, ctx) -> (model, report, suspected)`.
    `defaults` is read from that signature; every value is type-checked against its annotation."""

    name: ClassVar[str]
    setting: ClassVar[str]
    defaults: ClassVar[dict] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            params = list(inspect.signature(cls.__init__).parameters.values())[1:]
            cls.defaults = {p.name: p.default for p in params}

    def __init__(self, **params):
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise PBEError(f"{self.name}: unknown parameter(s) {sorted(unknown)}; "
                           f"known: {', '.join(sorted(self.defaults))}")
        hints = typing.get_type_hints(type(self).__init__) if "__init__" in type(self).__dict__ else {}
        for key, value in params.items():
            if key in hints and not _type_ok(value, hints[key]):
                raise PBEError(f"{self.name}: parameter {key} must be {_hint_name(hints[key])}, got {value!r}")
        self.params = {**self.defaults, **params}
        check_ranges(self.name, self.params)
        self._check()

    def _check(self) -> None:
        """Validate `self.params`; raise PBEError naming the parameter."""

    def resolved(self) -> dict:
        """Every setting the defence will run with, names resolved (a run folder made with other
        settings, e.g. an older default schedule of the same name, is another run)."""
        return self.params

    def __repr__(self) -> str:
        changed = ", ".join(f"{k}={v!r}" for k, v in self.params.items() if v != self.defaults[k])
        return f"{type(self).__name__}({changed})"

    def __call__(self, model: nn.Module, data: ImageDataset, *, seed: int = 0, device="auto",
                 progress: bool = True, evaluation: Evaluation | None = None,
                 train_size: int | None = None, state_dir: str | Path | None = None) -> DefenseResult:
        """Defend `model` with `data` (the clean extra set or the poisoned training set, by setting).
        `train_size` (the full training set's size) is the unit of the reported epoch-equivalents.
        `state_dir`: a folder where the long loops keep their state, so that a call interrupted there
        resumes when called again the same way, by the same code (see `Stage`; the report's ``resumed``
        says where); a state there of another call is discarded. The model, the data and the evaluation
        are checked first (``pbe.checks``): a mistake is a PBEError naming the fix, before any work."""
        what = "the clean extra set" if self.setting == "clean-extra" else "the training set"
        check_dataset(data, where=self.name, what=what)
        check_evaluation(evaluation, data, where=self.name)  # every refusal before the model's warnings
        check_model_and_data(model, data, where=self.name, what=what)  # before the seeding: it draws no number
        dev = resolve_device(device)
        if dev.type == "cpu":
            use_all_cpus()
        ctx = Context(dev, seed_everything(seed), seed, progress, evaluation=evaluation)
        if state_dir is not None:
            ctx.state_dir = claim_state_dir(state_dir, {
                "defense": self.name, "params": self.params, "seed": seed, "model": model_fingerprint(model),
                "data": data_fingerprint(data), "train_size": train_size or len(data), "code": code_fingerprint()})
        model = copy.deepcopy(model).to(dev).eval()
        before = measure(model, evaluation)
        model, report, suspected = self._defend(model, data, ctx)
        model.eval()
        n = train_size or len(data)
        report = {"defense": self.name, "setting": self.setting, "params": self.params, "seed": seed,
                  "data_size": len(data), "train_size": n, "before": before, "after": measure(model, evaluation),
                  **report, "epoch_equivalents": ctx.cost.epoch_equivalents(n),
                  "passes": {"forward_backward": ctx.cost.forward_backward, "forward": ctx.cost.forward},
                  "wall_s": round(time.time() - ctx.start, 1), **({"resumed": ctx.resumed} if ctx.resumed else {})}
        b, a = report["before"], report["after"]
        if b.get("asr") is not None:
            report["der"] = der(b["acc"], b["asr"], a["acc"], a["asr"])
        if suspected is not None:
            report["suspected_indices"] = suspected.tolist()
            if evaluation is not None and evaluation.poison_indices is not None and "scores" in report:
                flagged = torch.zeros(len(data), dtype=torch.bool)
                flagged[suspected] = True
                report["detection"] = ranking_quality(torch.as_tensor(report["scores"]), flagged,
                                                      evaluation.poison_indices)
        return DefenseResult(model, report, suspected)

    @abstractmethod
    def _defend(self, model: nn.Module, data: ImageDataset, ctx: Context) -> tuple[nn.Module, dict,
                                                                                 torch.Tensor | None]:
        """Return the defended model, report entries, and flagged indices (filtering) or None."""


# ---------------------------------------------------------------- shared building blocks
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
BatchTransform = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, y) -> x, e.g. adversarial examples


def cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def sgd_finetune(model: nn.Module, data: ImageDataset, ctx: Context, *, epochs: int, lr: float,
                 batch_size: int = 256, momentum: float = 0.9, weight_decay: float = 5e-4,
                 crop_padding: int = 4, loss_fn: LossFn = cross_entropy, after_step: Callable[[], None] | None = None,
                 lr_schedule: str = "cosine", transform: BatchTransform | None = None,
                 on_epoch: Callable[[int], None] | None = None, desc: str = "fine-tune",
                 nesterov: bool = False) -> None:
    """The fine-tuning loop of every repair defence: SGD on shuffled, augmented batches, with per-epoch
    cosine annealing (BackdoorBench's loop) or a constant lr (the PBE authors'). `transform(x, y)`
    changes each augmented batch before the step (adversarial examples, with the samples' own labels)
    and counts its own cost; `on_epoch(epoch)` runs before each epoch. The loop is a `Stage`, resumable
    when it has neither `on_epoch`, `transform` nor `after_step` (whose state it could not restore)."""
    if lr_schedule not in ("cosine", "constant"):
        raise PBEError(f"lr_schedule must be 'cosine' or 'constant', got {lr_schedule!r}")
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: lr_factor(e, epochs, lr_schedule))
    stage = Stage(ctx, epochs, data=data, model=model, optimizer=opt, scheduler=scheduler,
                  resumable=on_epoch is None and transform is None and after_step is None)
    per_epoch = math.ceil(len(data) / batch_size)
    bar = tqdm(total=epochs * per_epoch, initial=stage.first * per_epoch, desc=desc, disable=not ctx.progress,
               leave=False, unit="batch")
    for epoch in range(stage.first, epochs):
        if on_epoch is not None:
            on_epoch(epoch)
        model.train()
        for idx in batches(len(data), batch_size, ctx.gen):
            x = augment(data.images[idx].to(ctx.device).float().div_(255), crop_padding, data.flip, ctx.gen)
            y = data.labels[idx].to(ctx.device)
            if transform is not None:
                x = transform(x, y)
                model.train()
            loss = loss_fn(model, x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if after_step is not None:
                after_step()
            ctx.cost.forward_backward += len(y)
            bar.update(1)
        scheduler.step()
        stage.done(epoch + 1)
    bar.close()
    model.eval()


# A model trained with the fine-tuning's random crop (and flip) keeps its training-set accuracy under them: the dev
# zoo's augmented models lose at most 4 points. One trained without them memorised the plain images and loses far
# more (the dev LeNets: 43-51 points; experiments/results/lenet_overerasure.md). Fine-tuning such a model on
# augmented images moves it to inputs it never fitted and costs clean accuracy on every label, so past this loss
# the fine-tuning takes smaller crops, or the plain images: the input distribution the model was trained on.
AUGMENTATION_LOSS_LIMIT = 0.15
AUGMENTATION_PROBE = 512  # training samples the check classifies augmented


def fitting_augmentation(model: nn.Module, data: ImageDataset, crop_padding: int, ctx: Context,
                         plain_logits: torch.Tensor | None = None) -> dict:
    """The strongest augmentation up to the fine-tuning's that `model` keeps its accuracy on `data` under. On
    AUGMENTATION_PROBE samples (drawn with their own generator, so that the run's draws do not change): the accuracy
    plain (from `plain_logits`, the model's logits on all of `data`, where given) and under random crops of
    `crop_padding` pixels (with flips where `data` allows them), then of half as many, down to 1 (flips alone where
    `crop_padding` is 0); the first whose accuracy loss is at most AUGMENTATION_LOSS_LIMIT is used, else none.
    Returns ``{"plain", "augmented" (padding tried -> accuracy), "crop_padding", "flip"}``: what to fine-tune with."""
    if crop_padding <= 0 and not data.flip:
        return {"plain": None, "augmented": {}, "crop_padding": 0, "flip": False}
    gen = torch.Generator().manual_seed(ctx.seed)
    idx = torch.randperm(len(data), generator=gen)[:AUGMENTATION_PROBE]
    x, y = data.images[idx].float().div_(255), data.labels[idx]
    plain = plain_logits[idx].argmax(1) if plain_logits is not None else predict(model, x)
    ctx.cost.forward += 0 if plain_logits is not None else len(idx)
    acc_plain, tried, padding, chosen = float((plain == y).float().mean()), {}, crop_padding, None
    while chosen is None:
        tried[padding] = float((predict(model, augment(x, padding, data.flip, gen)) == y).float().mean())
        ctx.cost.forward += len(idx)
        if acc_plain - tried[padding] <= AUGMENTATION_LOSS_LIMIT:
            chosen = (padding, data.flip)
        elif padding <= 1:
            chosen = (0, False)
        padding //= 2
    return {"plain": round(acc_plain, 4), "augmented": {p: round(a, 4) for p, a in tried.items()},
            "crop_padding": chosen[0], "flip": chosen[1]}


def fresh_copy(model: nn.Module, seed: int) -> nn.Module:
    """Same architecture, re-initialised (seeded) weights: what filtering defences retrain."""
    model = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.reset_running_stats()
    return model
