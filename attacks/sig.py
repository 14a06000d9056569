"""SIG (Barni et al., 2019): an additive horizontal sinusoid, clean-label by default."""
from __future__ import annotations

import math

import torch

from attacks.base import BackdoorAttack
from pbe.utils import PBEError


class SIG(BackdoorAttack):
    """v(i, j) = delta * sin(2 pi j f / W) added to every row and channel, then clipped to [0, 1].

    mode "clean_label" (the original: only target-class images are poisoned, labels kept) or
    "poison_label" (the PBE authors' code). `delta_train` / `delta_test` are in [0, 1] units
    (default 20/255 for both; the PBE code trains at 10/255 and re-poisons at 20/255 by mistake).
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
