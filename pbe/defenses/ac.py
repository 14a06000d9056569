"""AC: activation clustering (Chen et al., SafeAI@AAAI 2019).

Per training label, the penultimate activations are reduced to 10 dimensions with independent
component analysis and split in two by k-means; poisoned samples, which reach the label through the
trigger, form a separate cluster. "Smaller" analysis (BackdoorBench's default): the smaller cluster
is flagged when it holds at most `size_threshold` (35%, the paper's relative-size threshold) of its
label. Score of a sample: how much nearer it is to the smaller cluster's centre than to the larger's
(for ranking).

Defaults from BackdoorBench ``config/defense/ac/cifar10.yaml``: nb_dims 10, nb_clusters 2,
cluster_analysis "smaller"; then retraining on the kept samples.
"""
from __future__ import annotations

import numpy as np
import torch

from pbe.defenses.base import Context
from pbe.models import penultimate
from pbe.defenses.filtering import RETRAIN_RECIPE, FilteringDefense


class ActivationClustering(FilteringDefense):
    """Activation clustering (Chen et al., SafeAI@AAAI 2019, https://arxiv.org/abs/1811.03728): per label,
    two k-means clusters of ICA-reduced penultimate activations; the small one is the poison.

    Arguments:
        nb_dims (int): ICA dimensions (default 10).
        size_threshold (float): flag the smaller cluster when it holds at most this share (default 0.35).
        retrain (str | None): recipe of ``pbe.train`` to retrain on the kept samples (default "cpu";
            None: return the infected model with the flagged indices).
        retrain_epochs (int | None): override the recipe's epochs (default None).

    Example::

        >>> result = pbe.defenses.create("ac", retrain=None)(model, poisoned_train_set)
        >>> result.suspected  # flagged training indices
    """

    name = "ac"

    def __init__(self, nb_dims: int = 10, size_threshold: float = 0.35, retrain: str | None = RETRAIN_RECIPE,
                 retrain_epochs: int | None = None):
        super().__init__(nb_dims=nb_dims, size_threshold=size_threshold, retrain=retrain,
                         retrain_epochs=retrain_epochs)

    def score_and_flag(self, model, data, ctx: Context):
        from sklearn.cluster import KMeans
        from sklearn.decomposition import FastICA
        feats = penultimate(model, data.images, device=ctx.device).numpy()
        ctx.cost.forward += len(data)
        scores = np.zeros(len(data))
        flagged = np.zeros(len(data), dtype=bool)
        shares = {}
        for c in range(data.num_classes):
            idx = (data.labels == c).nonzero().flatten().numpy()
            if len(idx) < 4:
                continue
            dims = min(self.params["nb_dims"], feats.shape[1], len(idx) - 1)
            reduced = FastICA(n_components=dims, random_state=ctx.seed, max_iter=1000, tol=1e-3,
                              whiten="unit-variance").fit_transform(feats[idx])
            km = KMeans(n_clusters=2, n_init=10, random_state=ctx.seed).fit(reduced)
            sizes = np.bincount(km.labels_, minlength=2)
            small = int(sizes.argmin())
            dist = np.linalg.norm(reduced[:, None, :] - km.cluster_centers_[None], axis=2)
            scores[idx] = dist[:, 1 - small] - dist[:, small]
            shares[c] = round(float(sizes[small] / len(idx)), 4)
            if shares[c] <= self.params["size_threshold"]:
                flagged[idx[km.labels_ == small]] = True
        return torch.from_numpy(scores).float(), torch.from_numpy(flagged), {"smaller_cluster_share": shares}
