"""SS: spectral signatures (Tran, Li & Madry, NeurIPS 2018).

Per training label, centre the penultimate representations and project them on their top singular
vector; poisoned samples carry a strong shared direction and get large squared projections. The
top 1.5 * eps share of each label is removed (eps: the assumed poison rate).

Defaults from BackdoorBench ``config/defense/spectral/cifar10.yaml``: percentile 85 (= remove
1.5 * 0.1 of each label), then retraining on the kept samples.
"""
from __future__ import annotations

import torch

from pbe.defenses.base import Context
from pbe.models import penultimate
from pbe.defenses.filtering import RETRAIN_RECIPE, FilteringDefense
from pbe.utils import PBEError


class SpectralSignatures(FilteringDefense):
    """Spectral signatures (Tran, Li & Madry, NeurIPS 2018, https://arxiv.org/abs/1811.00636): per label,
    the largest projections on the top singular vector of the centred representations are the poison.

    Arguments:
        percentile (float): keep each label's samples below this percentile of the score (default 85.0).
        retrain, retrain_epochs: what to do with the kept samples, as every
            :class:`~pbe.defenses.filtering.FilteringDefense` (defaults "cpu", None).

    Example::

        >>> result = pbe.defenses.create("ss", retrain=None)(model, poisoned_train_set)
    """

    name = "ss"

    def __init__(self, percentile: float = 85.0, retrain: str | None = RETRAIN_RECIPE,
                 retrain_epochs: int | None = None):
        super().__init__(percentile=percentile, retrain=retrain, retrain_epochs=retrain_epochs)

    def _check(self):
        if not 0 < self.params["percentile"] < 100:
            raise PBEError("ss: percentile must be in (0, 100)")

    def score_and_flag(self, model, data, ctx: Context):
        feats = penultimate(model, data.images, device=ctx.device)
        ctx.cost.forward += len(data)
        scores = torch.zeros(len(data))
        flagged = torch.zeros(len(data), dtype=torch.bool)
        for c in range(data.num_classes):
            idx = (data.labels == c).nonzero().flatten()
            if len(idx) < 2:
                continue
            centred = feats[idx] - feats[idx].mean(0)
            top = torch.linalg.svd(centred, full_matrices=False).Vh[0]
            s = (centred @ top).pow(2)
            scores[idx] = s
            flagged[idx[s > torch.quantile(s, self.params["percentile"] / 100)]] = True
        return scores, flagged, {}
