"""Trigger-free backdoor evidence: where untargeted adversarial examples go, and which neurons fire.

For a backdoored model, untargeted adversarial examples mostly land on the backdoor's target label
and excite the same neurons as triggered images (PBE's observation). ``detect`` turns the first
fact into a test; ``neuron_overlap`` measures the second when triggered inputs are available.

Detection statistic: for each source class the distribution of adversarial labels (other classes)
is computed, and these are averaged so that every source class counts once. The anomaly index of
the most frequent label is its distance above the median of the *other* labels' shares, in units of
their median absolute deviation (MAD x 1.4826, a robust standard deviation). A label is flagged when
that index exceeds ``threshold`` (default 3.0), i.e. the benign level is calibrated from the spread
of the non-suspected labels of the same model and data — the rule Neural Cleanse uses with 2.0.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from pbe.adversarial import PGDConfig, adversarial_examples
from pbe.metrics import predict
from pbe.models import activations
from pbe.utils import PBEError


@dataclass
class Monitor:
    """Adversarial-label concentration of a model on a probe set."""

    histogram: list[int]  # adversarial predictions per label (successful attacks only)
    source_weighted: list[float]  # per-label share, averaged over source classes
    top_label: int
    top_share: float
    entropy: float  # normalised to [0, 1]; 1 = uniform over labels
    anomaly_index: float
    threshold: float
    suspected: bool
    success_rate: float
    probe_size: int

    def as_dict(self) -> dict:
        return asdict(self)


def label_concentration(adv_pred: torch.Tensor, labels: torch.Tensor, num_classes: int,
                        threshold: float = 3.0) -> Monitor:
    """Monitor from adversarial predictions and true labels (pure function, no model)."""
    ok = adv_pred != labels
    hist = torch.bincount(adv_pred[ok], minlength=num_classes).float()
    per_source = []
    for c in range(num_classes):
        sel = ok & (labels == c)
        if sel.any():
            per_source.append(torch.bincount(adv_pred[sel], minlength=num_classes).float() / sel.sum())
    if not per_source:
        share = torch.full((num_classes,), 1.0 / num_classes)
    else:
        share = torch.stack(per_source).mean(0)
    top = int(share.argmax())
    others = torch.cat([share[:top], share[top + 1:]])
    med = others.median()
    mad = (others - med).abs().median() * 1.4826
    floor = 1.0 / max(1, int(ok.sum()))  # a share cannot be resolved more finely than one sample
    index = float((share[top] - med) / max(float(mad), floor))
    p = hist / hist.sum().clamp_min(1)
    ent = float(-(p[p > 0] * p[p > 0].log()).sum() / torch.log(torch.tensor(float(num_classes))))
    return Monitor(hist.long().tolist(), [round(float(v), 5) for v in share], top, float(p[top]), ent, index,
                   threshold, index > threshold, float(ok.float().mean()), int(len(labels)))


def probe_indices(labels: torch.Tensor, size: int, seed: int = 0) -> torch.Tensor:
    """A fixed, class-balanced random probe set."""
    gen = torch.Generator().manual_seed(seed)
    classes = torch.unique(labels)
    per = max(1, size // len(classes))
    idx = [torch.nonzero(labels == c).flatten() for c in classes]
    idx = [i[torch.randperm(len(i), generator=gen)[:per]] for i in idx]
    return torch.cat(idx).sort().values


def monitor(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, num_classes: int,
            cfg: PGDConfig | None = None, threshold: float = 3.0) -> Monitor:
    """Attack `images` with untargeted PGD and summarise where the adversarial labels go."""
    x_adv = adversarial_examples(model, images, labels, cfg or PGDConfig(eps=8 / 255, steps=10))
    return label_concentration(predict(model, x_adv), labels, num_classes, threshold)


def detect(model: nn.Module, dataset, probe_size: int = 500, cfg: PGDConfig | None = None,
           threshold: float = 3.0, seed: int = 0) -> Monitor:
    """Is a backdoor suspected, and which label does it point to? No trigger needed.

    `dataset` is any labelled data the defender has (test or training set); a class-balanced probe
    of `probe_size` images is attacked.
    """
    if len(dataset) == 0:
        raise PBEError("detect() needs a non-empty dataset")
    idx = probe_indices(dataset.labels, probe_size, seed)
    return monitor(model, dataset.images[idx], dataset.labels[idx], dataset.num_classes, cfg, threshold)


# ---------------------------------------------------------------- neurons
def _channel_means(act: torch.Tensor) -> torch.Tensor:
    return act.flatten(2).mean(2) if act.dim() == 4 else act


def top_k_neurons(act: torch.Tensor, k: int) -> set[int]:
    """Indices of the k channels (or units) with the largest mean activation over a set of inputs."""
    return set(_channel_means(act).mean(0).topk(min(k, _channel_means(act).shape[1])).indices.tolist())


def jaccard(a: set, b: set) -> float:
    return len(a & b) / max(1, len(a | b))


def neuron_overlap(model: nn.Module, clean: torch.Tensor, triggered: torch.Tensor, adversarial: torch.Tensor,
                   layers: list[str], k: int = 10) -> dict:
    """Top-k most activated neurons per layer for clean, triggered and adversarial inputs (float in
    [0, 1], same images), their Jaccard overlaps, and centroid distances of the layer features.

    PBE's observation holds when triggered-vs-adversarial overlap exceeds clean-vs-adversarial and the
    adversarial features sit closer to the triggered than to the clean ones.
    """
    groups = {"clean": clean, "triggered": triggered, "adversarial": adversarial}
    acts = {g: activations(model, x, layers) for g, x in groups.items()}
    out = {}
    for layer in layers:
        tops = {g: top_k_neurons(acts[g][layer], k) for g in groups}
        cent = {g: _channel_means(acts[g][layer]).mean(0) for g in groups}
        out[layer] = {
            "top_k": {g: sorted(v) for g, v in tops.items()},
            "jaccard": {"triggered_adversarial": jaccard(tops["triggered"], tops["adversarial"]),
                        "clean_adversarial": jaccard(tops["clean"], tops["adversarial"]),
                        "clean_triggered": jaccard(tops["clean"], tops["triggered"])},
            "centroid_distance": {"triggered_adversarial": float((cent["triggered"] - cent["adversarial"]).norm()),
                                  "clean_adversarial": float((cent["clean"] - cent["adversarial"]).norm()),
                                  "clean_triggered": float((cent["clean"] - cent["triggered"]).norm())},
        }
    return out
