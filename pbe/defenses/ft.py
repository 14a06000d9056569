"""FT: plain fine-tuning on the clean extra set.

Source: BackdoorBench (Wu et al., NeurIPS 2022 Datasets & Benchmarks), ``defense/ft.py`` and
``config/defense/ft/cifar10.yaml``: 5% clean data, 100 epochs, batch 256, SGD lr 0.01 with cosine
annealing, momentum 0.9, weight decay 5e-4.
"""
from __future__ import annotations

from pbe.defenses.base import Context, Defense, sgd_finetune


class FineTuning(Defense):
    name = "ft"
    setting = "clean-extra"
    defaults = {"epochs": 100, "lr": 0.01, "batch_size": 256, "momentum": 0.9, "weight_decay": 5e-4}

    def _defend(self, model, data, ctx: Context):
        p = self.params
        sgd_finetune(model, data, ctx, epochs=p["epochs"], lr=p["lr"], batch_size=p["batch_size"],
                     momentum=p["momentum"], weight_decay=p["weight_decay"], desc="FT")
        return model, {}, None
