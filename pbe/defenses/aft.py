"""Adversarial fine-tuning (AFT) with a small clean extra set: PBE's setting 1.

Mu et al., "Progressive Backdoor Erasing via connecting Backdoor and Adversarial Attacks", CVPR 2023,
https://arxiv.org/abs/2202.06312. Authors' code: 20 epochs, the first 3 on untargeted PGD-7 examples
at 6/255 (step eps/5) labelled with their own labels, SGD lr 1e-3 constant, momentum 0.9, weight
decay 5e-4, batch 128.
"""
from __future__ import annotations

import torch.nn as nn

from pbe.activations import probe_indices
from pbe.adversarial import PAPER_PGD, PGDConfig
from pbe.data import ImageDataset
from pbe.defenses.base import Context, Defense, Evaluation, measure
from pbe.defenses.pbe import Schedule, adversarial_finetune, run_monitor
from pbe.utils import PBEError



class AFT(Defense):
    """Adversarial fine-tuning on a clean extra set (Mu et al., CVPR 2023, https://arxiv.org/abs/2202.06312).

    Arguments:
        epochs (int): fine-tuning epochs on the clean set (default 20, the authors').
        adv_epochs (int): how many of them, first, are on PGD examples (default 3).
        lr (float): SGD learning rate, constant (default 1e-3).
        pgd (PGDConfig | None): attack budget (default None: PGD-7 at 6/255, step eps/5).
        batch_size (int): default 128; crop_padding (int): random-crop padding, default 4.

    Example::

        >>> result = pbe.defenses.create("aft", epochs=20)(model, clean_set, train_size=50_000)
    """

    name = "aft"
    setting = "clean-extra"

    def __init__(self, epochs: int = 20, adv_epochs: int = 3, lr: float = 1e-3, pgd: PGDConfig | None = None,
                 batch_size: int = 128, crop_padding: int = 4):
        if not (isinstance(epochs, int) and epochs >= 1 and isinstance(adv_epochs, int) and 0 <= adv_epochs <= epochs):
            raise PBEError(f"aft: epochs must be an int >= 1 and adv_epochs an int in [0, epochs], got {epochs}, "
                           f"{adv_epochs}")
        if not (isinstance(lr, (int, float)) and lr > 0):
            raise PBEError(f"aft: lr must be a positive number, got {lr!r}")
        if not (isinstance(batch_size, int) and batch_size >= 1
                and isinstance(crop_padding, int) and crop_padding >= 0):
            raise PBEError(f"aft: batch_size must be an int >= 1 and crop_padding an int >= 0, got {batch_size}, "
                           f"{crop_padding}")
        super().__init__(epochs=epochs, adv_epochs=adv_epochs, lr=lr, pgd=pgd, batch_size=batch_size,
                         crop_padding=crop_padding)

    def _defend(self, model, data, ctx: Context):
        p = self.params
        s = Schedule(targeted=False, fractions=(1.0,), epochs=(p["epochs"],), adv_batches=(None,), lr=p["lr"],
                     lr_schedule="constant", pgd_config=p["pgd"] or PAPER_PGD, batch_size=p["batch_size"],
                     crop_padding=p["crop_padding"])
        probe = probe_indices(data.labels, min(s.probe_size, len(data)), ctx.seed)
        report = {"schedule": s.as_dict(), "clean_size": len(data),
                  "monitor_before": run_monitor(model, data, probe, s, ctx).as_dict(), "rounds": []}
        adv_batches = p["adv_epochs"] * -(-len(data) // s.batch_size)
        adversarial_finetune(model, data, s, ctx, epochs=p["epochs"], adv_batches=adv_batches, desc="AFT")
        mon = run_monitor(model, data, probe, s, ctx).as_dict()
        report["rounds"].append({"round": 1, "subset_size": len(data), "epochs": p["epochs"], "monitor": mon,
                                 "metrics": measure(model, ctx.evaluation)})
        report["monitor_after"] = mon
        return model, report, None


def aft(model: nn.Module, clean_set: ImageDataset, *, epochs: int = 20, adv_epochs: int = 3,
        pgd_config: PGDConfig | None = None, lr: float = 1e-3, seed: int = 0, device="auto",
        progress: bool = True, train_size: int | None = None, evaluation: Evaluation | None = None,
        batch_size: int = 128, crop_padding: int = 4) -> tuple[nn.Module, dict]:
    """AFT with a small clean set: ``(purified copy of model, report)``; `train_size` (the full
    training set's size) is the unit of the reported epoch-equivalents. See ``AFT``."""
    result = AFT(epochs=epochs, adv_epochs=adv_epochs, lr=lr, pgd=pgd_config, batch_size=batch_size,
                 crop_padding=crop_padding)(
        model, clean_set, seed=seed, device=device, progress=progress, evaluation=evaluation, train_size=train_size)
    return result.model, result.report
