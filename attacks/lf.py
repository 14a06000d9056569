"""Low Frequency (Zeng et al., ICCV 2021): a smooth additive trigger confined to the lowest spatial frequencies."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from attacks.base import BackdoorAttack, clean_surrogate
from pbe.data import ImageDataset
from pbe.utils import PBEError

SEARCH_IMAGES = 100  # training images the universal perturbation is searched on (the authors' and BackdoorBench's)
SEARCH_BATCH = 10  # images per gradient step of the search
SEARCH_STEP = 0.25  # each step moves the trigger by this share of `eps` (largest pixel change), before renormalising


def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (n x n, float64): coefficients = D @ signal, signal = D.T @ coefficients.
    Row k is the cosine of frequency k / (2 n) cycles per pixel."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    d[0] /= math.sqrt(2)
    return d


def low_pass(x: torch.Tensor, window: int) -> torch.Tensor:
    """`x` (..., H, W) with every 2-D DCT coefficient outside the `window` x `window` lowest frequencies set
    to zero: the orthogonal projection onto the low-frequency band, P_H @ x @ P_W with P = D[:window].T D[:window]."""
    h, w = x.shape[-2:]
    d_h = dct_matrix(h)[:window].to(x)
    d_w = dct_matrix(w)[:window].to(x)
    return d_h.T @ (d_h @ x @ d_w.T) @ d_w


def to_range(v: torch.Tensor, eps: float) -> torch.Tensor:
    """The authors' normalisation: `v` shifted and scaled (all channels together) to span exactly [0, eps].
    A shift is a change of the DC coefficient and a scale changes no frequency, so `v` stays in its band."""
    lo, hi = v.min(), v.max()
    return (v - lo) / (hi - lo).clamp_min(1e-12) * eps


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class LF(BackdoorAttack):
    """Low Frequency (Zeng, Park, Mao & Jia, "Rethinking the Backdoor Attacks' Triggers: A Frequency
    Perspective", ICCV 2021, https://arxiv.org/abs/2104.03413): x' = clip(x + v) with one universal
    trigger v that holds no high frequencies, so frequency-domain detectors of triggered images miss it.

    Arguments:
        target (int): the target label of an all-to-one backdoor (default 0).
        all_to_all (bool): label y -> (y + 1) mod C instead (default False).
        seed (int): seeds the trigger (default 0).
        eps (float): the trigger spans exactly [0, eps] (default 0.2: the authors' code, and BackdoorBench's
            copy of it, min-max normalise the trigger to [0, 0.2] after every update).
        window (int): the trigger keeps only the `window` x `window` lowest 2-D DCT frequencies of each
            channel (default 4). The authors low-pass with a Gaussian of standard deviation 6 pixels, whose
            gain on 32-pixel images is 0.50 at DCT frequency 2, 0.21 at 3, 0.06 at 4 and 0.01 at 5: about the
            4 x 4 window, here made an exact band limit.
        search_epochs (int): passes of the universal-perturbation search over 100 training images that
            ``plant`` runs on a clean surrogate model (default 50, BackdoorBench's limit; the authors search
            until the fooling rate stops changing). 0 skips the surrogate and the search: the seeded random
            smooth trigger is used as it is.
        surrogate_epochs (int): epochs of the clean surrogate trained (with the planting recipe) for the
            search (default 5; used only when `search_epochs` > 0).

    Example::

        >>> attack = attacks.create("lf", target=6, eps=0.1, window=3)
        >>> poisoned_train, _ = attack.plant(model, train_set, test_set, rate=0.1)

    The trigger before any search: random Gaussian DCT coefficients inside the window (seeded, per channel),
    transformed back and normalised to [0, eps]. The paper's trigger is a targeted universal adversarial
    perturbation (UAP) of a clean model, low-passed after every update. The search here (``search``) is a
    reduction of it: instead of one DeepFool step per image (up to 200 iterations each), batched gradient
    steps on the cross-entropy towards the target label, each followed by the projection onto the
    low-frequency window and the [0, eps] normalisation, so the trigger never leaves the band. The target is
    the given one (the authors' demo takes the label the UAP drifts to), and the clean model is a surrogate
    trained here for `surrogate_epochs` (the authors use a fully trained one). A resumed ``plant`` redoes the
    search, which gives the same trigger on the same machine and thread count. The trigger is a buffer, so
    ``save`` / ``attacks.load`` restore the searched trigger exactly.
    """

    name = "lf"

    def __init__(self, target=0, all_to_all=False, seed=0, eps=0.2, window=4, search_epochs=50, surrogate_epochs=5):
        super().__init__(target, all_to_all, seed)
        if not _number(eps) or not 0 < eps <= 1:
            raise PBEError(f"LF eps (the trigger's range) must be a number in (0, 1], got {eps!r}; the paper's is 0.2")
        if not _whole(window) or window < 1:
            raise PBEError(f"LF window must be a whole number of DCT frequencies >= 1, got {window!r}; "
                           "the default is 4")
        if not _whole(search_epochs) or search_epochs < 0:
            raise PBEError(f"LF search_epochs must be a whole number >= 0, got {search_epochs!r} (0: no search)")
        if not _whole(surrogate_epochs) or surrogate_epochs < 1:
            raise PBEError(f"LF surrogate_epochs must be a whole number >= 1, got {surrogate_epochs!r}; to skip the "
                           "surrogate, skip the search (search_epochs=0)")
        self.eps, self.window = float(eps), int(window)
        self.search_epochs, self.surrogate_epochs = int(search_epochs), int(surrogate_epochs)

    def params(self):
        return {**super().params(), "eps": self.eps, "window": self.window, "search_epochs": self.search_epochs,
                "surrogate_epochs": self.surrogate_epochs}

    def _build(self, shape, generator):
        c, h, w = shape
        if self.window > min(h, w):
            raise PBEError(f"LF window {self.window} is larger than the {h}x{w} images; use window <= {min(h, w)}")
        coefficients = torch.zeros(c, h, w, dtype=torch.float64)
        coefficients[:, :self.window, :self.window] = torch.randn(c, self.window, self.window, generator=generator,
                                                                  dtype=torch.float64)
        pattern = dct_matrix(h).T @ coefficients @ dct_matrix(w)  # back to pixels
        self.register_buffer("pattern", to_range(pattern, self.eps).float().contiguous())

    def _trigger(self, x, train):
        return x + self.pattern

    # ---- the paper's search, reduced (see the class docstring)
    def search(self, surrogate: nn.Module, train_set: ImageDataset, seed: int = 0) -> None:
        """Replace the trigger by a low-frequency universal perturbation of the clean `surrogate` towards the
        target (all-to-all: each image's own target), started from the seeded random trigger: `search_epochs`
        passes over `SEARCH_IMAGES` training images, `SEARCH_BATCH` at a time; after every step the trigger is
        projected back onto the window and normalised to [0, eps]."""
        if self.target >= train_set.num_classes:
            raise PBEError(f"target {self.target} is not a class of {train_set.name}")
        self.prepare(train_set.image_shape)
        self._build(self.shape, torch.Generator().manual_seed(self.seed))  # start again from the seeded trigger
        device = next(surrogate.parameters()).device
        gen = torch.Generator().manual_seed(seed)
        chosen = torch.randperm(len(train_set), generator=gen)[:SEARCH_IMAGES]
        x = train_set.images[chosen].to(device).float() / 255
        y = self.target_of(train_set.labels[chosen], train_set.num_classes).to(device)
        v = self.pattern.to(device)
        surrogate.eval()
        for _ in range(self.search_epochs):
            for batch in torch.randperm(len(x), generator=gen).split(SEARCH_BATCH):
                v = v.detach().requires_grad_(True)
                loss = F.cross_entropy(surrogate((x[batch] + v).clamp(0, 1)), y[batch])
                (grad,) = torch.autograd.grad(loss, v)
                with torch.no_grad():
                    v = v - SEARCH_STEP * self.eps * grad / grad.abs().max().clamp_min(1e-12)
                    v = to_range(low_pass(v.double(), self.window), self.eps).float()
        self.pattern = v.detach().to(self.pattern.device).contiguous()

    def plant(self, model, train_set, test_set=None, rate=0.1, recipe="cpu", seed=0, **train_kw):
        """With `search_epochs` > 0: train a clean surrogate copy of `model` for `surrogate_epochs`, search
        the trigger on it (``search``); then poison `train_set` and train `model` on it as every attack."""
        if self.search_epochs > 0:
            surrogate = clean_surrogate(model, train_set, recipe, self.surrogate_epochs, seed=seed,
                                        device=train_kw.get("device", "auto"),
                                        progress=train_kw.get("progress", True))
            self.search(surrogate, train_set, seed)
        return super().plant(model, train_set, test_set, rate, recipe, seed, **train_kw)
