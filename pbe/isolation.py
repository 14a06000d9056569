"""Poison isolation from the defender's own, possibly poisoned, training set: which samples carry a
trigger, and what that trigger looks like, without the trigger, the target or clean data.

1. **Clusters** (the idea of Activation Clustering, Chen et al., SafeAI@AAAI 2019,
   https://arxiv.org/abs/1811.03728): a poisoned sample reaches its label through the trigger, so in
   the penultimate features of the infected model the label's samples split in two well-separated
   groups. Per label: PCA to ``PCA_DIMS`` dimensions, 2-means, and the silhouette of that split. A
   label is a candidate when its silhouette reaches ``SILHOUETTE_MIN`` (an absolute threshold, so
   that an all-to-all backdoor, which splits *every* label, is seen as well as an all-to-one one).
   Unlike AC's relative-size rule, either cluster may be the poison (half of an all-to-one target
   label is poison at a 10 % rate).
2. **The trigger the cluster reveals** (``EstimatedTrigger``): per pixel, from the poison group P and
   a reference group R of other samples, ``x' = (1 - m) (x + mu_P - mu_R) + m mu_P`` with
   ``m = 1 - sigma_P / sigma_R`` clipped to [0, 1]. It is exact for an additive trigger (SIG: ``m = 0``,
   ``x + delta``), a pasted patch (BadNets: ``m = 1`` on the patch, ``x' = patch``) and a blend
   (``x_p = (1 - a) x + a k``: ``m = a``, ``x' = (1 - a) x + a k``), given P and R come from the same
   images before poisoning.
3. **The model confirms** which cluster is the poison: the trigger estimated from it changes the
   infected model's prediction on at least ``MIN_FOOLING`` of held-out images of other labels, and on
   ``MIN_MARGIN`` more of them than the trigger estimated from the label's other cluster (a backdoor
   is a universal perturbation of the model; a benign sub-population's mean image is not, and the
   other cluster is the null of how much any mean-image shift moves this model). Where the other
   cluster's estimate moves the model too, it still passes if that estimate changes the images at
   least ``MIN_CHANGE_RATIO`` times as much (mean absolute change per pixel): a class prototype, not a
   trigger. GTSRB's signs are recognisable in their mean image, so the 7 % clean images of a poisoned
   target form a cluster whose estimate pastes the sign and moves the model (0.89-0.94 of held-out
   images) at a change of 0.163 per pixel, against the poison cluster's 0.008 (BadNets), 0.071 (Blend)
   and 0.047 (SIG). A label counts only if one of its clusters passes; that one is the suspected poison,
   unless it may be the prototype itself: its estimate changes the images ``MIN_CHANGE_RATIO`` times as
   much as the other cluster's, and on this model class means move predictions (the median label's
   whole-label estimate, step 4, moves at least ``PROTOTYPE_FOOLING`` of held-out images). Then the
   poison is the other cluster, whose trigger has no mean image (GTSRB WaNet: the target's clean 7 % move
   the model, 0.89 of held-out images at 0.151 per pixel, the warped poison's estimate 0.0 at 0.004); the
   label is flagged (it splits, and a cluster moves the model) but no sample is suspected and no trigger
   estimated (``Isolation.prototypes``). Where class means do not move the model (CIFAR-10), a
   large-change cluster that moves it is a trigger (a blend), as before.
   (A limit of the margin rule: a prototype cluster beside one the model ignores passes it. A clean
   toy model whose target label holds poison it never learned is flagged that way; GTSRB's clean
   model has no candidate label, silhouettes at most 0.43.)

Thresholds were chosen on the CIFAR-10 dev-set zoo (``experiments/isolation.py``, results in
``experiments/results/isolation.md``): silhouettes of labels without poison 0.18-0.35, of poisoned
labels 0.53-0.77; the poison cluster's estimated trigger moves 0.88-0.98 of held-out images, the
other cluster's 0.04-0.14. Warping (WaNet) and input-specific (Input-aware) triggers have no mean
image: their clusters' estimates move 0.12 or nothing is a candidate, and nothing is flagged (the
detection scan finds those).

4. **A whole poisoned label** (clean-label poison, e.g. SIG at 10 % on CIFAR-10: every image of the
   target label carries the trigger, so there is no second cluster). Only where no label is
   flagged: per label, the trigger estimated from *all* its samples against other labels'; a label
   whose estimate moves at least ``MIN_FOOLING`` of held-out images of other labels, and ``MIN_MARGIN``
   more than the next label's does, is ``whole_label``. Its samples are not suspected (their labels are
   true); its estimated trigger is. On the CIFAR-10 dev set: clean-label SIG's target 0.98, every other
   label of every dev model 0.02-0.16.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn

from pbe.metrics import predict

SILHOUETTE_MIN = 0.45  # a label's 2-means split at least this well separated is a candidate
PCA_DIMS = 10
SILHOUETTE_SAMPLE = 2000  # samples per label the silhouette is measured on
MIN_FOOLING = 0.5  # share of held-out images of other labels the estimated trigger must move
MIN_MARGIN = 0.5  # ... and how many more than the other cluster's (dev set: 0.75-0.88 poison, tiny digits 0.03-0.24)
MIN_CHANGE_RATIO = 2.0  # ... or the other cluster's estimate changes the images this many times as much
#                        (GTSRB dev set: 2.3-22 between the target's clean prototype and its poison)
# class means "move" a model when the median label's whole-label estimate moves this share of held-out images
# (dev sets: CIFAR-10 0.057-0.084, GTSRB 0.586-0.637)
PROTOTYPE_FOOLING = 0.3
HELD_OUT = 256
MIN_LABEL_SAMPLES = 20  # labels with fewer samples are not clustered
REFERENCE_SAMPLES = 5000  # images the reference statistics of a trigger estimate are taken from
_STD_FLOOR = 1.0 / 255


@dataclass
class EstimatedTrigger:
    """``apply(x) = ((1 - mask) (x + shift) + mask pattern).clamp(0, 1)``, per pixel (C, H, W)."""

    mask: torch.Tensor
    pattern: torch.Tensor
    shift: torch.Tensor

    @classmethod
    def estimate(cls, poison: torch.Tensor, reference: torch.Tensor) -> "EstimatedTrigger":
        """From uint8 images that carry the trigger and uint8 images that do not (module docstring)."""
        def stats(images):
            total = torch.zeros(images.shape[1:], dtype=torch.float64)
            squares = torch.zeros_like(total)
            for s in range(0, len(images), 1024):
                x = images[s:s + 1024].double() / 255
                total += x.sum(0)
                squares += (x * x).sum(0)
            mean = total / len(images)
            return mean, (squares / len(images) - mean * mean).clamp_min(0).sqrt()
        mu_p, sd_p = stats(poison)
        mu_r, sd_r = stats(reference)
        mask = (1 - sd_p / sd_r.clamp_min(_STD_FLOOR)).clamp(0, 1)
        return cls(mask.float(), mu_p.float(), (mu_p - mu_r).float())

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        m, p, d = (t.to(x.device) for t in (self.mask, self.pattern, self.shift))
        return ((1 - m) * (x + d) + m * p).clamp(0, 1)

    def change(self, x: torch.Tensor) -> float:
        """Mean absolute change per pixel that ``apply`` makes to float images `x`."""
        return float((self.apply(x) - x).abs().mean())


@dataclass
class Isolation:
    """What ``isolate`` found: `suspected` is a boolean mask over the training samples."""

    silhouettes: list[float]
    flagged: list[int]  # labels with a confirmed poison cluster
    fooling: dict[int, list[float]]  # per candidate label, the fooling rate of each cluster's trigger
    change: dict[int, list[float]]  # ... and the mean absolute change per pixel it makes to the images
    suspected: torch.Tensor = field(repr=False)
    trigger: EstimatedTrigger | None = field(default=None, repr=False)
    trigger_fooling: float | None = None  # of the trigger estimated from all suspected samples
    whole_label: int | None = None  # a label all of whose samples carry the trigger (then `trigger` is its)
    whole_fooling: list[float] | None = None  # per label, the fooling rate of its whole-label trigger
    prototypes: list[int] = field(default_factory=list)  # flagged labels whose moving cluster is a class prototype
    class_mean_fooling: float | None = None  # the median label's whole-label fooling rate, where it was needed

    def as_dict(self) -> dict:
        return {"silhouettes": self.silhouettes, "flagged": self.flagged,
                "fooling": {str(k): v for k, v in self.fooling.items()},
                "change": {str(k): v for k, v in self.change.items()}, "suspected": int(self.suspected.sum()),
                "trigger_fooling": self.trigger_fooling, "whole_label": self.whole_label,
                "whole_fooling": self.whole_fooling, "prototypes": self.prototypes,
                "class_mean_fooling": self.class_mean_fooling}


def _split(features: np.ndarray, seed: int) -> tuple[np.ndarray, float]:
    """2-means of the PCA-reduced features: (cluster of each sample, silhouette of the split)."""
    from sklearn.cluster import KMeans
    from sklearn.decomposition import PCA
    from sklearn.metrics import silhouette_score
    reduced = PCA(min(PCA_DIMS, features.shape[1], len(features) - 1), random_state=seed).fit_transform(features)
    assign = KMeans(n_clusters=2, n_init=10, random_state=seed).fit(reduced).labels_
    if len(np.unique(assign)) < 2:
        return assign, 0.0
    rng = np.random.RandomState(seed)
    sub = rng.choice(len(reduced), min(SILHOUETTE_SAMPLE, len(reduced)), replace=False)
    if len(np.unique(assign[sub])) < 2:
        return assign, 0.0
    return assign, float(silhouette_score(reduced[sub], assign[sub]))


def fooling_rate(model: nn.Module, trigger: EstimatedTrigger, images: torch.Tensor,
                 clean_pred: torch.Tensor | None = None) -> float:
    """Share of uint8 `images` whose prediction the trigger changes (`clean_pred`: their predictions, if known)."""
    x = images.float() / 255
    clean_pred = predict(model, x) if clean_pred is None else clean_pred
    return float((predict(model, trigger.apply(x)) != clean_pred).float().mean())


def _stands_out(rate: float, null: float) -> bool:
    """A trigger estimate moves the model like a backdoor: at least MIN_FOOLING of held-out images, and
    MIN_MARGIN more than the estimate it is compared with (the other cluster's, or the next label's)."""
    return rate >= MIN_FOOLING and rate - null >= MIN_MARGIN


def _poison_cluster(rates: list[float], changes: list[float]) -> int | None:
    """Which of a label's two clusters is confirmed as poison (step 3 of the module docstring), or None:
    the one whose trigger estimate stands out of the other's, or moves the model at least as much as
    the other's at a change MIN_CHANGE_RATIO times smaller (the other being a class prototype)."""
    best = int(np.argmax(rates))
    other = 1 - best
    if _stands_out(rates[best], rates[other]):
        return best
    if rates[best] >= MIN_FOOLING and changes[other] >= MIN_CHANGE_RATIO * changes[best]:
        return best
    return None


def _larger_change(changes: list[float], confirmed: int) -> bool:
    """The confirmed cluster's estimate changes the images MIN_CHANGE_RATIO times as much as the other's: it
    may paste the class's own mean image (a prototype, step 3 of the docstring) where class means move the model."""
    return changes[confirmed] >= MIN_CHANGE_RATIO * changes[1 - confirmed]


def _held_out_split(images: torch.Tensor, labels: torch.Tensor, c: int, gen: torch.Generator,
                    held_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images of labels other than `c`: (reference for a trigger estimate, held-out images to measure it on)."""
    others = (labels != c).nonzero().flatten()
    others = others[torch.randperm(len(others), generator=gen)]
    return images[others[held_out:held_out + REFERENCE_SAMPLES]], images[others[:held_out]]


def _whole_label(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, k: int, gen: torch.Generator,
                 held_out: int) -> tuple[int | None, list[float], EstimatedTrigger | None, int]:
    """Step 4 of the module docstring: (the whole poisoned label or None, every label's fooling rate, its
    trigger, forward passes)."""
    rates, triggers, passes = [], [], 0
    for c in range(k):
        idx = (labels == c).nonzero().flatten()
        if len(idx) < MIN_LABEL_SAMPLES:
            rates.append(0.0)
            triggers.append(None)
            continue
        idx = idx[torch.randperm(len(idx), generator=gen)[:REFERENCE_SAMPLES]]
        reference, held = _held_out_split(images, labels, c, gen, held_out)
        triggers.append(EstimatedTrigger.estimate(images[idx], reference))
        rates.append(round(fooling_rate(model, triggers[-1], held), 4))
        passes += 2 * len(held)
    order = np.argsort(rates)[::-1]
    best, runner_up = int(order[0]), rates[int(order[1])] if k > 1 else 0.0
    if _stands_out(rates[best], runner_up):
        return best, rates, triggers[best], passes
    return None, rates, None, passes


def isolate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, features: torch.Tensor,
            gen: torch.Generator, seed: int = 0, held_out: int = HELD_OUT,
            find_whole_label: bool = True) -> tuple[Isolation, int]:
    """Suspected poison among the training samples (module docstring), and the images it ran the model on
    (``forward`` passes, for the cost). `features`: the model's penultimate features of `images`;
    `held_out`: images of other labels each candidate trigger is measured on; `find_whole_label`: where no
    label is flagged, test every label as a whole (step 4)."""
    k = int(labels.max()) + 1
    feats = features.numpy()
    suspected = torch.zeros(len(labels), dtype=torch.bool)
    silhouettes, flagged, prototypes, fooling, change, passes = [], [], [], {}, {}, 0
    class_means = None  # the median whole-label fooling rate, measured once if a confirmed cluster needs it
    for c in range(k):
        idx = (labels == c).nonzero().flatten()
        if len(idx) < MIN_LABEL_SAMPLES:
            silhouettes.append(0.0)
            continue
        assign, sil = _split(feats[idx.numpy()], seed)
        silhouettes.append(round(sil, 4))
        if sil < SILHOUETTE_MIN:
            continue
        reference, held = _held_out_split(images, labels, c, gen, held_out)
        held_pred, held_x = predict(model, held), held.float() / 255
        rates, changes = [], []
        for part in (0, 1):
            members = idx[torch.from_numpy(assign == part)]
            trigger = EstimatedTrigger.estimate(images[members], reference)
            rates.append(round(fooling_rate(model, trigger, held, held_pred), 4))
            changes.append(round(trigger.change(held_x), 5))
        passes += 3 * len(held)
        fooling[c], change[c] = rates, changes
        poison = _poison_cluster(rates, changes)
        if poison is not None:
            flagged.append(c)
            if _larger_change(changes, poison) and class_means is None:  # its own generator: no draw changes
                _, rates_all, _, more = _whole_label(model, images, labels, k, torch.Generator().manual_seed(seed),
                                                     held_out)
                class_means, passes = float(np.median(rates_all)), passes + more
            if _larger_change(changes, poison) and class_means >= PROTOTYPE_FOOLING:
                prototypes.append(c)
            else:
                suspected[idx[torch.from_numpy(assign == poison)]] = True
    iso = Isolation(silhouettes, flagged, fooling, change, suspected, prototypes=prototypes,
                    class_mean_fooling=None if class_means is None else round(class_means, 4))
    if suspected.any():
        clean = ~suspected & ~torch.isin(labels, torch.tensor(flagged))  # reference: labels without poison,
        if not clean.any():  # or, when every label has some (all-to-all), the unsuspected samples
            clean = ~suspected
        pool = clean.nonzero().flatten()
        pool = pool[torch.randperm(len(pool), generator=gen)]
        iso.trigger = EstimatedTrigger.estimate(images[suspected], images[pool[held_out:held_out + REFERENCE_SAMPLES]])
        iso.trigger_fooling = round(fooling_rate(model, iso.trigger, images[pool[:held_out]]), 4)
        passes += 2 * min(held_out, len(pool))
    elif find_whole_label and not flagged:
        iso.whole_label, iso.whole_fooling, iso.trigger, more = _whole_label(model, images, labels, k, gen, held_out)
        iso.trigger_fooling = None if iso.whole_label is None else iso.whole_fooling[iso.whole_label]
        passes += more
    return iso, passes
