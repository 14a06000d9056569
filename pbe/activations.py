"""Trigger-free backdoor evidence: where untargeted adversarial examples go, and which neurons fire.

For a backdoored model, untargeted adversarial examples mostly land on the backdoor's target label
and excite the same neurons as triggered images (PBE's observation). ``detect`` turns the first
fact into a test; ``neuron_overlap`` measures the second when triggered inputs are available.

Detection statistic (trigger-free, calibrated on the model and data at hand): a benign model's
adversarial examples mostly land on each input's natural runner-up class, so the *expected* share of
label k is its share among the clean runner-ups. With `a` the observed share of adversarial labels
and `e` the expected one (both averaged over source classes so each class counts once), the
attraction of label k is kappa = (a - e) / (1 - e), Cohen's chance-corrected agreement: 0 when the
adversarial labels go where natural confusion sends them, 1 when every adversarial example that would
have gone elsewhere lands on k. A backdoor is suspected when the most attracting label has
kappa > `threshold` (default 0.5: it takes at least half of what natural confusion would not give it).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from pbe.adversarial import MONITOR_PGD, PGDConfig, adversarial_examples
from pbe.metrics import predict
from pbe.models import activations
from pbe.utils import PBEError


@dataclass
class Monitor:
    """Where untargeted adversarial examples of a probe set land."""

    histogram: list[int]  # adversarial predictions per label (successful attacks only)
    adversarial_share: list[float]  # per-label share, averaged over source classes
    expected_share: list[float]  # same for the clean runner-up labels (natural confusion)
    kappa: list[float]  # chance-corrected attraction per label
    top_label: int
    top_kappa: float
    entropy: float  # of the adversarial labels, normalised to [0, 1]; 1 = uniform
    threshold: float
    suspected: bool
    success_rate: float
    probe_size: int

    def as_dict(self) -> dict:
        return asdict(self)


def _source_weighted(pred: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor, k: int) -> torch.Tensor:
    rows = [torch.bincount(pred[keep & (labels == c)], minlength=k).float() / (keep & (labels == c)).sum()
            for c in range(k) if (keep & (labels == c)).any()]
    return torch.stack(rows).mean(0) if rows else torch.full((k,), 1.0 / k)


PROBE_SIZE = 500  # images the monitor attacks
KAPPA_THRESHOLD = 0.5  # kappa above which a label is suspected


def label_concentration(adv_pred: torch.Tensor, labels: torch.Tensor, runner_up: torch.Tensor, num_classes: int,
                        threshold: float = KAPPA_THRESHOLD) -> Monitor:
    """Monitor from adversarial predictions, true labels and clean runner-up labels (pure function)."""
    ok = adv_pred != labels
    adv = _source_weighted(adv_pred, labels, ok, num_classes)
    expected = _source_weighted(runner_up, labels, torch.ones_like(ok), num_classes)
    kappa = (adv - expected) / (1 - expected).clamp_min(1e-6)
    top = int(kappa.argmax())
    hist = torch.bincount(adv_pred[ok], minlength=num_classes).float()
    p = hist / hist.sum().clamp_min(1)
    ent = float(-(p[p > 0] * p[p > 0].log()).sum() / torch.log(torch.tensor(float(num_classes))))
    r = lambda v: [round(float(x), 5) for x in v]  # noqa: E731
    return Monitor(hist.long().tolist(), r(adv), r(expected), r(kappa), top, float(kappa[top]), ent, threshold,
                   bool(kappa[top] > threshold), float(ok.float().mean()), int(len(labels)))


def runner_up_labels(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The most likely class other than the true one: where natural confusion points."""
    masked = logits.clone()
    masked[torch.arange(len(labels)), labels] = float("-inf")
    return masked.argmax(1)


def probe_indices(labels: torch.Tensor, size: int, seed: int = 0) -> torch.Tensor:
    """A fixed, class-balanced random probe set."""
    gen = torch.Generator().manual_seed(seed)
    classes = torch.unique(labels)
    if not isinstance(size, int) or isinstance(size, bool) or size < len(classes):
        raise PBEError(f"probe size must be an integer >= the number of classes ({len(classes)}: one image "
                       f"each at least), got {size!r}")
    per = max(1, size // len(classes))
    idx = [torch.nonzero(labels == c).flatten() for c in classes]
    idx = [i[torch.randperm(len(i), generator=gen)[:per]] for i in idx]
    return torch.cat(idx).sort().values


def monitor(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, num_classes: int,
            cfg: PGDConfig | None = None, threshold: float = KAPPA_THRESHOLD) -> Monitor:
    """Attack `images` with untargeted PGD and measure how strongly one label attracts them."""
    logits = predict(model, images, return_logits=True)
    x_adv = adversarial_examples(model, images, labels, cfg or MONITOR_PGD)
    return label_concentration(predict(model, x_adv), labels, runner_up_labels(logits, labels), num_classes,
                               threshold)


def kappa_detect(model: nn.Module, dataset, probe_size: int = PROBE_SIZE, cfg: PGDConfig | None = None,
                 threshold: float = KAPPA_THRESHOLD, seed: int = 0) -> Monitor:
    """Is a backdoor suspected, and which label does it point to? No trigger needed.

    `dataset` is any labelled data the defender has (test or training set); a class-balanced probe
    of `probe_size` images is attacked.
    """
    if len(dataset) == 0:
        raise PBEError("kappa_detect() needs a non-empty dataset")
    if not 0 < threshold < 1:
        raise PBEError(f"the kappa threshold must be in (0, 1) (kappa is a share of the attraction), got {threshold}")
    idx = probe_indices(dataset.labels, probe_size, seed)
    return monitor(model, dataset.images[idx], dataset.labels[idx], dataset.num_classes, cfg, threshold)


# ---------------------------------------------------------------- neurons
def _channel_means(act: torch.Tensor) -> torch.Tensor:
    return act.flatten(2).mean(2) if act.dim() == 4 else act


def top_k_neurons(act: torch.Tensor, k: int) -> set[int]:
    """Indices of the k channels (or units) with the largest mean activation over a set of inputs."""
    if not isinstance(k, int) or k < 1:
        raise PBEError(f"top-k needs an integer k >= 1, got {k!r}")
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
