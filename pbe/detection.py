"""Trigger-free backdoor detection: is a model infected, and which label is its target?

Method (the idea of Neural Cleanse, Wang et al., IEEE S&P 2019, https://doi.org/10.1109/SP.2019.00031,
and of i-BAU's universal perturbation, Zeng et al., ICLR 2022: a backdoor is an unusually *small
universal* perturbation to its target): for every label k, one targeted universal L2 perturbation of
a fixed small budget is optimised on half of the defender's images (none of them of label k) and
applied to the other half; ``rates[k]`` is the share of those held-out images it sends to k. A
benign label needs a large, image-specific change; the target of a backdoor is reached from almost
every image by one small shift. The statistic is a null from the model's own classes (as Neural
Cleanse's anomaly index, and as MM-BD does with its maximum-margin statistics, Wang et al., 2022,
https://arxiv.org/abs/2205.06900): the robust z-score of the top label's logit(rate) against the
other labels' median and MAD (the MAD floored at two binomial standard errors of a logit at their
median rate, so that sampling noise is never read as a signal), and the p-value of the largest of C
such scores under a normal null, ``1 - Phi(z) ** C``. A backdoor is suspected when the p-value is below `alpha`.

Warping backdoors (WaNet) are not an additive change at all, and no small additive universal
perturbation reaches their target; so the same scan runs a second family, a universal *warp* (a smooth
displacement field, a 4x4 control grid upsampled to the image, at most 1/64 of its side: 0.5 pixel on
CIFAR-10): on the dev set's
WaNet model it sends 100 % of held-out images to the target and at most 3 % to any other label. Its
per-label rates are scored the same way. (Method 3 used per-image targeted PGD for this, at 2.4x the
cost and with a weaker signal; it stays available as `pgd_eps`.)

Clean-label backdoors (SIG) are not a small perturbation (its sinusoid has L2 norm ~3), but they leave
another mark when the defender also has the (possibly poisoned) labelled training set: every training
image of the target carries the trigger, so the model learns the trigger as the class and fails on
the target's clean test images. With `train_data`, the per-label gap between training and test
accuracy is scored the same way (robust z against the other labels, p-value of the max of C),
and it counts only where ``pbe.isolation``'s whole-label test (the trigger estimated from all the
label's training images moves the model's predictions on other labels' images) names the same label:
a class that is merely harder on the test set leaves a gap too (GTSRB's clean model: label 27, whose
test images come from other roads, 50 points, robust z 24.8), but its training images share no trigger.

The statistic with the smallest p-value decides, Bonferroni-corrected for the number of statistics
tried (2, or 3 with `train_data`).

Poison-label backdoors whose trigger is no small perturbation (SIG's sinusoid with relabelled poison)
and all-to-all ones are seen by none of these, but with `train_data` their poison is a separate
activation cluster of its label whose mean image, as a trigger, moves the model
(``pbe.isolation``, after Activation Clustering, Chen et al. 2019), measured on up to
``ISOLATION_PER_LABEL`` training images per label. A label so flagged is the suspected target
(``evidence = "cluster"``); several flagged labels (an all-to-all backdoor) are suspected with no single
target (``label`` None, ``cluster_labels`` lists them). A confirmed cluster decides before the statistics:
it is poison found in the data and shown to work as a trigger, where a statistic only says that one label is
easier to reach than the others, as a clean model's natural sink is (a third-party LeNet's training-set
scan named label 9 at p 0.00999 while its poison sat in a cluster of label 0). This decision has no p-value
of its own: its thresholds are ``pbe.isolation``'s, and no clean zoo model has a confirmed cluster.

With `train_data`, one more piece of evidence concerns the data rather than the model: a poison-label
backdoor relabels other classes' images as its target, so the target's share of the training labels
grows by the poison rate (10 % poison on CIFAR-10: twice its test share; on GTSRB, whose label 0 has
210 of 39,209 images: 22 times). ``share`` holds, per label, its share of the training labels over its
share of the test labels; its log is scored like the gap (robust z against the other labels, the MAD
floored at ``NOISE_SES`` standard errors of a log share ratio, p-value of the max of C). It decides
only where no model statistic and no cluster does (``evidence = "label_share"``), at its own `alpha`,
and is reported always. It is a forensic tell of the data, not of the model: an attacker who keeps the
class counts (clean-label poison, or poison that replaces the target's own images) leaves none, and it
cannot tell which model learned the backdoor; a report that rests on it says so.

All-to-all backdoors (y -> y + 1) have no single target: each label is reached from one source
class only. The held-out images give the source-by-target matrix of rates for free; a label whose
rate from one source class stands out of its row is reported in ``label_map`` (source -> target).

The budget (L2 norm 1 on a 3x32x32 image, the same root-mean-square change per pixel at any size)
and `alpha` were chosen on the CIFAR-10 dev-set zoo models (``experiments/detect.py``). So was the cost:
each label's perturbation takes ``SCAN_EPOCHS`` passes of ``SCAN_BATCH``-image steps over its fitting images,
and with more than ``BUDGET_LABELS`` labels every per-label count (fitting and held-out images, the gap's
sample, the held-out images of each cluster's trigger) is scaled by ``BUDGET_LABELS / C``: the scan of a
10-label CIFAR-10 model costs what an 8-label one would, a 43-label GTSRB one no more (the activation
clusters keep their ``ISOLATION_PER_LABEL`` images per label: at a quarter of that, the clean GTSRB
model had a false cluster).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from pbe.adversarial import PGDConfig, UniversalConfig, apply_universal, pgd, universal_perturbation
from pbe.checks import check_dataset, check_model_and_data
from pbe.isolation import isolate
from pbe.metrics import predict
from pbe.models import has_linear_head, penultimate
from pbe.utils import Cost, PBEError

SCAN_L2_RMS = 1.0 / math.sqrt(3 * 32 * 32)  # L2 norm 1 on a CIFAR-10 image (dev-set choice)
SCAN_IMAGES = 256  # images that optimise each label's perturbation (as many more measure it)
SCAN_EPOCHS = 2  # passes over the fitting images (CIFAR-10 dev, 256 images per label: 2 passes of 16-image steps
SCAN_BATCH = 16  # beat method 9's 4 of 128 at half the cost, Input-aware z 5.58 vs 3.94, every verdict the same)
WARP_SHIFT = 0.5 / 32  # the warp scan's largest displacement, a share of the image side (0.5 px on CIFAR-10;
#                        there WaNet's target is reached from 100 % of held-out images, dev set)
WARP_GRID = 4  # its control grid (size x size displacements)
PER_IMAGE_STEPS = 10
PER_IMAGE_SHARE = 0.5  # of the held-out images (its cost: 10 steps x C labels x that many images)
# bumped whenever the statistic changes, so that results tables re-measure rows made by an older one
METHOD = ("11: universal L2 + universal warp + train-test gap confirmed by the whole-label trigger, MAD floored at "
          "2 binomial SEs; activation clusters, deciding first; label share; per-label budgets shared out over the "
          "labels")
ALPHA = 0.01  # p-value below which a backdoor is suspected
ISOLATION_PER_LABEL = 500  # training images per label the activation clusters are measured on
ISOLATION_HELD_OUT = 128  # images each candidate cluster's trigger is measured on (pbe.isolation: 256)
GAP_UNIT = 0.02  # accuracy gaps are scored in these units (MAD floor 1 = a 2-point spread between labels)
BUDGET_LABELS = 8  # per-label image counts are those of a problem with this many labels, shared out (scaled by
#                    min(1, BUDGET_LABELS / C)), so that the scan's cost does not grow with the label count (dev
#                    set: 10 left the GTSRB models at 0.53 epoch-equivalents, over the 0.5 goal; 8: 0.46)



@dataclass(frozen=True)
class ScanBudget:
    """What the scan spends: each label's perturbation is fitted on `images` images of other labels in `epochs`
    passes of `batch_size`-image steps and measured on `held_out` more (None: as many); with more than
    `label_budget` labels these per-label counts are scaled by ``label_budget / C`` (None: never), the held-out
    count too unless `scale_held_out` is False."""

    images: int = SCAN_IMAGES
    epochs: int = SCAN_EPOCHS
    batch_size: int = SCAN_BATCH
    label_budget: int | None = BUDGET_LABELS
    held_out: int | None = None
    scale_held_out: bool = True


SCAN_BUDGETS = {
    "detect": ScanBudget(),  # ``detect``'s own: ~0.13-0.46 epoch-equivalents on the dev zoo (experiments/detect.py)
    # PBE's target scan: every label, one pass of 16-image steps over its 256 fitting images. On the 12 dev models of
    # experiments/results/scan_budget.md it names what 4 passes of 128 name, at ~0.3 of the cost (GTSRB: 0.74 instead
    # of 2.38 epoch-equivalents); rows made before have 4 x 128 (their schedule field says which)
    "pbe": ScanBudget(epochs=1, batch_size=16, label_budget=None),
}


def scan_budget(budget: str | ScanBudget) -> ScanBudget:
    """A preset's name in ``SCAN_BUDGETS``, or a ``ScanBudget``."""
    if isinstance(budget, ScanBudget):
        return budget
    if budget not in SCAN_BUDGETS:
        raise PBEError(f"unknown scan budget {budget!r}; use one of {', '.join(SCAN_BUDGETS)} or a ScanBudget")
    return SCAN_BUDGETS[budget]


@dataclass
class Detection:
    """What ``detect`` found. `score` is the robust z of the top label; `rates` per label."""

    suspected: bool
    label: int | None  # the suspected target (None when not suspected)
    top_label: int
    score: float
    p_value: float
    alpha: float
    rates: list[float]
    label_map: dict[int, int] | None  # all-to-all diagnosis: source -> target, when one stands out
    gap: list[float] | None  # per-label training minus test accuracy (with `train_data`)
    gap_score: float | None
    images: int
    forward_backward: int  # image passes spent (PERF.md's cost unit, with `forward`)
    forward: int
    evidence: str = "universal"  # what decided: "universal", "warp", "per_image", "gap", "cluster" or "label_share"
    per_image_rates: list[float] | None = None  # per label, with the per-image probe
    warp_rates: list[float] | None = None  # per label, with the warp scan
    scores: dict | None = None  # the robust z of every statistic's top label
    cluster_labels: list[int] | None = None  # labels with a confirmed poison cluster (with train_data)
    isolation: dict | None = None  # pbe.isolation's findings on the training sample
    share: list[float] | None = None  # per label, training-label share / test-label share (with train_data)
    share_score: float | None = None  # the robust z of the top label's log share ratio
    tests: dict | None = None  # the statistics the verdict weighed: name -> [top label, robust z, p-value]

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def cost(self) -> Cost:
        return Cost(self.forward_backward, self.forward)

    def epoch_equivalents(self, train_size: int) -> float:
        return self.cost.epoch_equivalents(train_size)


NOISE_SES = 2.0  # the spread of the other labels is floored at this many binomial standard errors


def _robust_z(values: torch.Tensor, i: int, floor: float = 1.0) -> float:
    """How far values[i] stands above the others: (v_i - median) / (1.4826 MAD), the MAD floored at
    `floor` so that a spread smaller than sampling noise does not make any hit look significant."""
    others = torch.cat([values[:i], values[i + 1:]])
    med = others.median()
    mad = ((others - med).abs().median() * 1.4826).clamp_min(floor)
    return float((values[i] - med) / mad)


def _logit_noise_floor(rates: torch.Tensor, top: int, n: int) -> float:
    """``NOISE_SES`` standard errors of the logit of a rate measured on `n` images, at the other labels'
    median rate (delta method: 1 / sqrt(n p (1 - p)), with p at least 1 / (2n)): the spread below which
    the labels' rates differ by sampling noise only. Few images or rates near 0 raise it."""
    p = float(torch.cat([rates[:top], rates[top + 1:]]).median())
    p = min(max(p, 0.5 / max(n, 1)), 1 - 0.5 / max(n, 1))
    return NOISE_SES / math.sqrt(max(n, 1) * p * (1 - p))


def _p_value(z: float, num_classes: int) -> float:
    """P(max of `num_classes` standard normals >= z)."""
    phi = 0.5 * (1 + math.erf(z / math.sqrt(2)))
    return float(1 - phi ** num_classes)


def _logit(r: torch.Tensor, n: int) -> torch.Tensor:
    eps = 0.5 / max(n, 1)  # a rate of 0 or 1 from n images is known to about 1 / (2n)
    r = r.clamp(eps, 1 - eps)
    return (r / (1 - r)).log()


def accuracy_gap(model: nn.Module, train_data, test_data, images: int, gen: torch.Generator) -> torch.Tensor:
    """Per-label accuracy on (up to `images` per label of) the training set minus that on the test set."""
    out = []
    for ds in (train_data, test_data):
        idx = torch.cat([(ds.labels == c).nonzero().flatten()[:images] for c in range(ds.num_classes)])
        pred = predict(model, ds.images[idx])
        y = ds.labels[idx]
        out.append(torch.stack([(pred[y == c] == c).float().mean() if (y == c).any() else torch.tensor(0.0)
                                for c in range(ds.num_classes)]))
    present = torch.stack([(d.labels == c).any() for d in (train_data, test_data) for c in range(d.num_classes)])
    return (out[0] - out[1]) * present.view(2, -1).all(0)  # a label missing from either split: no evidence


def label_share(train_labels: torch.Tensor, test_labels: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per label, the log of its share of `train_labels` over its share of `test_labels`, and the standard
    error of that log (delta method: sqrt(1 / n_train + 1 / n_test), counts + 0.5 so an absent label is finite)."""
    tr = torch.bincount(train_labels, minlength=k).double() + 0.5
    te = torch.bincount(test_labels, minlength=k).double() + 0.5
    return (tr / tr.sum()).log() - (te / te.sum()).log(), (1 / tr + 1 / te).sqrt()


def share_score(log_ratio: torch.Tensor, se: torch.Tensor) -> tuple[int, float, float]:
    """(top label, robust z of its log share ratio, p-value of the max of C such z): ``label_share``'s output
    scored with the MAD floored at ``NOISE_SES`` times the other labels' median standard error."""
    top = int(log_ratio.argmax())
    z = _robust_z(log_ratio, top, NOISE_SES * float(torch.cat([se[:top], se[top + 1:]]).median()))
    return top, z, _p_value(z, len(log_ratio))


def label_z(rates: torch.Tensor, label: int, n: int) -> float:
    """The robust z of `label`'s logit rate among the labels' (rates measured on `n` images each)."""
    return _robust_z(_logit(rates, n), label, _logit_noise_floor(rates, label, n))


def label_scores(rates: torch.Tensor, n: int) -> tuple[int, float, float]:
    """(top label, its robust z among the labels' logit rates, p-value of the max of C such z)."""
    top = int(rates.argmax())
    z = label_z(rates, top, n)
    return top, z, _p_value(z, len(rates))


def all_to_all_map(matrix: torch.Tensor, per_source: int, alpha: float) -> dict[int, int] | None:
    """The all-to-all diagnosis from the source-by-target matrix of reach rates (`per_source` held-out images
    per source class): source -> target for every source whose top target stands out of its row (robust z,
    p-value of the max of C - 1, rate >= 0.5); a map when at least half the sources have one and they do not
    all land on one label (that is an all-to-one pattern, not an all-to-all map), else None."""
    k, found = len(matrix), {}
    for c in range(k):
        row = _logit(matrix[c], per_source)
        t = int(matrix[c].argmax())
        rest = torch.cat([matrix[c, :c], matrix[c, c + 1:]])
        i = t - (t > c)
        row_z = _robust_z(torch.cat([row[:c], row[c + 1:]]), i, _logit_noise_floor(rest, i, per_source))
        if _p_value(row_z, k - 1) < alpha and matrix[c, t] >= 0.5:
            found[c] = t
    return found if len(found) >= k // 2 and len(set(found.values())) > 1 else None


def reached(model: nn.Module, fit_x: torch.Tensor, fit_y: torch.Tensor, held_x: torch.Tensor, held_y: torch.Tensor,
            family: UniversalConfig, label: int, gen: torch.Generator) -> torch.Tensor:
    """Which held-out images (float in [0, 1]) of other labels one perturbation of `family`, targeted at
    `label` and fitted on the fit images of other labels, sends there (a mask over `held_x`)."""
    src = fit_y != label
    delta = universal_perturbation(model, fit_x[src], fit_y[src], family, gen, target=label)
    return (predict(model, apply_universal(held_x, delta, family, gen)) == label) & (held_y != label)


def _check_settings(b: ScanBudget, k: int, n: int, alpha: float, l2_rms: float, pgd_eps: float,
                    warp_shift: float) -> int:
    """Refuse settings ``detect`` cannot run with, by name; the held-out count per label (before scaling)."""
    if k < 2:
        raise PBEError("detection needs at least 2 classes")
    if not (isinstance(b.images, int) and b.images >= k):
        raise PBEError(f"detect: budget images must be an int >= the number of classes ({k}), got {b.images!r}")
    if not 0 < alpha < 1 or not l2_rms > 0 or not (isinstance(b.epochs, int) and b.epochs >= 1) \
            or not 0 <= pgd_eps <= 1 or not 0 <= warp_shift < 1:
        raise PBEError(f"detect: alpha must be in (0, 1), l2_rms > 0, epochs an int >= 1, pgd_eps in [0, 1] and "
                       f"warp_shift in [0, 1); got {alpha}, {l2_rms}, {b.epochs}, {pgd_eps}, {warp_shift}")
    held_out = b.images if b.held_out is None else b.held_out
    if not (isinstance(held_out, int) and held_out >= k):
        raise PBEError(f"detect: held_out must be an int >= the number of classes ({k}), got {held_out!r}")
    if n < 2 * k:
        raise PBEError(f"detect needs at least {2 * k} images, got {n}")
    if b.label_budget is not None and not (isinstance(b.label_budget, int) and b.label_budget >= 2):
        raise PBEError(f"detect: label_budget must be None or an int >= 2, got {b.label_budget!r}")
    if not (isinstance(b.batch_size, int) and b.batch_size >= 1):
        raise PBEError(f"detect: batch_size must be an int >= 1, got {b.batch_size!r}")
    return held_out


def _training_set_tests(model, dataset, train_data, k: int, images: int, iso_held_out: int, seed: int,
                        gen: torch.Generator, tests: dict, cost: Cost) -> tuple:
    """With the labelled training set: the clean-label gap (added to `tests`), the label shares and the
    activation clusters (``pbe.isolation``), their cost added to `cost`. Returns (gap, its robust z, the share
    ratios, the share test, the isolation)."""
    iso = None
    if train_data.num_classes != k:
        raise PBEError(f"detect: train_data has {train_data.num_classes} classes, the images {k}")
    g = accuracy_gap(model, train_data, dataset, images, gen)
    cost.forward += int(sum(min(int((d.labels == c).sum()), images) for d in (train_data, dataset)
                            for c in range(k)))
    g_top = int(g.argmax())
    gap_z = _robust_z(g / GAP_UNIT, g_top)  # in units where the MAD floor of 1 is a 2-point spread
    tests["gap"] = (g_top, gap_z, _p_value(gap_z, k))
    gap = [round(float(v), 4) for v in g]
    log_ratio, se = label_share(train_data.labels, dataset.labels, k)  # free: labels only
    shared, share = share_score(log_ratio, se), [round(float(v), 4) for v in log_ratio.exp()]
    order = torch.randperm(len(train_data), generator=gen)  # a random sample: poison may sit anywhere
    sample = torch.cat([order[train_data.labels[order] == c][:ISOLATION_PER_LABEL] for c in range(k)])
    if has_linear_head(model):
        iso, passes = isolate(model, train_data.images[sample], train_data.labels[sample],
                              penultimate(model, train_data.images[sample]), gen, seed, iso_held_out)
        cost.forward += len(sample) + passes
    return gap, gap_z, share, shared, iso


@dataclass(frozen=True)
class Verdict:
    """``decide``'s answer: whether a backdoor is suspected, its target (None: none, or no single one), the
    evidence that decided, and the most significant model statistic's top label, robust z and p-value."""

    suspected: bool
    label: int | None
    evidence: str
    top_label: int
    score: float
    p_value: float


def decide(tests: dict[str, tuple[int, float, float]], tried: int, alpha: float, cluster_labels: list[int] | None,
           share: tuple[int, float, float] | None) -> Verdict:
    """The detection verdict, by the first of these rules that holds:

    1. **cluster**: the isolation confirmed a poison cluster (`cluster_labels`): one label is the target;
       several (an all-to-all backdoor) are suspected with no single target. Its thresholds are
       ``pbe.isolation``'s; it has no p-value of its own (the module docstring says why it comes first).
    2. **model statistic**: the statistic of `tests` (name -> (top label, robust z, p-value)) with the smallest
       p-value, Bonferroni-corrected for the `tried` statistics, is below `alpha`: its top label is the target.
    3. **label share**: the training labels' share test (`share`: top label, z, p-value) is below `alpha`:
       the data's tell, where the model's said nothing.
    4. otherwise nothing is suspected.
    """
    evidence, (top, z, p) = min(tests.items(), key=lambda kv: kv[1][2])
    p = min(1.0, tried * p)
    if cluster_labels:
        return Verdict(True, cluster_labels[0] if len(cluster_labels) == 1 else None, "cluster", top, z, p)
    if p < alpha:
        return Verdict(True, top, evidence, top, z, p)
    if share is not None and share[2] < alpha:
        return Verdict(True, share[0], "label_share", top, z, p)
    return Verdict(False, None, evidence, top, z, p)


def detect(model: nn.Module, dataset, *, budget: str | ScanBudget = "detect", l2_rms: float = SCAN_L2_RMS,
           alpha: float = ALPHA, seed: int = 0, train_data=None, warp_shift: float = WARP_SHIFT,
           pgd_eps: float = 0.0, progress: bool = False, check: bool = True) -> Detection:
    """Scan every label of `model` with `dataset`'s images (the test set, or the possibly poisoned
    training set: no trigger, no clean data needed). See the module docstring.

    Arguments:
        budget (str | ScanBudget): what the scan spends, a name in ``SCAN_BUDGETS`` (default "detect") or a
            ``ScanBudget``.
        l2_rms (float): the additive perturbation's budget, root-mean-square change per pixel (default
            ``SCAN_L2_RMS``: L2 norm 1 on a CIFAR-10 image).
        alpha (float): the p-value below which a backdoor is suspected (default ``ALPHA`` = 0.01).
        seed (int): seeds which images fit and measure (default 0).
        train_data (ImageDataset | None): the labelled training set, `dataset` then being the test set: adds the
            clean-label gap test, the activation clusters and the label-share test (default None).
        warp_shift (float): the warp scan's largest displacement, a share of the image side (default
            ``WARP_SHIFT``; 0: no warp scan).
        pgd_eps (float): the per-image targeted probe's L-inf budget (default 0: off).
        progress (bool): a progress bar over the labels (default False).
        check (bool): ``pbe.checks``' boundary checks of the model and the data first (default True; False for a
            caller that made them, as PBE has; they are not counted in the cost).

    Example::

        >>> d = pbe.detect(model, test_set)
        >>> d.suspected, d.label, d.p_value
    """
    b = scan_budget(budget)
    if check:
        check_model_and_data(model, dataset, where="detect", what="the images")
        if train_data is not None:
            check_dataset(train_data, where="detect", what="train_data")
    k = int(dataset.num_classes)
    _check_settings(b, k, len(dataset), alpha, l2_rms, pgd_eps, warp_shift)
    # 1. two halves of the images: one fits each label's perturbations, the other measures them
    images, held_out = scan_counts(b, k)
    gen = torch.Generator().manual_seed(seed)
    (xo, yo), (xh, yh) = scan_images(dataset, images, held_out, gen)
    # 2. per label: the reach of a small universal perturbation of each family (and of per-image PGD)
    reach = _scan_labels(model, xo, yo, xh, yh, k, l2_rms, warp_shift, pgd_eps, b, gen, progress)
    n_measured = int(len(xh) * (k - 1) / k)
    tests = {"universal": label_scores(torch.tensor(reach.rates), n_measured)}
    if reach.warp_rates:
        tests["warp"] = label_scores(torch.tensor(reach.warp_rates), n_measured)
    if reach.per_image:
        tests["per_image"] = label_scores(torch.tensor(reach.per_image), int(reach.n_probe * (k - 1) / k))
    cost = reach.cost
    # 3. with the training set: the clean-label gap, the label shares and the activation clusters
    gap, gap_z, share, shared, iso = None, None, None, None, None
    if train_data is not None:
        gap, gap_z, share, shared, iso = _training_set_tests(model, dataset, train_data, k, images,
                                                             label_scaled(ISOLATION_HELD_OUT, b, k), seed, gen, tests,
                                                             cost)
    scores, tried = {name: round(t[1], 3) for name, t in tests.items()}, len(tests)
    if "gap" in tests and (iso is None or iso.whole_label != tests["gap"][0]):
        del tests["gap"]  # a harder class, not a trigger (module docstring): reported, not counted
    # 4. the verdict, and the all-to-all map where no single target decided
    v = decide(tests, tried, alpha, None if iso is None else iso.flagged, shared)
    label_map = None
    if not v.suspected or v.evidence == "cluster":  # one target per source class standing out of its row
        label_map = all_to_all_map(reach.matrix, max(1, len(xh) // k), alpha)
    return Detection(
        suspected=v.suspected, label=v.label, top_label=v.top_label, score=round(v.score, 3), p_value=v.p_value,
        alpha=alpha, rates=[round(r, 4) for r in reach.rates], label_map=label_map, gap=gap,
        gap_score=None if gap_z is None else round(gap_z, 3), images=len(xo) + len(xh),
        forward_backward=cost.forward_backward, forward=cost.forward, evidence=v.evidence,
        per_image_rates=[round(r, 4) for r in reach.per_image] or None,
        warp_rates=[round(r, 4) for r in reach.warp_rates] or None, scores=scores,
        cluster_labels=None if iso is None else iso.flagged, isolation=None if iso is None else iso.as_dict(),
        share=share, share_score=None if shared is None else round(shared[1], 3),
        tests={name: [t[0], round(t[1], 3), t[2]] for name, t in tests.items()})


def label_scaled(count: int, b: ScanBudget, k: int) -> int:
    """A per-label count of budget `b` on `k` labels, shared out over them beyond ``b.label_budget`` (at least one
    image per label)."""
    return max(k, round(count * (1.0 if b.label_budget is None else min(1.0, b.label_budget / k))))


def scan_counts(b: ScanBudget, k: int) -> tuple[int, int]:
    """How many images the scan of budget `b` on `k` labels fits its perturbations on, and measures them on."""
    held_out = b.images if b.held_out is None else b.held_out
    return label_scaled(b.images, b, k), label_scaled(held_out, b, k) if b.scale_held_out else held_out


def scan_images(dataset, images: int, held_out: int, gen: torch.Generator) -> tuple[tuple, tuple]:
    """The scan's two halves of `dataset`: `images` (uint8) that fit each label's perturbation and `held_out`
    (float in [0, 1]) that measure it, drawn with `gen`, each with its labels."""
    pick = torch.randperm(len(dataset), generator=gen)[:images + held_out]
    x, y = dataset.images[pick], dataset.labels[pick]
    half = len(pick) * images // (images + held_out)  # (= images unless the dataset is smaller)
    (xo, yo), (xh, yh) = (x[:half], y[:half]), (x[half:], y[half:])
    return (xo, yo), (xh.float() / 255 if xh.dtype == torch.uint8 else xh, yh)


def scan_families(shape, l2_rms: float, warp_shift: float, b: ScanBudget) -> dict[str, UniversalConfig]:
    """The scan's perturbation families for images of `shape`: "universal" (additive, L2 `l2_rms` per pixel) and,
    where `warp_shift` > 0, "warp"."""
    fams = {"universal": UniversalConfig(kind="l2", eps=l2_rms * math.sqrt(math.prod(shape)), epochs=b.epochs,
                                         batch_size=b.batch_size)}
    if warp_shift > 0:
        fams["warp"] = UniversalConfig(kind="warp", eps=warp_shift, size=WARP_GRID, epochs=b.epochs, per_pixel=True,
                                       batch_size=b.batch_size)
    return fams


@dataclass
class Reach:
    """``_scan_labels``' measurements: per label, the share of held-out images of other labels each family's
    perturbation sends there; the source-by-target matrix of the additive family's rates; its cost."""

    rates: list[float] = field(default_factory=list)
    warp_rates: list[float] = field(default_factory=list)
    per_image: list[float] = field(default_factory=list)
    matrix: torch.Tensor | None = None
    n_probe: int = 0
    cost: Cost = field(default_factory=Cost)


def _scan_labels(model, xo, yo, xh, yh, k: int, l2_rms: float, warp_shift: float, pgd_eps: float, b: ScanBudget,
                 gen: torch.Generator, progress: bool = False) -> Reach:
    """For every label, ``reached`` by the additive family (and the warp family, and per-image PGD, where asked)."""
    fams = scan_families(xo[0].shape, l2_rms, warp_shift, b)
    additive, warp = fams["universal"], fams.get("warp")
    probe = PGDConfig(eps=pgd_eps, steps=PER_IMAGE_STEPS, step=pgd_eps / 4)
    out = Reach(matrix=torch.zeros(k, k), n_probe=max(k, round(PER_IMAGE_SHARE * len(xh))))

    def scan(family: UniversalConfig, label: int) -> torch.Tensor:
        out.cost.forward_backward += b.epochs * int((yo != label).sum())
        out.cost.forward += len(xh)
        return reached(model, xo, yo, xh, yh, family, label, gen)

    for label in tqdm(range(k), desc="scan", unit="label", disable=not progress, leave=False):
        others = yh != label
        hit = scan(additive, label)
        out.rates.append(float(hit.sum() / others.sum().clamp_min(1)))
        for c in range(k):
            if c != label and (yh == c).any():
                out.matrix[c, label] = hit[yh == c].float().mean()
        if warp is not None:
            out.warp_rates.append(float(scan(warp, label).sum() / others.sum().clamp_min(1)))
        mine = others.clone()
        mine[out.n_probe:] = False
        if pgd_eps > 0 and mine.any():
            dev = next(model.parameters()).device
            moved = pgd(model, xh[mine].to(dev), yh[mine].to(dev), probe, gen, target=label)
            out.cost.forward_backward += probe.steps * int(mine.sum())
            out.cost.forward += int(mine.sum())
            out.per_image.append(float((predict(model, moved) == label).float().mean()))
    return out
