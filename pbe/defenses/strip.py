"""STRIP: strong intentional perturbation (Gao et al., ACSAC 2019).

A triggered input keeps its (target) prediction when blended with other images, so the entropy of
its predictions over `n` superimpositions (x + x_other, clipped to [0, 1], as the paper's additive
overlay) stays low. Score = minus the mean entropy. The paper sets the boundary from clean inputs'
entropies, modelled as a normal distribution, at a false rejection rate `frr`; with no clean data,
the normal is fitted robustly (median, 1.4826 * MAD) to the training set's own entropies, whose
majority is clean, and samples below median - z(frr) * sigma are flagged.

Defaults from the paper: n = 100 overlays, frr 1%; then retraining on the kept samples.
"""
from __future__ import annotations

from statistics import NormalDist

import torch
from tqdm.auto import tqdm

from pbe.defenses.base import Context, Stage
from pbe.defenses.filtering import RETRAIN_RECIPE, FilteringDefense
from pbe.utils import PBEError


@torch.no_grad()
def overlay_entropy(model, images: torch.Tensor, pool: torch.Tensor, n: int, ctx: Context,
                    batch_size: int = 256) -> torch.Tensor:
    """Mean prediction entropy of each image over `n` additive overlays drawn from `pool` (a `Stage` over
    the batches: at the paper's 100 overlays a CIFAR-10 training set takes hours on a CPU)."""
    model.eval()
    out = torch.zeros(len(images))
    starts = range(0, len(images), batch_size)
    stage = Stage(ctx, len(starts), data=images, tensors={"entropy": out})
    for i in tqdm(range(stage.first, len(starts)), desc="STRIP", disable=not ctx.progress, leave=False):
        x = images[starts[i]:starts[i] + batch_size].to(ctx.device).float().div_(255)
        total = torch.zeros(len(x), device=ctx.device)
        for _ in range(n):
            other = pool[torch.randint(len(pool), (len(x),), generator=ctx.gen)].to(ctx.device).float().div_(255)
            prob = model((x + other).clamp_(0, 1)).softmax(1)
            total -= (prob * prob.clamp_min(1e-12).log()).sum(1)
        out[starts[i]:starts[i] + len(x)] = (total / n).cpu()
        ctx.cost.forward += n * len(x)
        stage.done(i + 1)
    return out


class STRIP(FilteringDefense):
    """STRIP (Gao et al., ACSAC 2019, https://arxiv.org/abs/1902.06531): a triggered input keeps its
    prediction under superimposed images, so its prediction entropy stays low.

    Arguments:
        n (int): superimpositions per sample (default 100).
        frr (float): false rejection rate that sets the entropy boundary (default 0.01).
        retrain, retrain_epochs: what to do with the kept samples, as every
            :class:`~pbe.defenses.filtering.FilteringDefense` (defaults "cpu", None).

    Example::

        >>> result = pbe.defenses.create("strip", retrain=None)(model, poisoned_train_set)
    """

    name = "strip"

    def __init__(self, n: int = 100, frr: float = 0.01, retrain: str | None = RETRAIN_RECIPE,
                 retrain_epochs: int | None = None):
        super().__init__(n=n, frr=frr, retrain=retrain, retrain_epochs=retrain_epochs)

    def _check(self):
        if not 0 < self.params["frr"] < 0.5 or self.params["n"] < 1:
            raise PBEError("strip: frr must be in (0, 0.5) and n >= 1")

    def score_and_flag(self, model, data, ctx: Context):
        entropy = overlay_entropy(model, data.images, data.images, self.params["n"], ctx)
        median = entropy.median()
        sigma = 1.4826 * (entropy - median).abs().median()
        boundary = median - NormalDist().inv_cdf(1 - self.params["frr"]) * sigma
        return -entropy, entropy < boundary, {"entropy_median": float(median), "entropy_sigma": float(sigma),
                                              "boundary": float(boundary)}
