"""FP: fine-pruning (Liu, Dolan-Gavitt & Garg, RAID 2018).

Backdoor neurons are dormant on clean inputs, so the channels of the last convolutional feature map
are pruned in increasing order of their mean activation on clean data, stopping before clean accuracy
falls more than `acc_ratio` below its start; the pruned model is then fine-tuned (pruned channels stay
at zero). Channels are pruned through the BatchNorm that produces the last feature map (weight and
bias set to 0, so the ReLU output is 0), which removes the channel in PreAct-ResNets too, where
zeroing the last conv's filters would leave the skip path.

Defaults from BackdoorBench ``config/defense/fp/cifar10.yaml``: 5% clean data, prune 1% of the
channels per step (`once_prune_ratio`), stop at a relative accuracy drop of `acc_ratio` = 0.1, then
fine-tune 100 epochs, batch 256, SGD lr 0.01 cosine, momentum 0.9, weight decay 5e-4.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from pbe.defenses.base import Context, Defense, sgd_finetune
from pbe.metrics import accuracy, predict
from pbe.models import capture
from pbe.utils import PBEError


def last_feature_bn(model: nn.Module) -> tuple[str, nn.BatchNorm2d]:
    """The last BatchNorm2d: it normalises the last convolutional feature map in the toolkit's models."""
    bns = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    if not bns:
        raise PBEError("fine-pruning needs a BatchNorm2d on the last convolutional feature map")
    return bns[-1]


@torch.no_grad()
def channel_activity(model: nn.Module, bn: nn.BatchNorm2d, images: torch.Tensor, device, batch_size=512):
    """Mean post-ReLU activation of each channel of `bn`'s output over `images`."""
    total: list[torch.Tensor] = []
    model.eval()
    with capture(model, [bn]) as out:
        for s in range(0, len(images), batch_size):
            model(images[s:s + batch_size].to(device).float().div_(255))
            total.append(out[bn].clamp(min=0).mean((0, 2, 3)) * len(out[bn]))
    return (torch.stack(total).sum(0) / len(images)).cpu()


def prune_channels(bn: nn.BatchNorm2d, channels: torch.Tensor) -> None:
    with torch.no_grad():
        bn.weight[channels] = 0
        bn.bias[channels] = 0


class FinePruning(Defense):
    """Fine-pruning (Liu, Dolan-Gavitt & Garg, RAID 2018, https://arxiv.org/abs/1805.12185): prune the
    last feature map's channels that are dormant on clean data, then fine-tune.

    Arguments:
        acc_ratio (float): stop pruning before clean accuracy falls this share below its start (default 0.1).
        once_prune_ratio (float): share of the channels pruned per step (default 0.01).
        epochs, lr, batch_size, momentum, weight_decay: the fine-tuning after pruning, as
            :class:`~pbe.defenses.ft.FineTuning` (defaults 100, 0.01 cosine-annealed, 256, 0.9, 5e-4).

    Example::

        >>> result = pbe.defenses.create("fp", acc_ratio=0.05, epochs=20)(model, clean_set, train_size=50_000)
    """

    name = "fp"
    setting = "clean-extra"

    def __init__(self, acc_ratio: float = 0.1, once_prune_ratio: float = 0.01, epochs: int = 100, lr: float = 0.01,
                 batch_size: int = 256, momentum: float = 0.9, weight_decay: float = 5e-4):
        super().__init__(acc_ratio=acc_ratio, once_prune_ratio=once_prune_ratio, epochs=epochs, lr=lr,
                         batch_size=batch_size, momentum=momentum, weight_decay=weight_decay)

    def _check(self):
        if not 0 < self.params["once_prune_ratio"] <= 1 or not 0 <= self.params["acc_ratio"] < 1:
            raise PBEError("fp: once_prune_ratio must be in (0, 1] and acc_ratio in [0, 1)")

    def _defend(self, model, data, ctx: Context):
        p = self.params
        layer, bn = last_feature_bn(model)
        order = channel_activity(model, bn, data.images, ctx.device).argsort()  # most dormant first
        ctx.cost.forward += len(data)
        start_acc = accuracy(predict(model, data.images), data.labels)
        floor = (1 - p["acc_ratio"]) * start_acc
        step = max(1, math.ceil(p["once_prune_ratio"] * len(order)))
        saved = (bn.weight.detach().clone(), bn.bias.detach().clone())
        pruned, trace = 0, []
        for k in range(step, len(order), step):  # never prune every channel
            prune_channels(bn, order[:k])
            acc = accuracy(predict(model, data.images), data.labels)
            ctx.cost.forward += len(data)
            trace.append({"pruned": k, "clean_acc": acc})
            if acc < floor:
                break
            pruned = k
        with torch.no_grad():  # undo the last step that crossed the floor
            bn.weight.copy_(saved[0])
            bn.bias.copy_(saved[1])
        dead = order[:pruned].to(ctx.device)
        prune_channels(bn, dead)
        sgd_finetune(model, data, ctx, epochs=p["epochs"], lr=p["lr"], batch_size=p["batch_size"],
                     momentum=p["momentum"], weight_decay=p["weight_decay"], desc="FP fine-tune",
                     after_step=lambda: prune_channels(bn, dead))
        return model, {"pruned_layer": layer, "pruned_channels": order[:pruned].tolist(),
                       "channels": len(order), "start_clean_acc": start_acc, "prune_trace": trace}, None
