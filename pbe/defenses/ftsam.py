"""FT-SAM: fine-tuning with (adaptive) sharpness-aware minimisation (Zhu et al., ICCV 2023).

Plain fine-tuning on a small clean set barely moves the neurons a backdoor lives in; they tend to have
large weight norms. FT-SAM fine-tunes on min_w max_{|e / T_w| <= rho} L(w + e) instead: per batch it
climbs to the worst weights within a radius rho around w, takes the gradient there, and applies it
to w. With the adaptive (ASAM-style) neighbourhood, T_w = |w| + eta element-wise, the perturbation
e = rho * T_w^2 g / |T_w g| is largest on the largest weights, so the update shrinks them first.

Defaults from BackdoorBench ``defense/ft-sam.py`` (code by the paper's authors), its SAM optimiser
``utils/defense_utils/sam`` and ``config/defense/ft-sam/cifar10.yaml``: 5% clean data, 100 epochs,
batch 256, SGD lr 0.01, momentum 0.9, weight decay 5e-4, rho 2.0 (rho_max = rho_min: constant),
adaptive on (its ``--adaptive`` flag is ``store_false``), eta 0 (the weight's magnitude alone scales
the perturbation), label smoothing 0.1 (the true class 0.9, each other class 0.1 / (C - 1)), the
GSAM gradient decomposition off (alpha 0), crop-and-flip augmentation, BatchNorm in train mode with its
running statistics updated by the first (unperturbed) pass only. The GTSRB and Tiny-ImageNet configs
use rho 8, no label smoothing and 50 / 100 epochs.

Two departures: the learning rate is cosine-annealed per epoch to 0 over `epochs`, as in this toolkit's
FT; BackdoorBench steps ``CosineAnnealingLR(T_max=100)`` once per *batch*, so on 2,500 images (10
batches) its rate goes down and back up every 20 epochs. And the loss is the cross-entropy with the
smoothed labels rather than its KL form (same gradient).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from pbe.data import ImageDataset, augment
from pbe.defenses.base import Context, Defense, LossFn, Stage
from pbe.train import batches, lr_factor
from pbe.utils import PBEError

PERTURB_EPS = 1e-12  # added to the gradient norm that normalises the perturbation (as BackdoorBench's)
MAX_RHO = 100.0


def smooth_cross_entropy(logits: torch.Tensor, y: torch.Tensor, smoothing: float = 0.1) -> torch.Tensor:
    """Mean cross-entropy against smoothed labels: 1 - `smoothing` on the true class, the rest spread over
    the others (BackdoorBench's ``smooth_crossentropy``; 0 is the plain cross-entropy)."""
    if smoothing == 0:
        return F.cross_entropy(logits, y)
    target = torch.full_like(logits, smoothing / max(1, logits.size(1) - 1))
    target.scatter_(1, y[:, None], 1.0 - smoothing)
    return -(target * F.log_softmax(logits, 1)).sum(1).mean()


@contextlib.contextmanager
def frozen_bn_stats(model: nn.Module):
    """BatchNorm layers still normalise with the batch's statistics but do not update their running ones
    (momentum 0, the batch counter restored): SAM's second pass must not count the batch twice."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [(m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in bns]
    for m in bns:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(bns, saved):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def sam_step(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, optimizer: torch.optim.Optimizer,
             rho: float, adaptive: bool = True, eta: float = 0.0) -> tuple[float, float]:
    """One (adaptive) SAM update, two forward + backward passes. With g = dL/dw at w and T = |w| + eta
    (1 when not adaptive): e = rho * T^2 g / |T g| (norm over all parameters), then the gradient at
    w + e, then w restored and `optimizer` stepped with that gradient. Returns the batch loss at w
    and at w + e."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, x, y)
    loss.backward()
    with torch.no_grad():
        live = [p for p in params if p.grad is not None]
        scale = [p.abs() + eta if adaptive else torch.ones_like(p) for p in live]
        norm = torch.stack([(s * p.grad).norm() for s, p in zip(scale, live)]).norm()
        moves = [rho * s * s * p.grad / (norm + PERTURB_EPS) for s, p in zip(scale, live)]
        for p, e in zip(live, moves):
            p.add_(e)  # to the worst point of the neighbourhood (to first order)
    optimizer.zero_grad(set_to_none=True)
    with frozen_bn_stats(model):
        perturbed = loss_fn(model, x, y)
        perturbed.backward()
    with torch.no_grad():
        for p, e in zip(live, moves):
            p.sub_(e)  # back to w: only the gradient comes from w + e
    optimizer.step()
    return float(loss.detach()), float(perturbed.detach())


class FTSAM(Defense):
    """Fine-tuning with sharpness-aware minimisation (Zhu, Wei, Shen, Fan & Wu, ICCV 2023,
    https://arxiv.org/abs/2304.11823): fine-tune on the clean extra set against the worst weight
    perturbation within a radius, scaled by each weight's magnitude, which shrinks the large-norm
    neurons a backdoor relies on. Each step costs two forward + backward passes (twice FT's epoch).

    Defaults are BackdoorBench's CIFAR-10 ones (``config/defense/ft-sam/cifar10.yaml``), GPU-sized:
    on CPU ``experiments/defenses_cifar10.py`` runs 20 epochs instead of 100 (as for FT), every
    other value unchanged; the report records the parameters.

    Arguments:
        epochs (int): fine-tuning epochs (default 100).
        lr (float): SGD learning rate, cosine-annealed per epoch (default 0.01).
        batch_size (int): default 256.
        momentum (float): default 0.9.
        weight_decay (float): default 5e-4.
        rho (float): radius of the weight perturbation (default 2.0; 8.0 in BackdoorBench's GTSRB and
            Tiny-ImageNet configs; plain SAM uses about 0.05).
        adaptive (bool): scale the perturbation by the weights' magnitude, ASAM-style (default True).
        eta (float): added to the magnitude in the adaptive scaling, T_w = |w| + eta (default 0.0).
        label_smoothing (float): share of each label spread over the other classes (default 0.1).

    Example::

        >>> result = pbe.defenses.create("ftsam", epochs=20)(model, clean_set, train_size=50_000)
        >>> result.report["epochs"][-1]  # loss at w and at the perturbed w + e, last epoch
    """

    name = "ftsam"
    setting = "clean-extra"

    def __init__(self, epochs: int = 100, lr: float = 0.01, batch_size: int = 256, momentum: float = 0.9,
                 weight_decay: float = 5e-4, rho: float = 2.0, adaptive: bool = True, eta: float = 0.0,
                 label_smoothing: float = 0.1):
        super().__init__(epochs=epochs, lr=lr, batch_size=batch_size, momentum=momentum, weight_decay=weight_decay,
                         rho=rho, adaptive=adaptive, eta=eta, label_smoothing=label_smoothing)

    def _check(self) -> None:
        p = self.params
        if not (math.isfinite(p["rho"]) and 0 < p["rho"] <= MAX_RHO):
            raise PBEError(f"ftsam: rho (the perturbation radius) must be in (0, {MAX_RHO:g}], got {p['rho']!r}; "
                           "BackdoorBench uses 2.0 on CIFAR-10, 8.0 on GTSRB (plain FT is the `ft` defence)")
        if not (math.isfinite(p["eta"]) and p["eta"] >= 0):
            raise PBEError(f"ftsam: eta must be a finite number >= 0, got {p['eta']!r}")
        if p["eta"] > 0 and not p["adaptive"]:
            raise PBEError(f"ftsam: eta={p['eta']} only scales the adaptive perturbation; "
                           "set adaptive=True or leave eta at 0")
        if not 0 <= p["label_smoothing"] < 1:
            raise PBEError(f"ftsam: label_smoothing must be in [0, 1), got {p['label_smoothing']!r}")

    def _defend(self, model, data: ImageDataset, ctx: Context):
        p = self.params
        opt = torch.optim.SGD(model.parameters(), lr=p["lr"], momentum=p["momentum"], weight_decay=p["weight_decay"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: lr_factor(e, p["epochs"], "cosine"))
        stage = Stage(ctx, p["epochs"], data=data, model=model, optimizer=opt, scheduler=scheduler)

        def loss_fn(m, x, y):
            return smooth_cross_entropy(m(x), y, p["label_smoothing"])

        per_epoch = math.ceil(len(data) / p["batch_size"])
        bar = tqdm(total=p["epochs"] * per_epoch, initial=stage.first * per_epoch, desc="FT-SAM",
                   disable=not ctx.progress, leave=False, unit="batch")
        for epoch in range(stage.first, p["epochs"]):
            model.train()
            lr, total, total_perturbed = opt.param_groups[0]["lr"], 0.0, 0.0
            for idx in batches(len(data), p["batch_size"], ctx.gen):
                x = augment(data.images[idx].to(ctx.device).float().div_(255), 4, data.flip, ctx.gen)
                y = data.labels[idx].to(ctx.device)
                loss, perturbed = sam_step(model, loss_fn, x, y, opt, p["rho"], p["adaptive"], p["eta"])
                ctx.cost.forward_backward += 2 * len(y)  # at w, then at w + e
                total += loss * len(y)
                total_perturbed += perturbed * len(y)
                bar.update(1)
            scheduler.step()
            stage.log.append({"epoch": epoch + 1, "lr": lr, "loss": round(total / len(data), 4),
                              "perturbed_loss": round(total_perturbed / len(data), 4)})
            stage.done(epoch + 1)
        bar.close()
        model.eval()
        return model, {"epochs": stage.log}, None
