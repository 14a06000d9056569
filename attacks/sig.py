"""SIG (Barni et al., 2019): an additive horizontal sinusoid, clean-label by default."""
from __future__ import annotations

import math

import torch

from attacks.base import BackdoorAttack
from pbe.utils import PBEError


class SIG(BackdoorAttack):
    """SIG (Barni, Kallas & Tondi, ICIP 2019, https://arxiv.org/abs/1902.11237): the sinusoidal signal
    v(i, j) = delta * sin(2 pi j f / W) added to every row and channel, then clipped to [0, 1].

    Arguments:
        target (int): the target label of an all-to-one backdoor (default 0).
        all_to_all (bool): label y -> (y + 1) mod C instead (default False).
        seed (int): seeds the trigger (default 0).
        delta_train (float): amplitude on the poisoned training images, in [0, 1] units (default 20/255;
            the PBE code trains at 10/255 and re-poisons at 20/255 by mistake).
        delta_test (float): amplitude at evaluation (default 20/255).
        frequency (float): periods across the image width (default 6).
        mode (str): "clean_label" (default, the original: only target-class images are poisoned, labels
            kept) or "poison_label" (the PBE authors' code).

    Example::

        >>> attack = attacks.create("sig", target=2, frequency=10)
        >>> poisoned_train, _ = attack.plant(model, train_set, test_set, rate=0.08)
    """

    name = "sig"

    def __init__(self, target=0, all_to_all=False, seed=0, delta_train=20 / 255, delta_test=20 / 255,
                 frequency=6, mode="clean_label"):
        super().__init__(target, all_to_all, seed)
        if mode not in ("clean_label", "poison_label"):
            raise PBEError(f"SIG mode must be 'clean_label' or 'poison_label', got {mode!r}")
        if mode == "clean_label" and all_to_all:
            raise PBEError("clean-label SIG is all-to-one by definition; use mode='poison_label' for all-to-all")
        self.delta_train, self.delta_test = float(delta_train), float(delta_test)
        self.frequency, self.mode = float(frequency), mode
        self.clean_label = mode == "clean_label"

    def params(self):
        return {**super().params(), "delta_train": self.delta_train, "delta_test": self.delta_test,
                "frequency": self.frequency, "mode": self.mode}

    def _build(self, shape, generator):
        c, h, w = shape
        j = torch.arange(w, dtype=torch.float32)
        self.register_buffer("signal", torch.sin(2 * math.pi * j * self.frequency / w).expand(c, h, w).clone())

    def _trigger(self, x, train):
        return x + (self.delta_train if train else self.delta_test) * self.signal
