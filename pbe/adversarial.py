"""PGD (Madry et al. 2018) in L-inf or L2, on inputs in [0, 1]: untargeted (away from the samples' own
labels) or, with `target`, targeted (toward a given label, e.g. a suspected backdoor target).

The model is put in eval mode for the attack and its mode restored afterwards; its parameters stop
tracking gradients while attacking (~1.6x faster on CPU).
Backends: ``native`` (plain torch, default) and ``foolbox`` (foolbox 3.3.4 LinfPGD / L2PGD).
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from pbe.utils import PBEError


PAPER_EPS = 6 / 255  # the PBE authors' L-inf budget on CIFAR-10


MAX_L2 = 1000.0  # an L2 budget above this is a mistake at any image size the toolkit handles


@dataclass(frozen=True)
class PGDConfig:
    """Attack budget. `step` defaults to eps / 5 (the PBE authors' choice); eps is in [0, 1] pixel units."""

    eps: float = PAPER_EPS
    steps: int = 7
    step: float | None = None
    norm: str = "linf"
    random_start: bool = False
    backend: str = "native"

    def __post_init__(self):
        if self.norm not in ("linf", "l2"):
            raise PBEError(f"norm must be 'linf' or 'l2', got {self.norm!r}")
        if self.backend not in ("native", "foolbox"):
            raise PBEError(f"backend must be 'native' or 'foolbox', got {self.backend!r}")
        if not (0 <= self.eps <= (1 if self.norm == "linf" else MAX_L2)) or not isinstance(self.steps, int) \
                or self.steps < 0 or (self.step is not None and not 0 <= self.step <= max(1.0, self.eps)):
            raise PBEError(f"PGD needs eps in [0, 1] (L-inf, pixel units; L2: [0, {MAX_L2:g}]), an integer number of "
                           f"steps >= 0 and a step in [0, max(1, eps)]; got eps={self.eps}, steps={self.steps!r}, "
                           f"step={self.step}")

    @property
    def step_size(self) -> float:
        return self.eps / 5 if self.step is None else self.step


PAPER_PGD = PGDConfig(eps=PAPER_EPS, steps=7)  # the authors' PGD-7 at 6/255, step eps / 5
MONITOR_PGD = PGDConfig(eps=PAPER_EPS, steps=5, step=2 / 255)  # the monitor's budget (`pbe detect`, PBE's early stop)


@contextlib.contextmanager
def attacking(model: nn.Module):
    """Eval mode and frozen parameters during an attack; both restored afterwards."""
    was_training = model.training
    flags = [p.requires_grad for p in model.parameters()]
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        yield model
    finally:
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
        model.train(was_training)


def _l2_normalize(v: torch.Tensor) -> torch.Tensor:
    return v / v.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, *([1] * (v.dim() - 1)))


def _project(x_adv: torch.Tensor, x: torch.Tensor, cfg: PGDConfig) -> torch.Tensor:
    delta = x_adv - x
    if cfg.norm == "linf":
        delta = delta.clamp(-cfg.eps, cfg.eps)
    else:
        norms = delta.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        delta = delta * (cfg.eps / norms.clamp_min(1e-12)).clamp(max=1.0)
    return (x + delta).clamp(0, 1)


def _native(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: PGDConfig,
            generator: torch.Generator | None, target: torch.Tensor | None = None) -> torch.Tensor:
    x_adv = x.detach().clone()
    if cfg.random_start and cfg.eps > 0:
        noise = torch.rand(x.shape, generator=generator).to(x.device) * 2 - 1
        if cfg.norm == "linf":
            x_adv = x_adv + cfg.eps * noise
        else:
            r = torch.rand(len(x), generator=generator).to(x.device).view(-1, 1, 1, 1)
            x_adv = x_adv + cfg.eps * r * _l2_normalize(noise)
        x_adv = _project(x_adv, x, cfg)
    for _ in range(cfg.steps):
        x_adv.requires_grad_(True)
        logits = model(x_adv)
        loss = F.cross_entropy(logits, y) if target is None else -F.cross_entropy(logits, target)
        (grad,) = torch.autograd.grad(loss, x_adv)
        with torch.no_grad():
            direction = grad.sign() if cfg.norm == "linf" else _l2_normalize(grad)
            x_adv = _project(x_adv + cfg.step_size * direction, x, cfg)
    return x_adv.detach()


def _foolbox(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: PGDConfig,
             target: torch.Tensor | None = None) -> torch.Tensor:
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")  # foolbox imports GitPython at import time
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import foolbox as fb
    fmodel = fb.PyTorchModel(model, bounds=(0, 1), device=x.device)
    cls = fb.attacks.LinfPGD if cfg.norm == "linf" else fb.attacks.L2PGD
    attack = cls(abs_stepsize=cfg.step_size, steps=cfg.steps, random_start=cfg.random_start)
    criterion = y.long() if target is None else fb.criteria.TargetedMisclassification(target.long())
    _, clipped, _ = attack(fmodel, x, criterion, epsilons=cfg.eps)  # no torch.no_grad around foolbox
    return clipped.detach()


def pgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: PGDConfig | None = None,
        generator: torch.Generator | None = None, target: int | torch.Tensor | None = None,
        **kw) -> torch.Tensor:
    """Adversarial examples of a batch, within eps of `x` and inside [0, 1]: untargeted (raise the
    loss of `y`) or, with `target` (one label, or one per image), targeted (lower the loss of it)."""
    cfg = cfg or PGDConfig(**kw)
    if x.dtype == torch.uint8 or float(x.min()) < 0 or float(x.max()) > 1:
        raise PBEError("pgd() takes float images in [0, 1]")
    if target is not None:
        target = torch.as_tensor(target, device=x.device).long().expand(len(x))
    with attacking(model):
        if cfg.backend == "foolbox":
            return _foolbox(model, x, y, cfg, target)
        return _native(model, x, y, cfg, generator, target)


def adversarial_examples(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, cfg: PGDConfig | None = None,
                         batch_size: int = 256, generator: torch.Generator | None = None,
                         device=None) -> torch.Tensor:
    """PGD over a whole set (uint8 or float images), batched; returns float images on the CPU."""
    cfg = cfg or PGDConfig()
    dev = device or next(model.parameters()).device
    out = []
    for s in range(0, len(images), batch_size):
        x = images[s:s + batch_size].to(dev)
        x = x.float() / 255 if x.dtype == torch.uint8 else x
        out.append(pgd(model, x, labels[s:s + batch_size].to(dev), cfg, generator).cpu())
    return torch.cat(out)


def success_rate(model: nn.Module, x_adv: torch.Tensor, labels: torch.Tensor, batch_size: int = 512) -> float:
    """Share of adversarial examples not classified as their label (counts already-wrong inputs too,
    like foolbox's ``success``)."""
    from pbe.metrics import predict
    return float((predict(model, x_adv, batch_size=batch_size) != labels).float().mean())


# ---------------------------------------------------------------- sparse and universal perturbations
def _patch_origins(n: int, size: int, h: int, w: int, generator: torch.Generator | None) -> torch.Tensor:
    """A random top-left corner per image for a size x size patch."""
    return torch.stack([torch.randint(0, h - size + 1, (n,), generator=generator),
                        torch.randint(0, w - size + 1, (n,), generator=generator)], 1)


def _paste(x: torch.Tensor, patch: torch.Tensor, origins: torch.Tensor) -> torch.Tensor:
    """`x` with `patch` ((C, s, s) shared, or (N, C, s, s) per image) pasted at each image's origin;
    differentiable in `patch`."""
    n, c = x.shape[:2]
    s = patch.shape[-1]
    dev = x.device
    where = (torch.arange(n, device=dev).view(n, 1, 1, 1), torch.arange(c, device=dev).view(1, c, 1, 1),
             (origins[:, 0, None] + torch.arange(s)).to(dev).view(n, 1, s, 1),
             (origins[:, 1, None] + torch.arange(s)).to(dev).view(n, 1, 1, s))
    full = patch.expand(n, *patch.shape[-3:]) if patch.dim() == 3 else patch
    keep = torch.ones_like(x).index_put(where, torch.zeros((), device=dev))
    return x * keep + torch.zeros_like(x).index_put(where, full)


def patch_attack(model: nn.Module, x: torch.Tensor, y: torch.Tensor, size: int = 3, steps: int = 20,
                 step: float = 0.1, generator: torch.Generator | None = None) -> torch.Tensor:
    """Untargeted sparse (L0) perturbation: a size x size patch of free pixel values at a random place
    in each image, by signed gradient ascent on the loss of the true label (a BadNets-like trigger
    search that knows no trigger)."""
    if not 1 <= size <= min(x.shape[-2:]):
        raise PBEError(f"patch size must be in [1, {min(x.shape[-2:])}], got {size}")
    origins = _patch_origins(len(x), size, *x.shape[-2:], generator)
    patch = torch.rand(len(x), x.shape[1], size, size, generator=generator).to(x.device)
    with attacking(model):
        for _ in range(steps):
            patch.requires_grad_(True)
            loss = F.cross_entropy(model(_paste(x, patch, origins)), y)
            (grad,) = torch.autograd.grad(loss, patch)
            patch = (patch.detach() + step * grad.sign()).clamp(0, 1)
        return _paste(x, patch, origins).detach()


UNIVERSAL_KINDS = ("linf", "l2", "patch", "warp", "mask")
PATTERN_STEP = 0.05  # the signed-gradient step of a pasted patch's pixel values
# the mask's and its pattern's steps: a sparse mask needs tens of steps to settle (use a small
# batch_size); on the digits BadNets model 0.3 / 0.2 with batches of 16 reach its target from 76 % of
# held-out images, 0.1 / 0.05 with batches of 128 from 3 %
MASK_STEP, MASK_PATTERN_STEP = 0.3, 0.2


def _project_mask(m: torch.Tensor, budget: float) -> torch.Tensor:
    """Euclidean projection of `m` onto {0 <= m <= 1, sum(m) <= budget}: ``clamp(m - tau, 0, 1)`` with
    the smallest tau >= 0 that meets the budget (bisection); small entries drop to 0, so the mask is sparse."""
    m = m.clamp(0, 1)
    if float(m.sum()) <= budget:
        return m
    lo, hi = torch.zeros((), device=m.device), m.max()
    for _ in range(40):  # on tensors: no host synchronisation per halving
        tau = (lo + hi) / 2
        over = (m - tau).clamp(0, 1).sum() > budget
        lo, hi = torch.where(over, tau, lo), torch.where(over, hi, tau)
    return (m - hi).clamp(0, 1)


def _blend_mask(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Neural Cleanse's trigger: ``(1 - m) x + m p`` with `delta` = (mask m (1 channel), pattern p)."""
    m, pattern = delta[:1], delta[1:]
    return (1 - m) * x + m * pattern


def _warp(x: torch.Tensor, flow: torch.Tensor, max_shift: float) -> torch.Tensor:
    """`x` resampled along `flow` ((size, size, 2) control grid of (dx, dy) in pixels), upsampled
    bicubically to the image and clamped to `max_shift` pixels; differentiable in `flow`."""
    n, _, h, w = x.shape
    field = F.interpolate(flow.permute(2, 0, 1)[None], size=(h, w), mode="bicubic", align_corners=True)
    field = field.clamp(-max_shift, max_shift).permute(0, 2, 3, 1)  # (1, h, w, 2) in pixels
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, h, device=x.device), torch.linspace(-1, 1, w, device=x.device),
                            indexing="ij")
    scale = torch.tensor([2 / max(w - 1, 1), 2 / max(h - 1, 1)], device=x.device)
    grid = (torch.stack([xs, ys], -1)[None] + field * scale).clamp(-1, 1)
    return F.grid_sample(x, grid.expand(n, -1, -1, -1), mode="bilinear", padding_mode="border", align_corners=True)


@dataclass(frozen=True)
class UniversalConfig:
    """One perturbation for many images: `kind` "linf" / "l2" (budget `eps`), "patch" (a `size` x
    `size` patch pasted at a random place in every image), "warp" (a smooth displacement field: a
    `size` x `size` control grid of (dx, dy) upsampled bicubically to the image, every displacement at
    most `eps` pixels, applied with bilinear resampling: the shape of WaNet's trigger, Nguyen & Tran,
    ICLR 2021) or "mask" (Neural Cleanse's trigger, Wang et al., IEEE S&P 2019: a mask m in [0, 1] and
    a pattern p, ``(1 - m) x + m p``, the mask's sum at most `eps` times the pixel count: a patch of
    unknown place, shape and colour); `epochs` passes over the images."""

    kind: str = "linf"
    eps: float = 8 / 255
    size: int = 5
    epochs: int = 5
    step: float | None = None  # default eps / 4 (linf, l2, warp), PATTERN_STEP (patch) or MASK_STEP (mask)
    batch_size: int = 128
    per_pixel: bool = False  # budget relative to the image: "l2": `eps` is the root-mean-square change per
    #                          pixel; "warp": the largest displacement as a share of the image side

    def __post_init__(self):
        if self.kind not in UNIVERSAL_KINDS:
            raise PBEError(f"universal kind must be one of {', '.join(UNIVERSAL_KINDS)}, got {self.kind!r}")
        if self.epochs < 1 or self.batch_size < 1 or self.eps <= 0 or self.size < 1:
            raise PBEError("universal perturbation needs epochs >= 1, batch_size >= 1, eps > 0, size >= 1")
        if self.kind == "mask" and self.eps > 1:
            raise PBEError(f"a mask's budget eps is a share of the pixels, in (0, 1]; got {self.eps}")


def universal_perturbation(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                           cfg: UniversalConfig | None = None, generator: torch.Generator | None = None,
                           device=None, target: int | None = None, start: torch.Tensor | None = None) -> torch.Tensor:
    """One untargeted perturbation (C, H, W) that raises the loss of every image's true label
    (Moosavi-Dezfooli et al. 2017, optimised by mini-batch signed / normalised gradient ascent), or
    with `target`, one that lowers every image's loss for that label (a trigger-like direction).
    For "linf" / "l2" it is added to an image, for "patch" pasted, for "mask" (mask and pattern stacked,
    (1 + C, H, W)) blended, for "warp" (a control grid of
    displacements) resampled along: ``apply_universal`` does each. `start`: an earlier perturbation of the same
    kind and shape to continue from (default None: a fresh start)."""
    cfg = cfg or UniversalConfig()
    dev = device or next(model.parameters()).device
    c, h, w = images.shape[1:]
    if cfg.per_pixel and cfg.kind == "l2":
        cfg = replace(cfg, eps=cfg.eps * math.sqrt(c * h * w), per_pixel=False)
    if cfg.per_pixel and cfg.kind == "warp":
        cfg = replace(cfg, eps=cfg.eps * max(h, w), per_pixel=False)
    if cfg.kind == "patch":
        delta = torch.rand(c, cfg.size, cfg.size, generator=generator).to(dev)
        step = PATTERN_STEP if cfg.step is None else cfg.step
    elif cfg.kind == "mask":  # a uniform mask within the budget, a random pattern
        budget = cfg.eps * h * w
        delta = torch.cat([torch.full((1, h, w), min(1.0, cfg.eps)), torch.rand(c, h, w, generator=generator)]).to(dev)
        step = MASK_STEP if cfg.step is None else cfg.step
    elif cfg.kind == "warp":  # a small random start: the resampling's gradient at zero shift is one-sided
        delta = ((torch.rand(cfg.size, cfg.size, 2, generator=generator) * 2 - 1) * cfg.eps / 10).to(dev)
        step = cfg.eps / 4 if cfg.step is None else cfg.step
    else:
        delta = torch.zeros(c, h, w, device=dev)
        step = cfg.eps / 4 if cfg.step is None else cfg.step
    if start is not None:
        if start.shape != delta.shape:
            raise PBEError(f"universal perturbation: start has shape {tuple(start.shape)}, a {cfg.kind} perturbation "
                           f"of these images {tuple(delta.shape)}")
        delta = start.clone().to(dev)
    with attacking(model):
        for _ in range(cfg.epochs):
            order = torch.randperm(len(images), generator=generator)
            for s in range(0, len(images), cfg.batch_size):
                idx = order[s:s + cfg.batch_size]
                x = images[idx].to(dev)
                x = x.float() / 255 if x.dtype == torch.uint8 else x
                delta.requires_grad_(True)
                logits = model(apply_universal(x, delta, cfg, generator))
                if target is None:
                    loss = F.cross_entropy(logits, labels[idx].to(dev))
                else:
                    loss = -F.cross_entropy(logits, torch.full((len(idx),), int(target), device=dev))
                (grad,) = torch.autograd.grad(loss, delta)
                with torch.no_grad():
                    if cfg.kind == "patch":
                        delta = (delta + step * grad.sign()).clamp(0, 1)
                    elif cfg.kind == "mask":
                        delta = torch.cat([_project_mask(delta[:1] + step * grad[:1].sign(), budget),
                                           (delta[1:] + MASK_PATTERN_STEP * grad[1:].sign()).clamp(0, 1)])
                    elif cfg.kind == "warp":
                        delta = (delta + step * grad.sign()).clamp(-cfg.eps, cfg.eps)
                    elif cfg.kind == "linf":
                        delta = (delta + step * grad.sign()).clamp(-cfg.eps, cfg.eps)
                    else:
                        delta = delta + step * grad / grad.norm().clamp_min(1e-12)
                        delta = delta * (cfg.eps / delta.norm().clamp_min(1e-12)).clamp(max=1.0)
    return delta.detach().cpu()


def apply_universal(x: torch.Tensor, delta: torch.Tensor, cfg: UniversalConfig,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """`x` (float in [0, 1]) with a universal perturbation: added and clipped, or pasted as a patch."""
    delta = delta.to(x.device)
    if cfg.kind == "warp":
        return _warp(x, delta, cfg.eps * max(x.shape[-2:]) if cfg.per_pixel else cfg.eps)
    if cfg.kind == "patch":
        return _paste(x, delta, _patch_origins(len(x), delta.shape[-1], *x.shape[-2:], generator))
    if cfg.kind == "mask":
        return _blend_mask(x, delta)
    return (x + delta).clamp(0, 1)
