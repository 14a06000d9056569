"""The attack interface: a trigger, a label mapping, poisoning, and a state saved with the model.

An attack is an ``nn.Module`` so that its trigger tensors (patch, key image, warp field,
generator networks) travel with ``.to(device)`` and are saved/loaded exactly with safetensors.
Shape-dependent state is built by ``prepare(shape)`` from the attack's seed, so the same seed gives
the same trigger for any image size and channel count.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pbe import rundir
from pbe.data import ImageDataset
from pbe.metrics import target_labels
from pbe.utils import PBEError, atomic_path, write_json


@dataclass
class PoisonedDataset(ImageDataset):
    """A training set with some samples triggered and relabelled; records exactly which."""

    poison_indices: torch.Tensor | None = None  # int64, sorted
    true_labels: torch.Tensor | None = None  # labels before poisoning
    extra_indices: torch.Tensor | None = None  # e.g. WaNet noise-mode samples (true labels kept)

    @property
    def poison_mask(self) -> torch.Tensor:
        mask = torch.zeros(len(self), dtype=torch.bool)
        mask[self.poison_indices] = True
        return mask


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(0, 1).mul(255).round().to(torch.uint8)


class BackdoorAttack(nn.Module, ABC):
    """Base class. Subclasses implement ``_build(shape, generator)`` and ``_trigger(x, train)``."""

    name = "base"
    clean_label = False  # poison only target-class samples and keep their labels

    def __init__(self, target: int = 0, all_to_all: bool = False, seed: int = 0):
        super().__init__()
        if int(target) < 0:
            raise PBEError(f"target must be a class index >= 0, got {target}")
        self.target, self.all_to_all, self.seed = int(target), bool(all_to_all), int(seed)
        self.shape: tuple[int, int, int] | None = None
        self.loaded = False  # a saved trigger (load_state): never rebuilt for another image shape

    # ---- parameters and state
    def params(self) -> dict:
        """Constructor arguments, enough with the tensors of ``state_dict`` to rebuild the attack."""
        return {"target": self.target, "all_to_all": self.all_to_all, "seed": self.seed}

    def prepare(self, shape) -> "BackdoorAttack":
        """Build the trigger for images of shape (C, H, W); a no-op when already built for it."""
        shape = tuple(int(s) for s in shape)
        if len(shape) != 3 or shape[0] not in (1, 3):
            raise PBEError(f"images must be (C, H, W) with 1 or 3 channels, got {shape}")
        if self.shape != shape:
            if self.loaded:
                raise PBEError(f"this {self.name} trigger was saved for images of shape {list(self.shape)}, not "
                               f"{list(shape)}; use the dataset the attack was planted on")
            self.shape = shape
            self._build(shape, torch.Generator().manual_seed(self.seed))
        return self

    def _build(self, shape, generator: torch.Generator) -> None:
        """Create shape-dependent trigger tensors (register them as buffers or submodules)."""

    # ---- the trigger
    def apply(self, x: torch.Tensor, train: bool = False) -> torch.Tensor:
        """Triggered copy of a float batch (N, C, H, W) in [0, 1]; deterministic."""
        if x.dtype == torch.uint8:
            raise PBEError("apply() takes float images in [0, 1]; divide uint8 images by 255 first")
        if x.dim() != 4:
            raise PBEError(f"apply() takes a batch (N, C, H, W), got shape {tuple(x.shape)}")
        self.prepare(x.shape[1:])
        self.to(x.device)
        with torch.no_grad():
            return self._trigger(x, train).clamp(0, 1)

    @abstractmethod
    def _trigger(self, x: torch.Tensor, train: bool) -> torch.Tensor:
        """The triggered batch (before clipping); `train` selects training-time strength."""

    def target_of(self, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        return target_labels(labels, self.target, self.all_to_all, num_classes)

    # ---- poisoning
    def candidates(self, labels: torch.Tensor, include_target: bool = False) -> torch.Tensor:
        """Indices that may be poisoned: target-class ones for clean-label; for all-to-one the
        non-target ones (a triggered target-class image teaches nothing) unless `include_target`."""
        if self.clean_label:
            return torch.nonzero(labels == self.target).flatten()
        if self.all_to_all or include_target:
            return torch.arange(len(labels))
        return torch.nonzero(labels != self.target).flatten()

    def poison(self, dataset: ImageDataset, rate: float, seed: int | None = None,
               include_target: bool = False) -> PoisonedDataset:
        """Trigger and relabel ``round(rate * N)`` samples drawn (seeded) from ``candidates``."""
        if not 0 <= rate <= 1:
            raise PBEError(f"poison rate must be in [0, 1], got {rate}")
        if self.target >= dataset.num_classes:
            raise PBEError(f"target {self.target} is not a label of {dataset.name} ({dataset.num_classes} classes: "
                           f"0 to {dataset.num_classes - 1})")
        n_poison = round(rate * len(dataset))
        pool = self.candidates(dataset.labels, include_target)
        if n_poison > len(pool):
            raise PBEError(f"rate {rate} asks for {n_poison} poisoned samples but only {len(pool)} are eligible "
                           f"({'target-class' if self.clean_label else 'non-target'} samples); lower --rate")
        gen = torch.Generator().manual_seed(self.seed if seed is None else seed)
        chosen = pool[torch.randperm(len(pool), generator=gen)[:n_poison]].sort().values
        images, labels = dataset.images.clone(), dataset.labels.clone()
        self.prepare(dataset.image_shape)
        images[chosen] = self._poison_images(images[chosen], dataset.labels[chosen], gen)
        if not self.clean_label:
            labels[chosen] = self.target_of(dataset.labels[chosen], dataset.num_classes)
        extra = self._extra_poison(images, labels, chosen, gen)
        return PoisonedDataset(images, labels, dataset.classes, f"{dataset.name}+{self.name}", dataset.flip,
                               dataset.source, poison_indices=chosen, true_labels=dataset.labels.clone(),
                               extra_indices=extra)

    def _batched_uint8(self, images: torch.Tensor, train: bool, batch_size: int = 1024) -> torch.Tensor:
        out = [to_uint8(self.apply(images[s:s + batch_size].float() / 255, train))
               for s in range(0, len(images), batch_size)]
        return torch.cat(out) if out else images

    def _poison_images(self, images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The poisoned training copies (uint8) of the chosen samples; hook for attacks whose training
        poison differs per sample beyond the trigger (LC's adversarial step, the adaptive attacks' partial
        triggers). `labels` are their true labels."""
        return self._batched_uint8(images, train=True)

    def _extra_poison(self, images, labels, chosen, generator) -> torch.Tensor | None:
        """Hook for attacks that also alter non-poisoned samples in place (WaNet's noise mode)."""
        return None

    # ---- training (static attacks: train on the poisoned set)
    def plant(self, model: nn.Module, train_set: ImageDataset, test_set: ImageDataset | None = None,
              rate: float = 0.1, recipe="cpu", seed: int = 0, **train_kw) -> tuple[PoisonedDataset, list[dict]]:
        """Poison `train_set`, train `model` on it in place; returns the poisoned set and history."""
        from pbe.train import train
        poisoned = self.poison(train_set, rate, seed)
        history = train(model, poisoned, test_set, recipe, seed=seed, **train_kw)
        return poisoned, history

    # ---- persistence
    def save(self, path: str | Path) -> None:
        """Write ``path.safetensors`` (trigger tensors) and ``path.json`` (name, params, shape)."""
        path = Path(path).with_suffix("")
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        with atomic_path(path.with_suffix(".safetensors")) as tmp:
            save_file(state, str(tmp))
        write_json(path.with_suffix(".json"), {"attack": self.name, "params": self.params(),
                                               "shape": list(self.shape) if self.shape else None})

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params().items())


def clean_surrogate(model: nn.Module, train_set: ImageDataset, recipe, epochs: int, seed: int = 0,
                    device="auto", progress: bool = False) -> nn.Module:
    """The attacker's clean model: a copy of `model` trained `epochs` epochs on the clean `train_set`
    with `recipe` (TrojanNN optimises its trigger on it, LC perturbs with it). Returned in eval mode with
    its parameters frozen."""
    import copy

    from pbe.train import train
    surrogate = copy.deepcopy(model)
    train(surrogate, train_set, None, recipe, seed=seed, device=device, progress=progress, epochs=int(epochs))
    return surrogate.eval().requires_grad_(False)


def load_state(path: str | Path, registry: dict) -> BackdoorAttack:
    path = Path(path)
    stem = path.with_suffix("") if path.suffix in (".json", ".safetensors") else path
    if stem.is_dir():
        stem = stem / "attack"
    rundir.verify(stem.parent)  # a `pbe attack` folder: refuse one that mixes two runs
    side, weights = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
    for f in (side, weights):
        if not f.is_file():
            raise PBEError(f"attack state {f} not found (`pbe attack` writes attack.json and attack.safetensors "
                           "into its --out); point to that folder")
    try:
        info = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PBEError(f"attack state {side} is not valid JSON ({err}); rerun `pbe attack`") from err
    if not isinstance(info, dict) or info.get("attack") not in registry or not isinstance(info.get("params"), dict):
        raise PBEError(f"{side}: unknown attack {info.get('attack') if isinstance(info, dict) else info!r}; "
                       f"known: {', '.join(sorted(registry))}")
    attack = registry[info["attack"]](**info["params"])
    if info.get("shape"):
        attack.prepare(info["shape"])
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as err:
        raise PBEError(f"{weights} is not a readable safetensors file: {err}") from err
    missing, unexpected = attack.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise PBEError(f"{weights} does not fit {info['attack']}: missing {missing}, unexpected {unexpected}")
    attack.loaded = attack.shape is not None
    return attack
