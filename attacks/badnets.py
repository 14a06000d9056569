"""BadNets (Gu et al., 2017): a fixed patch stamped in a corner."""
from __future__ import annotations

import torch

from attacks.base import BackdoorAttack
from pbe.utils import PBEError

CORNERS = ("bottom-right", "bottom-left", "top-right", "top-left")
PATTERNS = ("checkerboard", "white", "random")


class BadNets(BackdoorAttack):
    """BadNets (Gu, Dolan-Gavitt & Garg, 2017, https://arxiv.org/abs/1708.06733): a `size` x `size`
    patch pasted `margin` pixels from `corner`.

    Arguments:
        target (int): the target label of an all-to-one backdoor (default 0).
        all_to_all (bool): label y -> (y + 1) mod C instead (default False).
        seed (int): seeds the trigger (default 0).
        size (int): patch side in pixels (default 3, the PBE paper's).
        pattern (str | Tensor): "checkerboard" (black/white, default), "white", "random" (a seeded random
            colour per pixel and channel), or a tensor (size, size) / (C, size, size) in [0, 1].
        corner (str): "bottom-right" (default), "bottom-left", "top-left" or "top-right".
        margin (int): distance from the corner in pixels (default 0).

    Example::

        >>> attack = attacks.create("badnets", target=3, size=4, pattern="random", corner="top-left")
        >>> poisoned_train, _ = attack.plant(model, train_set, test_set, rate=0.05)
    """

    name = "badnets"

    def __init__(self, target=0, all_to_all=False, seed=0, size=3, pattern="checkerboard",
                 corner="bottom-right", margin=0):
        super().__init__(target, all_to_all, seed)
        if corner not in CORNERS:
            raise PBEError(f"corner must be one of {CORNERS}, got {corner!r}")
        if int(size) < 1:
            raise PBEError(f"patch size must be >= 1, got {size}")
        self.size, self.corner, self.margin = int(size), corner, int(margin)
        self.pattern_spec = pattern if isinstance(pattern, str) else "custom"
        self._custom = None if isinstance(pattern, str) else torch.as_tensor(pattern, dtype=torch.float32)
        if self.pattern_spec not in PATTERNS + ("custom",):
            raise PBEError(f"pattern must be one of {PATTERNS} or a tensor, got {pattern!r}")

    def params(self):
        return {**super().params(), "size": self.size, "pattern": self.pattern_spec, "corner": self.corner,
                "margin": self.margin}

    def _build(self, shape, generator):
        c, h, w = shape
        s = self.size
        if s + self.margin > min(h, w):
            raise PBEError(f"a {s}x{s} patch with margin {self.margin} does not fit {h}x{w} images")
        if self.pattern_spec == "checkerboard":
            ij = torch.arange(s)
            patch = ((ij[:, None] + ij[None, :]) % 2 == 0).float().expand(c, s, s)
        elif self.pattern_spec == "white":
            patch = torch.ones(c, s, s)
        elif self.pattern_spec == "random":
            patch = torch.rand(c, s, s, generator=generator)
        else:
            patch = self._custom.expand(c, s, s) if self._custom is not None else torch.zeros(c, s, s)
        self.register_buffer("patch", patch.clone())
        top = self.margin if self.corner.startswith("top") else h - s - self.margin
        left = self.margin if self.corner.endswith("left") else w - s - self.margin
        self.top, self.left = top, left

    def _trigger(self, x, train):
        x = x.clone()
        x[:, :, self.top:self.top + self.size, self.left:self.left + self.size] = self.patch
        return x
