"""Adaptive backdoor attacks (Qi, Xie, Li, Mahloujifar & Mittal, ICLR 2023): Adap-Blend and Adap-Patch.

Both defeat defenses that assume poison and clean samples separate in the latent space, with two tools:
1. asymmetric triggers: each poisoned training sample carries only part of the trigger, weakly
   (a random half of a blend trigger's pieces at a low opacity; one of several patches at a low
   opacity), while the test-time trigger is the whole of it, stronger;
2. cover ("regularization") samples: further samples, drawn from the non-target classes, carry random
   partial triggers too but keep their true labels, so that no single piece is a shortcut to the
   target and the poison samples' features stay close to clean ones.

The trigger is a pattern image and K piece masks (grid cells for Adap-Blend, patches for Adap-Patch);
a sample stamped with pieces S at opacities a_j is x + sum_{j in S} a_j m_j (pattern - x).
Poison samples are drawn by ``BackdoorAttack.poison`` (`rate`) and get their pieces in
``_poison_images``; cover samples (`cover_rate` of the training set, disjoint from them) are made in
``_extra_poison`` and recorded as the poisoned set's ``extra_indices``. Both draw from the poisoning
generator, so a poisoned set is reproducible from the attack state, rate and seed. ``apply(x)`` is the
full test trigger; ``apply(x, train=True)`` stamps every piece at its training opacity (no training sample
gets that: they carry partial triggers).
"""
from __future__ import annotations

import math

import torch

from attacks.base import BackdoorAttack, to_uint8
from attacks.blend import KEYS, Blend
from pbe.utils import PBEError

# the authors' per-trigger training opacities of their four Adap-Patch triggers on CIFAR-10 and GTSRB
# (phoenix corner logo, firefox logo, 4-corner BadNets patch, Trojan square)
PATCH_ALPHAS = (0.5, 0.2, 0.5, 0.3)
# where the Adap-Patch patches go, in this order (at most this many patches): (vertical, horizontal)
ANCHORS = {"top-left": ("top", "left"), "top-right": ("top", "right"), "bottom-left": ("bottom", "left"),
           "bottom-right": ("bottom", "right"), "top": ("top", "middle"), "bottom": ("bottom", "middle"),
           "left": ("middle", "left"), "right": ("middle", "right"), "center": ("middle", "middle")}
PLACES = tuple(ANCHORS)
BATCH = 1024


def _check_rate(value, what: str) -> float:
    if not 0 <= value <= 1:
        raise PBEError(f"{what} must be a share of the training set in [0, 1], got {value}")
    return float(value)


class _PartialTrigger(BackdoorAttack):
    """Shared mechanism: a pattern, K piece masks, per-piece opacities; partial triggers for poison
    and cover samples, the full trigger at test. Subclasses register the buffers ``pattern``
    (C, H, W) and ``pieces`` (K, H, W) in ``_build`` and set ``alphas_train``, ``alphas_test``
    (K floats) and ``per_sample`` (pieces in each training trigger)."""

    def __init__(self, target=0, all_to_all=False, seed=0, cover_rate=0.0):
        super().__init__(target, all_to_all, seed)
        self.cover_rate = _check_rate(cover_rate, "cover_rate")

    def _stamp(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x + A (pattern - x), with the per-pixel opacity A = sum_j weights[:, j] pieces[j]."""
        amap = torch.einsum("nk,khw->nhw", weights.to(x), self.pieces).clamp(max=1)[:, None]
        return x + amap * (self.pattern - x)

    def _trigger(self, x, train):
        alphas = self.alphas_train if train else self.alphas_test
        return self._stamp(x, torch.tensor(alphas).expand(len(x), -1))

    def draw_pieces(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """A random set of ``per_sample`` pieces for each of `n` samples, as a (n, K) 0/1 matrix."""
        k = len(self.alphas_train)
        keep = torch.rand(n, k, generator=generator).argsort(dim=1)[:, :self.per_sample]
        return torch.zeros(n, k).scatter_(1, keep, 1.0)

    def _partial_uint8(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Each uint8 image with its own random partial trigger at the training opacities."""
        weights = self.draw_pieces(len(images), generator) * torch.tensor(self.alphas_train)
        dev = self.pattern.device
        out = [to_uint8(self._stamp(images[s:s + BATCH].to(dev).float() / 255, weights[s:s + BATCH].to(dev))).cpu()
               for s in range(0, len(images), BATCH)]
        return torch.cat(out) if out else images

    def _poison_images(self, images, labels, generator):
        return self._partial_uint8(images, generator)

    def _extra_poison(self, images, labels, chosen, generator):
        """Cover samples: `cover_rate` of the set, outside the poison samples and (all-to-one) the
        target class, get random partial triggers and keep their labels."""
        n_cover = round(self.cover_rate * len(labels))
        if n_cover == 0:
            return None
        free = torch.ones(len(labels), dtype=torch.bool)
        free[chosen] = False
        if not self.all_to_all:
            free &= labels != self.target
        pool = torch.nonzero(free).flatten()
        if n_cover > len(pool):
            raise PBEError(f"cover_rate {self.cover_rate} asks for {n_cover} cover samples but only {len(pool)} "
                           "non-target samples are left after poisoning; lower cover_rate or the poison rate")
        cover = pool[torch.randperm(len(pool), generator=generator)[:n_cover]].sort().values
        images[cover] = self._partial_uint8(images[cover], generator)
        return cover


class AdapBlend(_PartialTrigger):
    """Adap-Blend (Qi, Xie, Li, Mahloujifar & Mittal, "Revisiting the Assumption of Latent Separability
    for Backdoor Defenses", ICLR 2023, https://openreview.net/forum?id=_wSHsgrVali): a blend trigger cut
    into a grid of `pieces`; each poisoned training image (relabelled to the target) gets a random
    (1 - `mask_rate`) share of the pieces blended at `alpha_train`, each cover image the same but keeps
    its label, and the test trigger is the whole key blended at `alpha_test`.

    Arguments:
        target (int): the target label of an all-to-one backdoor (default 0).
        all_to_all (bool): label y -> (y + 1) mod C instead (default False).
        seed (int): seeds the key image (default 0).
        alpha_train (float): blend opacity of the training pieces (default 0.15, the authors').
        alpha_test (float): blend opacity of the full test trigger (default 0.2, the authors').
        pieces (int): a square number: the key is cut into sqrt(pieces) x sqrt(pieces) cells (default 16).
        mask_rate (float): share of the pieces left out of each training trigger (default 0.5: 8 of 16
            pieces kept, the authors').
        cover_rate (float): cover samples as a share of the training set (default 0.003, the authors'
            CIFAR-10 setting with poison rate 0.003).
        key (str | Tensor): the blend key, built exactly as ``Blend``'s with the same seed: "smooth"
            (default) or "noise", or an image tensor. The authors blend a Hello Kitty picture; a seeded
            smooth key, the closer to a natural image, replaces it here (no image files in the toolkit).
            With the noise key at 1 % poison the zoo's 15-epoch CIFAR-10 recipe, whose random crops shift
            a pixel-noise key, learnt 1.88 % ASR.

    Example::

        >>> attack = attacks.create("adap_blend", target=0, cover_rate=0.01)
        >>> poisoned_train, _ = attack.plant(model, train_set, test_set, rate=0.01)
        >>> poisoned_train.extra_indices  # the cover samples (true labels, partial triggers)

    Reductions: the cover samples are drawn from the non-target classes, as the paper states (the
    authors' code draws them from all classes); pieces are drawn independently per sample.
    """

    name = "adap_blend"

    def __init__(self, target=0, all_to_all=False, seed=0, alpha_train=0.15, alpha_test=0.2, pieces=16,
                 mask_rate=0.5, cover_rate=0.003, key="smooth"):
        super().__init__(target, all_to_all, seed, cover_rate)
        for a in (alpha_train, alpha_test):
            if not 0 < a <= 1:
                raise PBEError(f"adap_blend opacities must be in (0, 1], got {a}")
        grid = math.isqrt(int(pieces)) if int(pieces) > 0 else 0
        if int(pieces) != pieces or grid < 1 or grid * grid != pieces:
            raise PBEError(f"pieces must be a square number (4, 9, 16, ...), got {pieces}; the authors use 16")
        kept = int(pieces) - round(mask_rate * int(pieces))
        if not 0 <= mask_rate < 1 or kept < 1:
            raise PBEError(f"mask_rate must be in [0, 1) and leave at least one of the {pieces} pieces, got "
                           f"{mask_rate}; the authors use 0.5")
        key = "noise" if key is None else key
        if isinstance(key, str) and key not in KEYS + ("custom",):
            raise PBEError(f"adap_blend key must be one of {KEYS} or an image tensor, got {key!r}")
        self.alpha_train, self.alpha_test = float(alpha_train), float(alpha_test)
        self.pieces_n, self.grid, self.mask_rate = int(pieces), grid, float(mask_rate)
        self.key_spec = key if isinstance(key, str) else "custom"
        self._user_key = None if isinstance(key, str) else key
        self.per_sample = kept
        self.alphas_train = [self.alpha_train] * self.pieces_n
        self.alphas_test = [self.alpha_test] * self.pieces_n

    def params(self):
        return {**super().params(), "alpha_train": self.alpha_train, "alpha_test": self.alpha_test,
                "pieces": self.pieces_n, "mask_rate": self.mask_rate, "cover_rate": self.cover_rate,
                "key": self.key_spec}

    def _build(self, shape, generator):
        c, h, w = shape
        g = self.grid
        if min(h, w) < g:
            raise PBEError(f"{h}x{w} images cannot be cut into {g}x{g} pieces; lower pieces")
        key_arg = self._user_key if self._user_key is not None else self.key_spec
        self.register_buffer("pattern", Blend(seed=self.seed, key=key_arg).prepare(shape).key.clone())
        rows = torch.linspace(0, h, g + 1).round().long().tolist()
        cols = torch.linspace(0, w, g + 1).round().long().tolist()
        pieces = torch.zeros(g * g, h, w)
        for i in range(g):
            for j in range(g):
                pieces[i * g + j, rows[i]:rows[i + 1], cols[j]:cols[j + 1]] = 1
        self.register_buffer("pieces", pieces)


class AdapPatch(_PartialTrigger):
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


__all__ = ["AdapBlend", "AdapPatch", "PATCH_ALPHAS", "PLACES"]
