"""The mechanism of the adaptive attacks (Qi, Xie, Li, Mahloujifar & Mittal, ICLR 2023), shared by Adap-Blend
(``attacks/adap_blend.py``) and Adap-Patch (``attacks/adap_patch.py``).

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

import torch

from attacks.base import BackdoorAttack, to_uint8
from pbe.utils import PBEError

BATCH = 1024


def check_rate(value, what: str) -> float:
    if not 0 <= value <= 1:
        raise PBEError(f"{what} must be a share of the training set in [0, 1], got {value}")
    return float(value)


class PartialTrigger(BackdoorAttack):
    """Shared mechanism: a pattern, K piece masks, per-piece opacities; partial triggers for poison
    and cover samples, the full trigger at test. Subclasses register the buffers ``pattern``
    (C, H, W) and ``pieces`` (K, H, W) in ``_build`` and set ``alphas_train``, ``alphas_test``
    (K floats) and ``per_sample`` (pieces in each training trigger)."""

    def __init__(self, target=0, all_to_all=False, seed=0, cover_rate=0.0):
        super().__init__(target, all_to_all, seed)
        self.cover_rate = check_rate(cover_rate, "cover_rate")

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


__all__ = ["PartialTrigger", "check_rate"]
