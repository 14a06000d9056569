"""Adap-Blend (Qi, Xie, Li, Mahloujifar & Mittal, ICLR 2023): a blend trigger cut into pieces, partial on the poison
and on cover samples that keep their labels, whole at test (``attacks/partial_trigger.py``: the shared mechanism)."""
from __future__ import annotations

import math

import torch

from attacks.blend import KEYS, Blend
from attacks.partial_trigger import PartialTrigger
from pbe.utils import PBEError


class AdapBlend(PartialTrigger):
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


__all__ = ["AdapBlend"]
