"""WaNet (Nguyen & Tran, ICLR 2021): an imperceptible, fixed smooth warp of the image."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attacks.base import BackdoorAttack
from pbe.utils import PBEError


class WaNet(BackdoorAttack):
    """WaNet (Nguyen & Tran, ICLR 2021, https://arxiv.org/abs/2102.10369): a fixed smooth warp from a
    k x k grid of uniform noise normalised by its mean absolute value, upsampled bicubically, scaled by
    strength `s` / image size, times `grid_rescale`.

    Arguments:
        target (int): the target label of an all-to-one backdoor (default 0).
        all_to_all (bool): label y -> (y + 1) mod C instead (default False).
        seed (int): seeds the trigger (default 0).
        k (int): control grid size (default 4, the paper's).
        s (float): warp strength (default 0.5).
        grid_rescale (float): default 1.0.
        cross_ratio (float): noise-mode samples per poisoned sample (default 2.0).

    Example::

        >>> attack = attacks.create("wanet", target=9, k=8)
        >>> poisoned_train, _ = attack.plant(model, train_set, test_set, rate=0.1)

    Noise mode: ``cross_ratio`` x (number poisoned) further samples get the field plus a random
    per-sample perturbation and keep their true label, so the model learns the exact warp only.
    The paper draws that noise per batch; here it is drawn once at poisoning time (seeded).
    """

    name = "wanet"

    def __init__(self, target=0, all_to_all=False, seed=0, k=4, s=0.5, grid_rescale=1.0, cross_ratio=2.0):
        super().__init__(target, all_to_all, seed)
        if int(k) < 2 or s < 0 or cross_ratio < 0:
            raise PBEError(f"WaNet needs k >= 2, s >= 0, cross_ratio >= 0; got k={k}, s={s}, cross_ratio={cross_ratio}")
        self.k, self.s, self.grid_rescale, self.cross_ratio = int(k), float(s), float(grid_rescale), float(cross_ratio)

    def params(self):
        return {**super().params(), "k": self.k, "s": self.s, "grid_rescale": self.grid_rescale,
                "cross_ratio": self.cross_ratio}

    def _build(self, shape, generator):
        _, h, w = shape
        ins = torch.rand(1, 2, self.k, self.k, generator=generator) * 2 - 1
        ins = ins / ins.abs().mean()
        noise = F.interpolate(ins, size=(h, w), mode="bicubic", align_corners=True).permute(0, 2, 3, 1)
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij")
        identity = torch.stack((xs, ys), dim=2)[None]  # grid_sample wants (x, y)
        scale = torch.tensor([1.0 / w, 1.0 / h])
        grid = ((identity + self.s * noise * scale) * self.grid_rescale).clamp(-1, 1)
        self.register_buffer("grid", grid.contiguous())

    def warp(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return F.grid_sample(x, grid.expand(len(x), -1, -1, -1), mode="bilinear",
                             padding_mode="zeros", align_corners=True)

    def _trigger(self, x, train):
        return self.warp(x, self.grid)

    def _extra_poison(self, images, labels, chosen, generator):
        """Noise mode: warp other samples with a randomly perturbed field, keeping their labels."""
        n_extra = round(self.cross_ratio * len(chosen))
        if n_extra == 0:
            return None
        free = torch.ones(len(labels), dtype=torch.bool)
        free[chosen] = False
        pool = torch.nonzero(free).flatten()
        extra = pool[torch.randperm(len(pool), generator=generator)[:n_extra]].sort().values
        _, h, w = self.shape
        scale = torch.tensor([1.0 / w, 1.0 / h])
        for s in range(0, len(extra), 1024):
            idx = extra[s:s + 1024]
            jitter = (torch.rand(len(idx), h, w, 2, generator=generator) * 2 - 1) * scale
            grid = (self.grid.cpu() + jitter).clamp(-1, 1)
            x = images[idx].float() / 255
            images[idx] = self.warp(x, grid).clamp(0, 1).mul(255).round().to(torch.uint8)
        return extra
