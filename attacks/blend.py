"""Blend (Chen et al., 2017): x' = (1 - alpha) x + alpha K with a fixed key image K."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attacks.base import BackdoorAttack
from pbe.utils import PBEError

KEYS = ("noise", "smooth")
SMOOTH_GRID = 4  # control points per side of the smooth key


class Blend(BackdoorAttack):
    """Blend (Chen et al., 2017, https://arxiv.org/abs/1712.05526): x' = (1 - alpha) x + alpha key.

    Arguments:
        target (int): the target label of an all-to-one backdoor (default 0).
        all_to_all (bool): label y -> (y + 1) mod C instead (default False).
        seed (int): seeds the trigger (default 0).
        alpha_train (float): blend ratio of the poisoned training images (default 0.2, BackdoorBench's).
        alpha_test (float): blend ratio at evaluation (default 0.2; the PBE paper evaluates at 0.1).
        key (str | Tensor): "noise" (default: a seeded uniform-noise image), "smooth" (seeded 4x4 colour
            noise upsampled bicubically: an image-like key), or a tensor (C, H, W) / (H, W) in [0, 1] of
            any size (resized to the images).

    Example::

        >>> attack = attacks.create("blend", target=7, key="smooth")
        >>> poisoned_train, _ = attack.plant(model, train_set, test_set, rate=0.1)
    """

    name = "blend"

    def __init__(self, target=0, all_to_all=False, seed=0, alpha_train=0.2, alpha_test=0.2, key="noise"):
        super().__init__(target, all_to_all, seed)
        for a in (alpha_train, alpha_test):
            if not 0 < a <= 1:
                raise PBEError(f"blend alpha must be in (0, 1], got {a}")
        self.alpha_train, self.alpha_test = float(alpha_train), float(alpha_test)
        key = "noise" if key is None else key
        if isinstance(key, str) and key not in KEYS + ("custom",):
            raise PBEError(f"blend key must be one of {KEYS} or an image tensor, got {key!r}")
        self.key_spec = key if isinstance(key, str) else "custom"
        self._user_key = None if isinstance(key, str) else torch.as_tensor(key, dtype=torch.float32)

    def params(self):
        return {**super().params(), "alpha_train": self.alpha_train, "alpha_test": self.alpha_test,
                "key": self.key_spec}

    def _build(self, shape, generator):
        c, h, w = shape
        if self.key_spec == "noise":
            key = torch.rand(c, h, w, generator=generator)
        elif self.key_spec == "smooth":
            coarse = torch.rand(1, c, SMOOTH_GRID, SMOOTH_GRID, generator=generator)
            key = F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=True)[0].clamp(0, 1)
        elif self._user_key is None:  # "custom" reloaded from a saved state: the buffer comes with it
            key = torch.zeros(c, h, w)
        else:
            key = self._user_key
            key = key[None] if key.dim() == 2 else key
            if key.min() < 0 or key.max() > 1:
                raise PBEError("the blend key image must have values in [0, 1]")
            key = F.interpolate(key[None], size=(h, w), mode="bilinear", align_corners=False)[0]
            key = key.mean(0, keepdim=True).expand(c, h, w) if key.shape[0] != c else key
        self.register_buffer("key", key.contiguous())

    def _trigger(self, x, train):
        a = self.alpha_train if train else self.alpha_test
        return (1 - a) * x + a * self.key
