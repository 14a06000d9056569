"""Checks at the API boundary: what a user hands ``pbe.detect``, ``pbe.erase``, ``pbe.aft``, every
``pbe.defenses`` defence and ``pbe.metrics.evaluate`` is checked before any work starts, and refused with
a ``PBEError`` that names the problem and the fix.

``check_model_and_data`` runs the model on a fixed sample of the data (``SAMPLE_IMAGES`` evenly spaced
images, as [0, 1] floats, in eval mode, without gradients): a model that does not take the data's
images, whose output is not one logit per class, or whose outputs are probabilities is refused; a model
near chance on the sample, or clearly more accurate on the same images standardised per channel (it
normalises outside), gets a ``PBEWarning`` naming the [0, 1] input convention and
``pbe.models.Normalize``. The checks draw no random number, leave every random generator and every
module's train/eval mode as they were, and change nothing a method computes afterwards; their cost (at
most 2 x ``SAMPLE_IMAGES`` forward passes) is in no report's epoch-equivalents.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from pbe.data import ImageDataset
from pbe.utils import PBEError, PBEWarning

PROBE_IMAGES = 8  # the first batch, whose failure is reported as the data's shape against the model
SAMPLE_IMAGES = 256  # images the outputs and the accuracy are checked on
BATCH = 128
CHANCE_FACTOR = 1.5  # accuracy below CHANCE_FACTOR / num_classes is "near chance"
PROBABILITY_TOLERANCE = 1e-3  # rows non-negative and summing to 1 within this: probabilities
STANDARDISED_MARGIN = 0.15  # this much more accurate on standardised images: the model normalises outside


def check_dataset(data, *, where: str, what: str = "data") -> None:
    """Refuse anything but a non-empty ``pbe.data.ImageDataset``, saying how to build one from tensors.

    Arguments:
        data: what the caller was given.
        where: the function or defence named at the start of the message, e.g. ``"metrics.evaluate"``.
        what: what the data is to the caller, e.g. ``"the training set"``.
    """
    if isinstance(data, ImageDataset):
        if len(data) == 0:
            raise PBEError(f"{where}: {what} holds no images; pass a non-empty ImageDataset")
        return
    kind = type(data).__qualname__ if type(data).__module__ == "builtins" else \
        f"{type(data).__module__}.{type(data).__qualname__}"
    if isinstance(data, torch.utils.data.TensorDataset):
        example = "ImageDataset.from_tensors(*dataset.tensors)"
    elif isinstance(data, (tuple, list)) and len(data) == 2:
        example = "ImageDataset.from_tensors(*data)"
    else:
        example = "ImageDataset.from_tensors(images, labels)"
    raise PBEError(f"{where}: {what} must be a pbe.data.ImageDataset (images, labels and class names), got a "
                   f"{kind}; build one from tensors: pbe.data.{example} (images (N, C, H, W) uint8, or float in "
                   "[0, 1]; labels integer class ids; classes= names or their number)")


def check_model(model, *, where: str) -> None:
    """Refuse anything but an ``nn.Module`` with parameters."""
    if not isinstance(model, nn.Module):
        raise PBEError(f"{where}: the model must be a torch.nn.Module, got a {type(model).__qualname__}; a "
                       "checkpoint file is loaded with pbe.load(path)")
    if next(model.parameters(), None) is None:
        raise PBEError(f"{where}: the model has no parameters (nothing to run on a device or to repair); pass the "
                       "trained nn.Module")


def check_attack(attack, *, where: str) -> None:
    """Refuse an attack given by name, or an object without ``apply(x)``, ``target`` and ``all_to_all``
    (None passes: no attack)."""
    if attack is None:
        return
    if isinstance(attack, str):
        raise PBEError(f"{where}: attack={attack!r} is a name, but ASR needs the trigger the model was poisoned "
                       f"with (its target, size, seed...): pass attacks.create({attack!r}, target=..., <the "
                       "parameters it was planted with>) or attacks.load(<a `pbe attack --out` folder>)")
    missing = [a for a in ("apply", "target", "all_to_all") if not hasattr(attack, a)]
    if missing:
        raise PBEError(f"{where}: attack must have apply(x), target and all_to_all (attacks.create(...) or "
                       f"attacks.load(path) make one); a {type(attack).__qualname__} has no {', '.join(missing)}")


def check_evaluation(evaluation, data: ImageDataset, *, where: str) -> None:
    """Refuse an ``Evaluation`` whose test set is no ImageDataset or does not match `data` (image shape,
    classes), or whose attack is a name (None passes)."""
    if evaluation is None:
        return
    if not all(hasattr(evaluation, a) for a in ("test_set", "attack", "poison_indices")):
        raise PBEError(f"{where}: evaluation must be a pbe.Evaluation(test_set, attack, poison_indices), got a "
                       f"{type(evaluation).__qualname__}")
    check_attack(evaluation.attack, where=f"{where}: evaluation")
    test = evaluation.test_set
    if test is None:
        return
    check_dataset(test, where=where, what="evaluation.test_set")
    if test.image_shape != data.image_shape or test.num_classes != data.num_classes:
        raise PBEError(f"{where}: evaluation.test_set has images of shape {list(test.image_shape)} and "
                       f"{test.num_classes} classes, the data {list(data.image_shape)} and {data.num_classes}; "
                       "pass the test split of the same dataset")


def sample_indices(n: int, size: int = SAMPLE_IMAGES) -> torch.Tensor:
    """`size` indices spread evenly over ``range(n)`` (all of them when n <= size): every part of a
    dataset stored class by class is in the sample, and no random number is drawn."""
    if n <= size:
        return torch.arange(n)
    return torch.linspace(0, n - 1, size, dtype=torch.float64).round().long()


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def check_model_and_data(model, data, *, where: str, what: str = "data") -> int:
    """Every check of a (model, data) pair at the API boundary; returns the images passed forward (for a
    caller that counts its cost). Raises ``PBEError`` naming the problem and the fix; warns
    (``PBEWarning``) when the model is near chance on the data or normalises its inputs outside.

    Arguments:
        model: the user's model (any device; its train/eval modes are restored).
        data: a ``pbe.data.ImageDataset``.
        where: the function or defence named at the start of each message, e.g. ``"detect"``.
        what: what the data is to the caller, e.g. ``"the clean extra set"``.
    """
    check_dataset(data, where=where, what=what)
    check_model(model, where=where)
    built, c = (getattr(model, "pbe_spec", None) or {}).get("in_channels"), data.image_shape[0]
    if built is not None and built != c:  # its Normalize would broadcast grey images to 3 channels unnoticed
        raise PBEError(f"{where}: the model was built for {built} input channel{'s' if built > 1 else ''} "
                       f"(pbe.models.create(..., in_channels={built})), but the images of {what} ({data.name}) have "
                       f"{c}; give it the data it was built for, or build it with in_channels={c}")
    dev = _device(model)
    idx = sample_indices(len(data))
    x = data.images[idx].to(dev).float().div_(255)
    y = data.labels[idx].to(dev)
    k = data.num_classes
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []), torch.no_grad():
            logits = _outputs(model, x, data, where=where, what=what)
            passes = len(x)
            acc = float((logits.argmax(1) == y).float().mean())
            acc_std = None
            if acc + STANDARDISED_MARGIN <= 1:  # else no accuracy on standardised images could stand out
                mean = x.mean((0, 2, 3), keepdim=True)
                std = x.std((0, 2, 3), keepdim=True).clamp_min(1e-3)
                acc_std = float((_forward(model, (x - mean) / std).argmax(1) == y).float().mean())
                passes += len(x)
    finally:
        for m, training in modes:
            m.training = training
    near_chance = acc < CHANCE_FACTOR / k
    outside = acc_std is not None and acc_std >= acc + STANDARDISED_MARGIN
    if near_chance or outside:
        said = f"the model is right on {acc:.0%} of {len(x)} images of {what} ({data.name})"
        if near_chance:
            said += f", near chance ({1 / k:.0%})"
        if outside:
            stats = (f"mean={[round(float(v), 3) for v in mean.flatten()]}, "
                     f"std={[round(float(v), 3) for v in std.flatten()]}")
            said += (f", and on {acc_std:.0%} of them standardised per channel: it most likely normalises its "
                     "inputs outside, but the toolkit gives every model [0, 1] images. Wrap it: "
                     "nn.Sequential(pbe.models.Normalize(mean, std), model) with the statistics it was trained "
                     f"with (these images' are {stats})")
        else:
            said += (". The toolkit gives a model [0, 1] images: if it was trained on normalised inputs, wrap it "
                     "with the normalisation it was trained with: nn.Sequential(pbe.models.Normalize(mean, std), "
                     "model); else check that the data (and its label order) is what the model was trained on")
        warnings.warn(f"{where}: {said}", PBEWarning, stacklevel=3)
    return passes


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(x[s:s + BATCH]) for s in range(0, len(x), BATCH)])


def _outputs(model: nn.Module, x: torch.Tensor, data: ImageDataset, *, where: str, what: str) -> torch.Tensor:
    """The model's outputs on `x`: the probe batch first, whose failure is reported against the data's
    image shape; the outputs' shape, width, finiteness and whether they are probabilities are checked."""
    k = data.num_classes
    try:
        first = model(x[:PROBE_IMAGES])
    except Exception as err:  # noqa: BLE001 - whatever the model raises, the cause is the same mismatch
        c, h, w = data.image_shape
        said = (str(err).strip().splitlines() or [""])[0][:300]
        raise PBEError(f"{where}: the model does not take the images of {what} ({data.name}: shape (C, H, W) = "
                       f"({c}, {h}, {w}), {c} channel{'s' if c > 1 else ''} of {h}x{w} pixels, floats in [0, 1]); "
                       f"it raised {type(err).__name__}: {said}. Give it the data it was built for, or build it "
                       f"for {c} input channel{'s' if c > 1 else ''} and {h}x{w} images") from err
    if not isinstance(first, torch.Tensor):
        raise PBEError(f"{where}: the model returned a {type(first).__qualname__}, not a tensor of logits; wrap it "
                       "so that forward returns one (N, num_classes) tensor of logits")
    if first.dim() != 2 or first.shape[0] != min(PROBE_IMAGES, len(x)):
        raise PBEError(f"{where}: the model's output has shape {tuple(first.shape)} for a batch of "
                       f"{min(PROBE_IMAGES, len(x))} images; it must be one row of {k} logits per image")
    if first.shape[1] != k:
        raise PBEError(f"{where}: the model outputs {first.shape[1]} scores per image but {what} ({data.name}) has "
                       f"{k} classes; use a model with {k} outputs (pbe.models.create(name, num_classes={k}, ...)) "
                       f"or data with {first.shape[1]} classes (the data the model was trained on)")
    logits = torch.cat([first, _forward(model, x[PROBE_IMAGES:])]) if len(x) > PROBE_IMAGES else first
    logits = logits.float()
    if not bool(torch.isfinite(logits).all()):
        raise PBEError(f"{where}: the model's outputs on {what} hold NaN or inf; its weights are broken (retrain "
                       "or restore it)")
    if bool((logits >= 0).all()) and bool(((logits.sum(1) - 1).abs() <= PROBABILITY_TOLERANCE).all()):
        raise PBEError(f"{where}: the model's outputs are probabilities (every row non-negative, summing to 1): it "
                       "ends in a softmax, and every method here takes logits (cross-entropy, PGD, the scan's "
                       "statistics); remove the final softmax, or wrap it: pbe.models.Logits(model) (the log of "
                       "its probabilities)")
    return logits
