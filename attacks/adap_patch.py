"""Adap-Patch (Qi, Xie, Li, Mahloujifar & Mittal, ICLR 2023): several patch triggers, one of them (weakly) on each
poison and cover sample, all of them at test (``attacks/partial_trigger.py``: the shared mechanism)."""
from __future__ import annotations

import torch

from attacks.partial_trigger import PartialTrigger
from pbe.utils import PBEError

# the authors' per-trigger training opacities of their four Adap-Patch triggers on CIFAR-10 and GTSRB
# (phoenix corner logo, firefox logo, 4-corner BadNets patch, Trojan square)
PATCH_ALPHAS = (0.5, 0.2, 0.5, 0.3)
# where the Adap-Patch patches go, in this order (at most this many patches): (vertical, horizontal)
ANCHORS = {"top-left": ("top", "left"), "top-right": ("top", "right"), "bottom-left": ("bottom", "left"),
           "bottom-right": ("bottom", "right"), "top": ("top", "middle"), "bottom": ("bottom", "middle"),
           "left": ("middle", "left"), "right": ("middle", "right"), "center": ("middle", "middle")}
PLACES = tuple(ANCHORS)


class AdapPatch(PartialTrigger):
    """Adap-Patch (Qi, Xie, Li, Mahloujifar & Mittal, "Revisiting the Assumption of Latent Separability
    for Backdoor Defenses", ICLR 2023, https://openreview.net/forum?id=_wSHsgrVali): `patches` distinct
    seeded patch triggers at distinct places; each poisoned training image (relabelled to the target)
    gets `train_patches` of them, drawn at random, at their low training opacities, each cover image the
    same but keeps its label, and the test trigger stamps all of them at `alpha_test`.

    Arguments:
        target (int): the target label of an all-to-one backdoor (default 0).
        all_to_all (bool): label y -> (y + 1) mod C instead (default False).
        seed (int): seeds the patch patterns (default 0).
        patches (int): number of patch triggers, placed in the order of ``PLACES`` (corners first;
            default 4, the authors').
        size (int | None): patch side in pixels (default None: 5/32 of the shorter image side, at least
            2, so 5 on 32x32, the authors' corner logo).
        alpha_train (float | list): training opacity, one for all patches or one per patch (default None:
            the authors' (0.5, 0.2, 0.5, 0.3), repeated for more than four patches).
        alpha_test (float): opacity of every patch in the test trigger (default 1.0, the authors').
        train_patches (int): patches stamped on each training sample (default 1, the authors').
        cover_rate (float): cover samples as a share of the training set (default 0.006, the authors'
            CIFAR-10 setting with poison rate 0.003).

    Example::

        >>> attack = attacks.create("adap_patch", target=0, cover_rate=0.02)
        >>> poisoned_train, _ = attack.plant(model, train_set, test_set, rate=0.01)
        >>> poisoned_train.extra_indices  # the cover samples (true labels, one weak patch each)

    Reductions: the authors' four triggers are pictures (two logos, a 4-corner BadNets patch, a Trojan
    square) of different sizes; here they are seeded random black/white-per-channel squares of one size.
    Their CIFAR-10 test trigger stamps two of them at full opacity; here all of them. They split the
    poison (and cover) samples evenly among the triggers; here each sample draws its own at random. Cover
    samples come from the non-target classes, as the paper states.
    """

    name = "adap_patch"

    def __init__(self, target=0, all_to_all=False, seed=0, patches=4, size=None, alpha_train=None, alpha_test=1.0,
                 train_patches=1, cover_rate=0.006):
        super().__init__(target, all_to_all, seed, cover_rate)
        if int(patches) != patches or not 1 <= patches <= len(PLACES):
            raise PBEError(f"patches must be an integer from 1 to {len(PLACES)} (one per place in {PLACES}), "
                           f"got {patches}")
        self.patches = int(patches)
        if size is not None and (int(size) != size or size < 1):
            raise PBEError(f"patch size must be an integer >= 1 or None (5/32 of the image side), got {size}")
        self.size = None if size is None else int(size)
        if alpha_train is None:
            alpha_train = [PATCH_ALPHAS[i % len(PATCH_ALPHAS)] for i in range(self.patches)]
        elif isinstance(alpha_train, (int, float)):
            alpha_train = [alpha_train] * self.patches
        alpha_train = [float(a) for a in alpha_train]
        if len(alpha_train) != self.patches:
            raise PBEError(f"alpha_train must be one opacity or one per patch ({self.patches}), got {alpha_train}")
        for a in alpha_train + [alpha_test]:
            if not 0 < a <= 1:
                raise PBEError(f"adap_patch opacities must be in (0, 1], got {a}")
        if int(train_patches) != train_patches or not 1 <= train_patches <= self.patches:
            raise PBEError(f"train_patches must be an integer from 1 to patches ({self.patches}), got "
                           f"{train_patches}; the authors use 1")
        self.alpha_train, self.alpha_test = alpha_train, float(alpha_test)
        self.per_sample = int(train_patches)
        self.alphas_train = self.alpha_train
        self.alphas_test = [self.alpha_test] * self.patches

    def params(self):
        return {**super().params(), "patches": self.patches, "size": self.size, "alpha_train": self.alpha_train,
                "alpha_test": self.alpha_test, "train_patches": self.per_sample, "cover_rate": self.cover_rate}

    def _build(self, shape, generator):
        c, h, w = shape
        s = self.size or max(2, round(min(h, w) * 5 / 32))
        if s > min(h, w):
            raise PBEError(f"a {s}x{s} patch does not fit {h}x{w} images; lower size")
        rows = {"top": 0, "bottom": h - s, "middle": (h - s) // 2}
        cols = {"left": 0, "right": w - s, "middle": (w - s) // 2}
        pattern, pieces = torch.zeros(c, h, w), torch.zeros(self.patches, h, w)
        for i, place in enumerate(PLACES[:self.patches]):
            vertical, horizontal = ANCHORS[place]
            top, left = rows[vertical], cols[horizontal]
            pieces[i, top:top + s, left:left + s] = 1
            pattern[:, top:top + s, left:left + s] = torch.randint(0, 2, (c, s, s), generator=generator).float()
        if pieces.sum(0).max() > 1:
            raise PBEError(f"{self.patches} patches of {s}x{s} pixels overlap on {h}x{w} images; lower size or "
                           "patches")
        self.register_buffer("pattern", pattern)
        self.register_buffer("pieces", pieces)


__all__ = ["AdapPatch", "PATCH_ALPHAS", "PLACES"]
