"""FT: plain fine-tuning on the clean extra set.

Source: BackdoorBench (Wu et al., NeurIPS 2022 Datasets & Benchmarks), ``defense/ft.py`` and
``config/defense/ft/cifar10.yaml``: 5% clean data, 100 epochs, batch 256, SGD lr 0.01 with cosine
annealing, momentum 0.9, weight decay 5e-4.
"""
from __future__ import annotations

from pbe.defenses.base import Context, Defense, sgd_finetune


class FineTuning(Defense):
    """Fine-tuning on the clean extra set (the baseline of every repair defence; BackdoorBench's ``ft``,
    Wu et al., NeurIPS 2022 Datasets and Benchmarks, https://arxiv.org/abs/2206.12654).

    Arguments:
        epochs (int): fine-tuning epochs (default 100).
        lr (float): SGD learning rate, cosine-annealed (default 0.01).
        batch_size (int): default 256.
        momentum (float): default 0.9.
        weight_decay (float): default 5e-4.

    Example::

        >>> result = pbe.defenses.create("ft", epochs=20)(model, clean_set, train_size=50_000)
    """

    name = "ft"
    setting = "clean-extra"

    def __init__(self, epochs: int = 100, lr: float = 0.01, batch_size: int = 256, momentum: float = 0.9,
                 weight_decay: float = 5e-4):
        super().__init__(epochs=epochs, lr=lr, batch_size=batch_size, momentum=momentum, weight_decay=weight_decay)

    def _defend(self, model, data, ctx: Context):
        p = self.params
        sgd_finetune(model, data, ctx, epochs=p["epochs"], lr=p["lr"], batch_size=p["batch_size"],
                     momentum=p["momentum"], weight_decay=p["weight_decay"], desc="FT")
        return model, {}, None
