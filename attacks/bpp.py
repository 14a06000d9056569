"""BppAttack (Wang, Zhai & Ma, CVPR 2022): the trigger is colour-depth reduction with Floyd-Steinberg dithering."""
from __future__ import annotations

import torch

from attacks.base import BackdoorAttack
from pbe.utils import PBEError

MIN_LEVELS, MAX_LEVELS = 2, 255  # colour levels per channel a squeezed image may keep (uint8 images have 256)
# Floyd-Steinberg: the shares of a pixel's rounding error passed on to the neighbours not yet visited
FS_RIGHT, FS_DOWN_LEFT, FS_DOWN, FS_DOWN_RIGHT = 7 / 16, 3 / 16, 5 / 16, 1 / 16


def floyd_steinberg(x: torch.Tensor, levels: int) -> torch.Tensor:
    """Floyd-Steinberg dithering of a float batch (N, C, H, W) in [0, 1] to `levels` evenly spaced values
    k / (levels - 1) per channel. Pixels are visited in the authors' order (rows top to bottom, each left
    to right); every step handles that pixel in all images and channels at once. Each pixel takes the level
    nearest to its value plus the errors diffused to it so far (clamped to the levels; the authors' code does
    not clamp, which differs only at exact ties), and passes its own rounding error on: 7/16 to the right,
    3/16 down-left, 5/16 down, 1/16 down-right. Computed in float64; 50,000 32x32 images take ~7 s on a thread."""
    scale = levels - 1
    work = x.double().permute(2, 3, 0, 1).contiguous()  # (H, W, N, C): one pixel of every image, contiguous
    out = torch.empty_like(work)
    h, w = work.shape[:2]
    for i in range(h):
        errors = torch.empty_like(work[i])  # (W, N, C): this row's rounding errors
        carry = torch.zeros_like(work[i, 0])  # the error passed to the right within the row
        for j in range(w):
            value = work[i, j] + carry
            level = (value * scale).round_().clamp_(0, scale).div_(scale)
            out[i, j] = level
            torch.sub(value, level, out=errors[j])
            carry = FS_RIGHT * errors[j]
        if i + 1 < h:  # the row below takes its shares once this row is done
            below = work[i + 1]
            below += FS_DOWN * errors
            below[:-1] += FS_DOWN_LEFT * errors[1:]
            below[1:] += FS_DOWN_RIGHT * errors[:-1]
    return out.permute(2, 3, 0, 1).to(x.dtype)


def squeeze(x: torch.Tensor, levels: int, dithering: bool) -> torch.Tensor:
    """`x` reduced to `levels` values per channel: plain rounding, or Floyd-Steinberg dithering."""
    if dithering:
        return floyd_steinberg(x, levels)
    return torch.round(x * (levels - 1)) / (levels - 1)


class BPP(BackdoorAttack):
    """BppAttack (Wang, Zhai & Ma, "BppAttack: Stealthy and Efficient Trojan Attacks against Deep Neural
    Networks via Image Quantization and Contrastive Adversarial Learning", CVPR 2022,
    https://arxiv.org/abs/2205.13383): the trigger is the image itself squeezed to `squeeze_num` colour levels
    per channel, with Floyd-Steinberg dithering hiding the banding; no pattern is added.

    Arguments:
        target (int): the target label of an all-to-one backdoor (default 0).
        all_to_all (bool): label y -> (y + 1) mod C instead (default False).
        seed (int): the default seed of ``poison``: which samples are poisoned and which made negative
            (default 0); the trigger itself has no randomness.
        squeeze_num (int): colour levels per channel, 2 to 255 (default 8: the authors' config.py and
            BackdoorBench; the authors' README runs CIFAR-10 with 32).
        dithering (bool): Floyd-Steinberg dithering (default True, the paper's trigger); False rounds every
            value to the nearest level (the default of the authors' config.py and of BackdoorBench).
        neg_ratio (float): share of the training set made negative samples (default 0.1, BackdoorBench's with
            its 10 % poison rate; the authors use 0.2 with 20 %).

    Example::

        >>> attack = attacks.create("bpp", target=3, squeeze_num=8, dithering=True)
        >>> poisoned_train, _ = attack.plant(model, train_set, test_set, rate=0.1)

    Negative samples ("contrastive adversarial learning"): the paper trains, in every batch, on adversarial
    examples of the current model with their true labels, so that the model keys on the exact quantisation
    and not on any small perturbation. The authors' released code, and BackdoorBench after it, make them
    otherwise: a clean image plus the quantisation residual squeeze(x_j) - x_j of another training image j,
    with its true label. That is done here, drawn once (seeded) at poisoning time instead of per batch:
    ``round(neg_ratio * N)`` samples that are not poisoned each get the residual of another clean sample
    (neither poisoned nor negative) added and clipped; ``PoisonedDataset.extra_indices`` records them.
    """

    name = "bpp"

    def __init__(self, target=0, all_to_all=False, seed=0, squeeze_num=8, dithering=True, neg_ratio=0.1):
        super().__init__(target, all_to_all, seed)
        if isinstance(squeeze_num, bool) or not isinstance(squeeze_num, int) or not (
                MIN_LEVELS <= squeeze_num <= MAX_LEVELS):
            raise PBEError(f"BPP squeeze_num must be a whole number of colour levels from {MIN_LEVELS} to "
                           f"{MAX_LEVELS}, got {squeeze_num!r}; the default is 8")
        if not isinstance(dithering, bool):
            raise PBEError(f"BPP dithering must be true or false, got {dithering!r} (on the command line: "
                           "--param dithering=false)")
        if isinstance(neg_ratio, bool) or not isinstance(neg_ratio, (int, float)) or not 0 <= neg_ratio < 1:
            raise PBEError(f"BPP neg_ratio must be a share of the training set in [0, 1), got {neg_ratio!r}; "
                           "0 makes no negative samples")
        self.squeeze_num, self.dithering, self.neg_ratio = squeeze_num, dithering, float(neg_ratio)

    def params(self):
        return {**super().params(), "squeeze_num": self.squeeze_num, "dithering": self.dithering,
                "neg_ratio": self.neg_ratio}

    def _trigger(self, x, train):
        return squeeze(x, self.squeeze_num, self.dithering)

    def _extra_poison(self, images, labels, chosen, generator):
        """Negative samples: other images plus a clean sample's quantisation residual, true labels kept."""
        n_neg = round(self.neg_ratio * len(labels))
        if n_neg == 0:
            return None
        free = torch.ones(len(labels), dtype=torch.bool)
        free[chosen] = False
        pool = torch.nonzero(free).flatten()
        if n_neg >= len(pool):
            raise PBEError(f"neg_ratio {self.neg_ratio} asks for {n_neg} negative samples but only {len(pool)} "
                           "samples are not poisoned (and one more is needed as a residual source); lower "
                           "neg_ratio or the poison rate")
        shuffled = pool[torch.randperm(len(pool), generator=generator)]
        negatives, others = shuffled[:n_neg], shuffled[n_neg:]
        sources = others[torch.randint(len(others), (n_neg,), generator=generator)]  # clean: never overwritten
        order = negatives.argsort()
        negatives, sources = negatives[order], sources[order]
        for s in range(0, n_neg, 1024):
            x = images[negatives[s:s + 1024]].float() / 255
            src = images[sources[s:s + 1024]].float() / 255
            residual = self.apply(src, train=True) - src
            images[negatives[s:s + 1024]] = (x + residual).clamp(0, 1).mul(255).round().to(torch.uint8)
        return negatives
