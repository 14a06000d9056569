"""Is the backdoor still there? The erasure tracker PBE reports before and after every round.

The paper's per-round monitor (the kappa of untargeted adversarial labels, ``pbe.activations``) does not see the
backdoors of this toolkit's models: 0.03-0.25 on five independently trained infected CIFAR-10 models, against its
threshold of 0.5. The tracker re-measures, on the model being purified, the evidence that found the backdoor:

- **scan** (a named target, or the scan's top label where nothing is named): the target scan's statistic on that
  label. One small universal perturbation of the family that named it is fitted again toward the label, on the
  scan's own fitting images, and measured on its held-out images: the share of images of other labels it sends
  there, as a robust z against the other labels' shares in the scan before purification. A backdoor makes its
  target far easier to reach than any other label; once it is erased, the target is reached like the rest. The
  backdoor counts as still there while the z reaches `threshold` (PBE passes its weak-evidence threshold, the
  least z it acts on).
- **trigger** (where the isolation estimated the trigger: PBE fine-tunes against it, or holds its cluster back in
  the named target): that trigger pasted on held-out training images: the share it sends to the target, an
  estimate of the ASR, still there while it exceeds ``ERASED_REACH``; for an all-to-all backdoor (no target) the
  share whose prediction it changes, still there while it reaches ``pbe.isolation.MIN_FOOLING``, the share at
  which the isolation confirmed the trigger.

Neither reads the true trigger, target or poison; ``experiments/tracker_score.py`` scores their verdicts against
the true ASR on the zoo. Each costs ~0.02 epoch-equivalents on CIFAR-10 (one label's scan, or one forward pass over
``pbe.isolation.HELD_OUT`` images).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from pbe.data import ImageDataset
from pbe.detection import Detection, label_z, reached, scan_budget, scan_counts, scan_families, scan_images
from pbe.isolation import HELD_OUT, MIN_FOOLING, EstimatedTrigger
from pbe.metrics import predict
from pbe.utils import Cost


# a named target's estimated trigger counts as erased once it sends at most this share of held-out images of other
# labels there: the erasure goal's ASR, as the trigger's reach estimates the ASR (an estimate of the real trigger
# reaches somewhat less: on the dev rows 9.4 % at 12.5 % ASR, 3.1 % at 11.7 %, 0 % at 0 %)
ERASED_REACH = 0.03


@dataclass(frozen=True)
class Track:
    """One reading of the tracker."""

    evidence: str  # "scan" or "trigger"
    label: int | None  # the label watched (None: an all-to-all trigger, no single target)
    reach: float  # the share of held-out images the perturbation or trigger sends to the label (or moves)
    score: float | None  # "scan": the robust z of the label's reach against the others' before purification
    there: bool  # the backdoor is still there

    def as_dict(self) -> dict:
        return asdict(self)


def scan_track(model: nn.Module, data: ImageDataset, scan: Detection, label: int, family: str, *,
               budget, l2_rms: float, warp_shift: float, seed: int, threshold: float, cost: Cost) -> Track:
    """The scan's statistic on `label` for `model` (the module docstring): `scan` is the target scan of the
    original model, made on `data` with `budget`, `l2_rms`, `warp_shift` and `seed`; `family` is the one that named
    the label ("universal" or "warp"). The cost is added to `cost`."""
    b = scan_budget(budget)
    k = data.num_classes
    gen = torch.Generator().manual_seed(seed)
    (xo, yo), (xh, yh) = scan_images(data, *scan_counts(b, k), gen)  # the scan's own images
    fam = scan_families(xo[0].shape, l2_rms, warp_shift, b)[family]
    reach = float(reached(model, xo, yo, xh, yh, fam, label, gen).sum() / (yh != label).sum().clamp_min(1))
    cost.add(Cost(forward_backward=b.epochs * int((yo != label).sum()), forward=len(xh)))
    before = scan.warp_rates if family == "warp" else scan.rates
    rates = torch.tensor(before)
    rates[label] = reach
    z = label_z(rates, label, int(len(xh) * (k - 1) / k))
    return Track("scan", label, round(reach, 4), round(z, 3), z >= threshold)


def scan_track_before(scan: Detection, label: int, family: str, num_classes: int, threshold: float) -> Track:
    """The scan's own reading of `label` on the original model (no extra cost)."""
    rates = torch.tensor(scan.warp_rates if family == "warp" else scan.rates)
    held = scan.images // 2  # the scan's held-out half (its fitting half is as large)
    z = label_z(rates, label, int(held * (num_classes - 1) / num_classes))
    return Track("scan", label, round(float(rates[label]), 4), round(z, 3), z >= threshold)


def trigger_track(model: nn.Module, trigger: EstimatedTrigger, data: ImageDataset, label: int | None,
                  exclude: torch.Tensor, seed: int, cost: Cost) -> Track:
    """The estimated `trigger` on ``HELD_OUT`` training images of labels other than `label`, outside `exclude`
    (the samples fine-tuned on), drawn with their own generator: the share sent to `label`, or (None) the share
    whose prediction it changes."""
    pool = (~exclude if label is None else (data.labels != label) & ~exclude).nonzero().flatten()
    held = pool[torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))[:HELD_OUT]]
    x = data.images[held].float() / 255
    moved = predict(model, trigger.apply(x))
    if label is None:
        reach = float((moved != predict(model, x)).float().mean())
        cost.add(Cost(forward=2 * len(held)))
    else:
        reach = float((moved == label).float().mean())
        cost.add(Cost(forward=len(held)))
    there = reach >= MIN_FOOLING if label is None else reach > ERASED_REACH
    return Track("trigger", label, round(reach, 4), None, there)
