"""NAD: neural attention distillation (Li et al., ICLR 2021).

A teacher is the backdoored model fine-tuned on the clean extra set; the student (the backdoored
model again) is then fine-tuned with cross-entropy plus attention-map distillation from the teacher
at the outputs of the last three convolutional stages. Attention map of a feature map f (B, C, H, W):
a = normalise_L2(mean_c |f|^p); loss term beta_i * mean((a_student - a_teacher)^2).

Defaults from BackdoorBench ``config/defense/nad/cifar10.yaml``: 5% clean data, teacher 10 epochs,
student 100 epochs, batch 256, SGD lr 0.01 cosine, momentum 0.9, weight decay 1e-4, p = 2,
betas (500, 1000, 1000) for (layer2, layer3, layer4) of PreAct-ResNet-18.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from pbe.defenses.base import Context, Defense, sgd_finetune
from pbe.models import capture
from pbe.utils import PBEError


def attention_map(feature: torch.Tensor, p: float) -> torch.Tensor:
    return F.normalize(feature.abs().pow(p).mean(1).flatten(1), dim=1)


def conv_stages(model: nn.Module, count: int) -> list[str]:
    """Names of the last `count` top-level children that contain a convolution (ResNet stages)."""
    names = [n for n, m in model.named_children() if any(isinstance(s, nn.Conv2d) for s in m.modules())]
    if not names:
        raise PBEError("NAD needs a model with convolutional stages as top-level children")
    return names[-count:]


class NAD(Defense):
    """Neural attention distillation (Li et al., ICLR 2021, https://arxiv.org/abs/2101.05930): a teacher
    fine-tuned on clean data guides the student's attention maps.

    Arguments:
        teacher_epochs (int): the teacher's fine-tuning epochs (default 10).
        epochs (int): the student's epochs (default 100).
        lr (float): SGD learning rate, cosine-annealed (default 0.01).
        batch_size (int): default 256.
        momentum (float): default 0.9.
        weight_decay (float): default 1e-4.
        p (float): attention power (default 2.0).
        betas (tuple[float, ...]): distillation weights of the last stages (default (500, 1000, 1000)).
        layers (list[str] | None): layer names to distil (default None: the last ``len(betas)`` stages).

    Example::

        >>> result = pbe.defenses.create("nad", epochs=20)(model, clean_set, train_size=50_000)
    """

    name = "nad"
    setting = "clean-extra"

    def __init__(self, teacher_epochs: int = 10, epochs: int = 100, lr: float = 0.01, batch_size: int = 256,
                 momentum: float = 0.9, weight_decay: float = 1e-4, p: float = 2.0,
                 betas: tuple[float, ...] = (500.0, 1000.0, 1000.0), layers: list[str] | None = None):
        super().__init__(teacher_epochs=teacher_epochs, epochs=epochs, lr=lr, batch_size=batch_size,
                         momentum=momentum, weight_decay=weight_decay, p=p, betas=betas, layers=layers)

    def _defend(self, model, data, ctx: Context):
        p = self.params
        layers = list(p["layers"] or conv_stages(model, len(p["betas"])))
        betas = list(p["betas"])[-len(layers):]
        teacher = copy.deepcopy(model)
        opt_kw = dict(lr=p["lr"], batch_size=p["batch_size"], momentum=p["momentum"],
                      weight_decay=p["weight_decay"])
        sgd_finetune(teacher, data, ctx, epochs=p["teacher_epochs"], desc="NAD teacher", **opt_kw)
        teacher.eval()
        for q in teacher.parameters():
            q.requires_grad_(False)
        with capture(teacher, layers) as t_out, capture(model, layers) as s_out:
            def loss_fn(student, x, y):
                with torch.no_grad():
                    teacher(x)
                loss = F.cross_entropy(student(x), y)
                for name, beta in zip(layers, betas):
                    diff = attention_map(s_out[name], p["p"]) - attention_map(t_out[name], p["p"])
                    loss = loss + beta * diff.pow(2).mean()
                return loss
            sgd_finetune(model, data, ctx, epochs=p["epochs"], desc="NAD student", loss_fn=loss_fn, **opt_kw)
        ctx.cost.forward += p["epochs"] * len(data)  # the teacher's forward passes
        return model, {"attention_layers": layers, "betas": betas}, None
