"""Progressive Backdoor Erasing (PBE), without clean data.

Mu et al., "Progressive Backdoor Erasing via connecting Backdoor and Adversarial Attacks", CVPR 2023,
https://arxiv.org/abs/2202.06312 (see ``../shared/PBE.md``).

The paper fine-tunes the model on untargeted adversarial examples labelled with the samples' own labels, and
finds clean training samples progressively: after each round every training image is scored by how far the
purified model's output moved from the original one's (poison moves most), and the next round takes the least
suspicious share. On this toolkit's models untargeted adversarial examples rarely reach a backdoor's target
(``experiments/results/premise_cifar10.md``), so the default keeps the progressive selection and aims the
adversarial share of every batch at the target that a trigger-free scan names. ``PBE._defend`` runs these steps:

1. **plan** (``make_plan``, a pure function of what the next two find): the target scan (``pbe.detection``) names
   a label that one small universal perturbation reaches from most images; the isolation (``pbe.isolation``)
   looks for poison in a separate activation cluster, or for a label all of whose samples carry a trigger; their
   verdict is ``pbe.detection.decide``'s, the one ``pbe.detect`` gives on the same evidence. The plan says which
   label is the target, which samples are distrusted, and what a third of every batch carries: a perturbation
   optimised toward the target each epoch, or the isolation's estimated trigger.
2. **calibrate**: each perturbation family's budget is doubled until it reaches the target from most held-out
   images.
3. **rounds** of *fine-tune* (on the subset, the samples' own labels) -> *measure* (how far each sample's output
   moved) -> *check* (a cluster held back as evidence: does its trigger still work?) -> *select* (the least
   suspicious share of every label) -> *relabel* (distrusted samples the purified model moved).

Every fine-tuning step uses the strongest augmentation, up to the schedule's random crops and flips, that the infected
model keeps its accuracy on its own training samples under (``pbe.defenses.base.fitting_augmentation``): a model
trained without augmentation is fine-tuned on the plain images.
``schedule="paper"`` is the authors' method. The trigger, the target and the poison indices are never used, except
by the optional ``Evaluation``, which measures the report in one place (``ground_truth``).
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from pbe.activations import PROBE_SIZE, Monitor, monitor, probe_indices
from pbe.adversarial import (MONITOR_PGD, PAPER_EPS, PAPER_PGD, PGDConfig, UniversalConfig, apply_universal, pgd,
                             universal_perturbation)
from pbe.data import ImageDataset
from pbe.detection import (SCAN_BUDGETS, SCAN_L2_RMS, WARP_GRID, WARP_SHIFT, Detection, ScanBudget, Verdict,
                           decide, detect)
from pbe.defenses.base import Context, Defense, Evaluation, fitting_augmentation, measure, sgd_finetune
from pbe.isolation import HELD_OUT, MIN_FOOLING, EstimatedTrigger, Isolation, isolate
from pbe.metrics import predict, ranking_quality
from pbe.models import has_linear_head, penultimate
from pbe.tracker import scan_track, scan_track_before, trigger_track
from pbe.utils import Cost, PBEError, PBEWarning

LR_SCHEDULES = ("constant", "cosine")
MASK_SHARE = 0.01  # the mask family's budget: a share of the pixels (a 3x3 patch on 32x32), doubled by calibration
# the default's universal families, one per shape a trigger takes: additive and spread out (L2, the scan's budget per
# pixel: Blend, SIG, LF), localised (a mask over MASK_SHARE of the pixels: a patch, which an L2 budget spreads too
# thin to imitate) and geometric (a smooth warp: WaNet)
FAMILIES = (UniversalConfig(kind="l2", eps=SCAN_L2_RMS, per_pixel=True),
            UniversalConfig(kind="warp", eps=WARP_SHIFT, size=WARP_GRID, per_pixel=True),
            UniversalConfig(kind="mask", eps=MASK_SHARE))
# the scan's evidence -> the family kinds kept where its top label is the target: the additive scan also answers a
# patch (its small L2 budget reaches a patch trigger's target first), the warp scan a warp
SCAN_FAMILIES = {"universal": ("l2", "linf", "patch", "mask"), "warp": ("warp",)}


@dataclass(frozen=True)
class Schedule:
    """How PBE runs; ``Schedule()`` is the default (``SCHEDULES`` names it and the others shipped).

    Arguments:
        fractions (tuple[float, ...]): per round, the share of the training set fine-tuned on (round 1: a random
            draw of the trusted samples; later rounds: the least suspicious). Default (0.05, 0.3).
        epochs (tuple[int, ...]): per round, its epochs. Default (4, 2).
        adv_batches (tuple[int | None, ...]): per round, how many batches get untargeted PGD (untargeted schedules
            only; None: every batch). Default (None, None).
        lr (float): SGD learning rate. Default 1e-3.
        lr_schedule (str): "constant", or "cosine" (annealed to 0 within each round). Default "cosine".
        momentum (float): SGD momentum. Default 0.9.
        weight_decay (float): SGD weight decay. Default 5e-4.
        batch_size (int): fine-tuning batch size. Default 128.
        crop_padding (int): random-crop padding of the fine-tuning augmentation. Default 4.
        targeted (bool): plan from the target scan and the isolation (``make_plan``), and give a `universal_share`
            of every batch the planned perturbation; False: the paper's untargeted PGD on whole batches, no scan,
            no isolation. Default True.
        families (tuple[UniversalConfig, ...]): the universal perturbation families, each re-optimised every
            epoch and given an equal part of the universal share. Default ``FAMILIES`` (additive L2, warp, mask).
        universal_share (float): share of every batch that gets a universal perturbation (or the estimated
            trigger), with the samples' own labels. Default 1/3.
        universal_images (int): samples each family's perturbation is optimised on. Default 512.
        universal_refresh (int | None): after a round's first epoch, each family's perturbation continues from the
            last epoch's for this many passes over its images (the model moved a little in an epoch: the last
            perturbation is a near start), instead of its config's `epochs` from a fresh start; None: always fresh.
            Default 1.
        universal_reach (float): before round 1 each family's budget is doubled (at most ``MAX_DOUBLINGS`` times)
            until its perturbation sends this share of held-out images to the target; 0 keeps it. Default 0.8.
        pgd_config (PGDConfig): the untargeted PGD of untargeted schedules. Default 4 steps of 2/255 within 6/255.
        balanced (bool): later rounds take the same share of every label. Default True.
        monitor (bool): run the paper's monitor (the kappa of untargeted adversarial labels, ``pbe.activations``)
            before PBE and after every round. Default False: it reads none of the zoo's backdoors, and the targeted
            schedules track the erasure with ``pbe.tracker`` instead; the untargeted ones, which stop on it, run it.
        early_stop (bool): stop after a round once the monitor, which flagged a backdoor before round 1, no longer
            does (never with a known target). Default False.
        probe_size (int): images the monitor attacks. Default ``PROBE_SIZE``.
        monitor_pgd (PGDConfig): the monitor's PGD. Default ``MONITOR_PGD``.
        scan_l2_rms (float): the target scan's additive budget, RMS change per pixel. Default ``SCAN_L2_RMS``.
        scan_budget (ScanBudget): what the target scan spends. Default ``SCAN_BUDGETS["pbe"]``.
    """

    fractions: tuple[float, ...] = (0.05, 0.3)
    epochs: tuple[int, ...] = (4, 2)
    adv_batches: tuple[int | None, ...] = (None, None)
    lr: float = 1e-3
    lr_schedule: str = "cosine"
    momentum: float = 0.9
    weight_decay: float = 5e-4
    batch_size: int = 128
    crop_padding: int = 4
    targeted: bool = True
    families: tuple[UniversalConfig, ...] = FAMILIES
    universal_share: float = 1 / 3
    universal_images: int = 512
    universal_refresh: int | None = 1
    universal_reach: float = 0.8
    pgd_config: PGDConfig = PGDConfig(eps=PAPER_EPS, steps=4, step=2 / 255)
    balanced: bool = True
    monitor: bool = False
    early_stop: bool = False
    probe_size: int = PROBE_SIZE
    monitor_pgd: PGDConfig = MONITOR_PGD
    scan_l2_rms: float = SCAN_L2_RMS
    scan_budget: ScanBudget = SCAN_BUDGETS["pbe"]

    def __post_init__(self):
        n = len(self.fractions)
        if not (len(self.epochs) == len(self.adv_batches) == n) or n == 0:
            raise PBEError("schedule: fractions, epochs and adv_batches need one entry per round")
        if any(not 0 < f <= 1 for f in self.fractions):
            raise PBEError(f"schedule fractions must be in (0, 1], got {self.fractions}")
        if any(int(e) < 1 for e in self.epochs):
            raise PBEError(f"schedule epochs must be >= 1, got {self.epochs}")
        if not self.lr > 0:
            raise PBEError(f"schedule lr must be > 0, got {self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise PBEError(f"schedule lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not (0 <= self.universal_share <= 1 and 0 <= self.universal_reach <= 1):
            raise PBEError(f"universal_share and universal_reach must be in [0, 1], got {self.universal_share}, "
                           f"{self.universal_reach}")
        if self.universal_refresh is not None and not (isinstance(self.universal_refresh, int)
                                                       and self.universal_refresh >= 1):
            raise PBEError(f"schedule universal_refresh must be an int >= 1 or None, got {self.universal_refresh!r}")
        if self.early_stop and not self.monitor:
            raise PBEError("schedule early_stop stops on the monitor: it needs monitor=True")
        if not isinstance(self.families, tuple) or not all(isinstance(f, UniversalConfig) for f in self.families):
            raise PBEError(f"schedule families must be a tuple of UniversalConfig, got {self.families!r}")

    def as_dict(self) -> dict:
        return asdict(self)


SCHEDULES = {
    "targeted": Schedule(),
    # the paper's untargeted method, short: two rounds, PGD-4, early stop (about 2-3 epoch-equivalents)
    "fast": Schedule(targeted=False, adv_batches=(None, 10), lr=0.01, lr_schedule="constant", balanced=False,
                     monitor=True, early_stop=True),
    # the authors' code: 4 rounds of 10 epochs, lr 1e-3, PGD-7 at 6/255, subsets 5/20/50/70 %
    "paper": Schedule(targeted=False, fractions=(0.05, 0.2, 0.5, 0.7), epochs=(10, 10, 10, 10),
                      adv_batches=(None, 31, 31, 31), pgd_config=PAPER_PGD, lr=0.001, lr_schedule="constant",
                      crop_padding=5, balanced=False, monitor=True),
}
DEFAULT_SCHEDULE = "targeted"  # what pbe.erase, PBE() and `pbe erase` run unless told otherwise


def get_schedule(schedule: str | Schedule, **overrides) -> Schedule:
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise PBEError(f"unknown schedule {schedule!r}; available: {', '.join(SCHEDULES)}")
        schedule = SCHEDULES[schedule]
    return replace(schedule, **{k: v for k, v in overrides.items() if v is not None})


# ---------------------------------------------------------------- step 1: the plan
# the robust z from which the scan's top label is the target although its p-value misses the detection threshold
# (chosen on the CIFAR-10 dev set's scans of the training set, the ablation table's "top"), on 10 labels; carried
# to C labels at the same chance that a benign top label reaches it (``weak_evidence_threshold``)
WEAK_EVIDENCE_Z = 2.0
WEAK_EVIDENCE_CLASSES = 10  # the number of labels WEAK_EVIDENCE_Z was chosen on
# a target holding more than this many times the median label's samples is inflated by its poison: its samples
# stay out of every round (chosen on the dev sets: GTSRB's target at 10 % poison holds 7.6 times, CIFAR-10's 2.25)
READMIT_INFLATION = 4.0
RELABEL_CONFIDENCE = 0.8  # softmax probability the purified model must give a moved sample's new label


def weak_evidence_threshold(num_classes: int, min_z: float = WEAK_EVIDENCE_Z) -> float:
    """`min_z`, chosen on WEAK_EVIDENCE_CLASSES labels, carried to `num_classes` labels at the same chance
    that the largest of the benign labels' robust z reaches it: ``Phi(z_C) ** C = Phi(min_z) ** 10``."""
    from scipy.stats import norm
    return float(norm.ppf(norm.cdf(min_z) ** (WEAK_EVIDENCE_CLASSES / num_classes)))


def scan_target(scan: Detection, num_classes: int) -> int | None:
    """The label the target scan names: its top label where the scan flags it or where its robust z reaches
    ``weak_evidence_threshold`` (a defender runs PBE because a backdoor is suspected, and a weak scan, e.g. on
    the overfitted training images, still ranks the target first); else None."""
    return scan.top_label if scan.suspected or scan.score >= weak_evidence_threshold(num_classes) else None


def typical_count(labels: torch.Tensor, label: int) -> float:
    """The median count of the labels present other than `label`."""
    counts = torch.bincount(labels)
    return float(counts[(counts > 0) & (torch.arange(len(counts)) != label)].float().median())


def inflated(labels: torch.Tensor, label: int) -> bool:
    """Does `label` hold more than READMIT_INFLATION times the median of the other labels' counts?"""
    return int((labels == label).sum()) > READMIT_INFLATION * typical_count(labels, label)


@dataclass(frozen=True)
class Plan:
    """What PBE acts on, decided before round 1 by ``make_plan``."""

    target: int | None = None  # the label the universal share aims at (None: none)
    named_by: str = "none"  # what named it (``make_plan``'s rule): "given", "scan", "scan and cluster", "weak scan",
    #                         "whole label" or "none"
    distrust: str = "none"  # whose samples stay out of round 1: "target" (the target's), "cluster" (the isolated)
    trigger: str = "optimised"  # the universal share carries "optimised" perturbations or the "estimated" trigger
    families: tuple[str, ...] | None = None  # kinds of the optimised families kept (None: every one)
    readmit: bool = False  # later rounds may take the distrusted target samples ``readmitted`` ranks first
    #                        (never those the isolation holds as poison)
    relabel: str = "none"  # distrusted samples in the next round: "moved" (those the purified model moved
    #                        confidently, with its label), "all" (every one, with its best other label), "none"
    check_cluster: bool = False  # a cluster confirmed in the named target waits: its trigger is tried after a round

    def switch_to_cluster(self) -> "Plan":
        """The plan once the held-back cluster's trigger proved to still work: the isolation's path."""
        return replace(self, distrust="cluster", trigger="estimated", relabel="all", check_cluster=False)


def make_plan(*, given: int | None, verdict: Verdict | None, scan_label: int | None, scan_evidence: str | None,
              cluster_labels: list[int], whole_label: int | None, labels: torch.Tensor) -> Plan:
    """The plan, by the first of these rules that holds. `verdict` is ``pbe.detection.decide``'s on PBE's evidence
    (the isolation's poison clusters, `cluster_labels`, then the target scan's statistics): the verdict
    ``pbe.detect`` gives on the same evidence, so that the two never name different targets. `scan_label` is the
    label the scan names (``scan_target``: on a significant statistic or on weak evidence), `scan_evidence` the
    family whose scan named it.

    1. **A target is given** by the defender.
    2. **A poison cluster** (the verdict's first rule). Where the scan (its statistic or its weak evidence) names
       the cluster's only label, that label is the target. Otherwise the isolated samples stay out of every
       round, their estimated trigger takes the universal share, and every one of them joins the next round with
       the purified model's best label other than its own (the isolation confirmed it as poison, whose label is
       the attacker's).
    3. **The scan's statistic names a target** (the verdict's second rule).
    4. **The scan's weak evidence** (`scan_label` where the verdict suspects nothing: its top label's robust z
       reaches ``weak_evidence_threshold`` although its p-value misses alpha): a defender runs PBE because a
       backdoor is suspected.
    5. **A whole label carries a trigger** (clean-label poison: every sample of the target does): that label is
       the target; its samples stay out of every round; its estimated trigger takes the universal share.
    6. **Nothing found**: untargeted universal perturbations, nothing distrusted.

    Where rules 1-4 name a target, its samples stay out of round 1; the universal share gets perturbations
    optimised toward it (only the families of the scan's evidence, where the scan's top label is the target); of
    its samples, a median label's worth are readmitted (``readmitted``) unless the label is ``inflated`` by its
    poison, and those the purified model moved confidently elsewhere join the next round with their new label. A cluster
    confirmed in that label is held back as evidence (``Plan.switch_to_cluster``).
    """
    def named(target: int, by: str) -> Plan:
        return Plan(target=target, named_by=by, distrust="target",
                    families=SCAN_FAMILIES.get(scan_evidence) if scan_label == target else None,
                    readmit=not inflated(labels, target), relabel="moved", check_cluster=target in cluster_labels)

    if given is not None:
        return named(given, "given")
    if cluster_labels:
        if scan_label is not None and cluster_labels == [scan_label]:
            return named(scan_label, "scan and cluster")
        return Plan(distrust="cluster", trigger="estimated", relabel="all")
    if verdict is not None and verdict.suspected:
        return named(verdict.label, "scan")
    if scan_label is not None:
        return named(scan_label, "weak scan")
    if whole_label is not None:
        return Plan(target=whole_label, named_by="whole label", distrust="target", trigger="estimated")
    return Plan()


def target_scan(model: nn.Module, data: ImageDataset, s: Schedule, ctx: Context) -> Detection:
    scan = detect(model, data, budget=s.scan_budget, l2_rms=s.scan_l2_rms, seed=ctx.seed, check=False)
    ctx.cost.add(scan.cost)
    return scan


def run_isolation(model: nn.Module, data: ImageDataset, features: torch.Tensor, named: bool,
                  ctx: Context) -> Isolation:
    """``pbe.isolation.isolate`` on the training set (its own generator: a run where nothing is isolated draws
    exactly as without it); the whole-label test only where no target is named."""
    iso, passes = isolate(model, data.images, data.labels, features, torch.Generator().manual_seed(ctx.seed),
                          ctx.seed, find_whole_label=not named)
    ctx.cost.add(Cost(forward=passes))
    return iso


# ---------------------------------------------------------------- step 2: calibration
MAX_DOUBLINGS = 3  # universal_reach raises a budget at most 2 ** 3 = 8 times


def calibrate(model: nn.Module, data: ImageDataset, target: int, families: tuple[UniversalConfig, ...],
              s: Schedule, ctx: Context) -> tuple[tuple[UniversalConfig, ...], list[dict]]:
    """Each family with its budget doubled until one perturbation targeted at `target`, fitted on
    `universal_images` samples of other labels, sends ``s.universal_reach`` of as many held-out ones there (or
    ``MAX_DOUBLINGS`` doublings); with the reach measured per family and budget."""
    pool = (data.labels != target).nonzero().flatten()
    pick = pool[torch.randperm(len(pool), generator=ctx.gen)[:2 * s.universal_images]]
    fit, held = pick[:len(pick) // 2], pick[len(pick) // 2:]
    x_held = data.images[held].float() / 255
    chosen, tried = [], []
    for cfg in families:
        for doubling in range(MAX_DOUBLINGS + 1):
            if doubling:
                cfg = replace(cfg, eps=cfg.eps * 2)
            delta = universal_perturbation(model, data.images[fit], data.labels[fit], cfg, ctx.gen, ctx.device,
                                           target=target)
            reach = float((predict(model, apply_universal(x_held, delta, cfg, ctx.gen)) == target).float().mean())
            ctx.cost.add(Cost(forward_backward=cfg.epochs * len(fit), forward=len(held)))
            tried.append({"kind": cfg.kind, "eps": cfg.eps, "per_pixel": cfg.per_pixel, "reach": round(reach, 4)})
            if reach >= s.universal_reach:
                break
        chosen.append(cfg)
    return tuple(chosen), tried


# ---------------------------------------------------------------- step 3: the rounds
class AdversarialBatches:
    """The batch transform of PBE and AFT. Untargeted schedules: in the first `adv_batches` batches, the whole
    batch becomes PGD examples of itself. Targeted ones: a `universal_share` of every batch gets, in equal parts,
    each family's perturbation of the epoch (``new_epoch`` re-optimises them, toward `target` when given), or
    the fixed estimated `trigger` in their place. Labels stay the samples' own."""

    def __init__(self, model: nn.Module, data: ImageDataset, s: Schedule, adv_batches: int | None, ctx: Context,
                 families: tuple[UniversalConfig, ...] = (), target: int | None = None,
                 trigger: EstimatedTrigger | None = None, deltas: list[torch.Tensor] | None = None):
        self.model, self.data, self.s, self.adv_batches, self.ctx = model, data, s, adv_batches, ctx
        self.families, self.target, self.trigger = families, target, trigger
        self.done, self.deltas = 0, list(deltas or [])  # `deltas`: an earlier run's last perturbations, continued

    def new_epoch(self, epoch: int) -> None:
        s = self.s
        if not s.targeted or s.universal_share == 0 or self.trigger is not None:
            return
        labels = self.data.labels
        pool = torch.arange(len(self.data)) if self.target is None else (labels != self.target).nonzero()[:, 0]
        last, self.deltas = self.deltas, []
        for i, cfg in enumerate(self.families):
            start = last[i] if last and s.universal_refresh is not None else None
            fit = cfg if start is None else replace(cfg, epochs=s.universal_refresh)
            pick = pool[torch.randperm(len(pool), generator=self.ctx.gen)[:s.universal_images]]
            self.deltas.append(universal_perturbation(self.model, self.data.images[pick], labels[pick], fit,
                                                      self.ctx.gen, self.ctx.device, target=self.target, start=start))
            self.ctx.cost.add(Cost(forward_backward=fit.epochs * len(pick)))

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = self.s
        if not s.targeted:
            if self.adv_batches is None or self.done < self.adv_batches:
                x = pgd(self.model, x, y, s.pgd_config, self.ctx.gen)
                self.ctx.cost.add(Cost(forward_backward=len(x) * s.pgd_config.steps))
            self.done += 1
            return x
        end = min(len(x), round(s.universal_share * len(x)))
        # the batch is shuffled: any slice is a random share; one part per family, or one for the trigger
        parts = [self.trigger.apply] if self.trigger is not None else [
            lambda v, d=delta, c=cfg: apply_universal(v, d, c, self.ctx.gen)
            for delta, cfg in zip(self.deltas, self.families)]
        if parts:
            bounds = torch.linspace(0, end, len(parts) + 1).round().long().tolist()
            x = torch.cat([*[f(x[a:b]) for a, b, f in zip(bounds, bounds[1:], parts)], x[end:]])
        return x


def with_fitting_augmentation(model: nn.Module, data: ImageDataset, s: Schedule, ctx: Context,
                              plain_logits: torch.Tensor | None = None) -> tuple[Schedule, ImageDataset, dict]:
    """`s` and `data` with the crops and flips ``fitting_augmentation`` finds `model` keeps its accuracy under, and
    its finding (for the report)."""
    found = fitting_augmentation(model, data, s.crop_padding, ctx, plain_logits=plain_logits)
    if (found["crop_padding"], found["flip"]) != (s.crop_padding, data.flip):
        s, data = replace(s, crop_padding=found["crop_padding"]), replace(data, flip=found["flip"])
    return s, data, found


def adversarial_finetune(model: nn.Module, data: ImageDataset, s: Schedule, ctx: Context, *, epochs: int,
                         adv_batches: int | None, desc: str, families: tuple[UniversalConfig, ...] = (),
                         target: int | None = None, trigger: EstimatedTrigger | None = None,
                         deltas: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Fine-tune on `data` with the shared loop, ``AdversarialBatches`` and the schedule's SGD settings; returns the
    last epoch's universal perturbations (`deltas`: a previous call's, to continue from)."""
    batches = AdversarialBatches(model, data, s, adv_batches, ctx, families, target, trigger, deltas)
    sgd_finetune(model, data, ctx, epochs=epochs, lr=s.lr, batch_size=s.batch_size, momentum=s.momentum,
                 weight_decay=s.weight_decay, crop_padding=s.crop_padding, lr_schedule=s.lr_schedule,
                 transform=batches, on_epoch=batches.new_epoch, desc=desc)
    return batches.deltas


def logits(model: nn.Module, data: ImageDataset, ctx: Context) -> torch.Tensor:
    ctx.cost.add(Cost(forward=len(data)))
    return predict(model, data.images, return_logits=True)


def run_monitor(model, data: ImageDataset, probe: torch.Tensor, s: Schedule, ctx: Context) -> Monitor:
    ctx.cost.add(Cost(forward_backward=len(probe) * s.monitor_pgd.steps, forward=2 * len(probe)))
    return monitor(model, data.images[probe], data.labels[probe], data.num_classes, s.monitor_pgd)


# the share of held-out images of other labels that a held-back cluster's estimated trigger must still send to the
# named target after a round for the optimised family to count as having missed it: the share the isolation asks
# of an estimate to call it a trigger at all
VERIFY_REACH = MIN_FOOLING


def trigger_reach(model: nn.Module, trigger: EstimatedTrigger, data: ImageDataset, target: int,
                  exclude: torch.Tensor, ctx: Context) -> float:
    """Share of ``HELD_OUT`` training images of labels other than `target`, outside `exclude` (the ones
    fine-tuned on), that `model` assigns to `target` once `trigger` is pasted on them (its own generator,
    so that measuring draws nothing from the run's)."""
    pool = ((data.labels != target) & ~exclude).nonzero().flatten()
    held = pool[torch.randperm(len(pool), generator=torch.Generator().manual_seed(ctx.seed))[:HELD_OUT]]
    ctx.cost.add(Cost(forward=len(held)))
    x = trigger.apply(data.images[held].float() / 255)
    return round(float((predict(model, x) == target).float().mean()), 4)


def track(model: nn.Module, plan: Plan, scan: Detection | None, iso: Isolation | None, data: ImageDataset,
          s: Schedule, ctx: Context, trained: torch.Tensor, before: bool = False) -> dict | None:
    """The erasure tracker's reading (``pbe.tracker``) for `plan`: the estimated trigger's reach where the plan
    fine-tunes against it or holds its cluster back in the target (the trigger's own reach estimates the ASR; the
    scan's statistic, at the scan's small budget, reads "gone" while a larger trigger still works), else the scan's
    statistic on the target (or on the scan's top label where nothing is named); `before`: on the original model,
    from what the plan already measured where it can. None without a scan (the untargeted schedules)."""
    if scan is None:
        return None
    if (plan.trigger == "estimated" or plan.check_cluster) and iso is not None and iso.trigger is not None:
        return trigger_track(model, iso.trigger, data, plan.target, trained, ctx.seed, ctx.cost).as_dict()
    label = plan.target if plan.target is not None else scan.top_label
    family = "warp" if scan.evidence == "warp" and scan.top_label == label else "universal"
    threshold = weak_evidence_threshold(data.num_classes)
    if before:
        return scan_track_before(scan, label, family, data.num_classes, threshold).as_dict()
    return scan_track(model, data, scan, label, family, budget=s.scan_budget, l2_rms=s.scan_l2_rms,
                      warp_shift=WARP_SHIFT, seed=ctx.seed, threshold=threshold, cost=ctx.cost).as_dict()


def least_suspicious(score: torch.Tensor, labels: torch.Tensor, fraction: float, balanced: bool) -> torch.Tensor:
    """Indices of the `fraction` of all samples with the lowest `score` (``inf`` = refused), sorted;
    `balanced`: that fraction of every label's samples, so that the subset keeps the classes' shares."""
    if not balanced:
        k = min(int(torch.isfinite(score).sum()), max(1, round(fraction * len(score))))
        return score.topk(k, largest=False).indices.sort().values
    picked = []
    for c in labels.unique():
        idx = (labels == c).nonzero().flatten()
        k = min(int(torch.isfinite(score[idx]).sum()), round(fraction * len(idx)))
        picked.append(idx[score[idx].topk(k, largest=False).indices])
    return torch.cat(picked).sort().values


def readmitted(z: torch.Tensor, labels: torch.Tensor, target: int, isolated: torch.Tensor) -> torch.Tensor:
    """The distrusted target's samples a later round may take, with their label (a mask): as many as the median
    label holds (``typical_count``), those to which the purified model (logits `z`) gives the target the highest
    probability, never one the isolation holds as poison. After round 1 has unlearned the trigger, a poison sample
    is an image of another class again and its target probability falls, while the target's own images keep
    theirs: the ranking gives round 2 the target's clean images back, and with them the target's recall, which a
    round without any target sample loses (on the dev LeNets 68-78 % -> 5-14 %)."""
    idx = ((labels == target) & ~isolated).nonzero().flatten()
    k = min(len(idx), round(typical_count(labels, target)))
    mask = torch.zeros(len(labels), dtype=torch.bool)
    mask[idx[z[idx].softmax(1)[:, target].topk(k).indices]] = True
    return mask


def relabelled(z: torch.Tensor, labels: torch.Tensor, distrusted: torch.Tensor, mode: str) -> torch.Tensor:
    """The next round's labels of the distrusted samples (``Plan.relabel``): those the purified model moved to
    another label with at least RELABEL_CONFIDENCE get it; with "all", every other one gets its best label other
    than its own. Returns the new labels; the changed samples are where they differ or that "all" covered."""
    prob, pred = z.softmax(1).max(1)
    moved = distrusted & (pred != labels) & (prob >= RELABEL_CONFIDENCE)
    new = labels.clone()
    new[moved] = pred[moved]
    if mode == "all":
        rest = distrusted & ~moved
        new[rest] = z.masked_fill(F.one_hot(labels, z.shape[1]).bool(), float("-inf")).argmax(1)[rest]
    return new


def acc_drop_estimate(z0: torch.Tensor, z: torch.Tensor, labels: torch.Tensor, allowed: torch.Tensor,
                      trained: torch.Tensor) -> dict:
    """PBE's own estimate of the clean-accuracy drop, without clean data: on the training samples it
    never fine-tuned on and did not refuse, per label, the share the original model got right minus
    the share the purified one gets right; the mean over labels of those drops, leaving out the
    largest one (an all-to-one backdoor's poison sits in one label, where "right" means the target and
    erasing it looks like damage). Poison spread over every label (all-to-all) still inflates it."""
    pool = allowed & ~trained
    drops = []
    for c in labels.unique():
        idx = (pool & (labels == c)).nonzero().flatten()
        if len(idx) >= 5:
            before = (z0[idx].argmax(1) == c).float().mean()
            after = (z[idx].argmax(1) == c).float().mean()
            drops.append(float(before - after))
    if len(drops) < 3:
        return {"estimate": None, "samples": int(pool.sum())}
    kept = sorted(drops)[:-1]
    return {"estimate": round(sum(kept) / len(kept), 5), "samples": int(pool.sum()),
            "per_label": [round(d, 5) for d in drops]}


# an estimated clean-accuracy drop (a share) above which PBE warns: the goal's 3 points
ACC_DROP_WARNING = 0.03


def warn_on(report: dict) -> list[str]:
    """What PBE says a user must know from its own report, without ground truth: it found nothing to aim at (so
    its fine-tuning was untargeted), the erasure tracker still reads the backdoor it aimed at after the last round,
    or it estimates it cost more than ACC_DROP_WARNING of clean accuracy. Each message is also issued as a
    ``PBEWarning``."""
    said, plan, after = [], report.get("plan") or {}, report.get("tracker_after")
    if report["schedule"]["targeted"] and plan.get("distrust") == "none":
        said.append("pbe: neither the target scan nor the isolation found a backdoor, so the fine-tuning was "
                    "untargeted and may have left one in place; if you know the target label, pass it (target=, "
                    "CLI --target)")
    elif after is not None and after["there"]:
        said.append(f"pbe: after the last round the erasure tracker still reads the backdoor ({after['evidence']}: "
                    f"reach {100 * after['reach']:.0f} % toward label {after['label']}); it may not be erased: "
                    "measure the purified model, or run PBE again on it")
    estimate = (report.get("acc_drop_estimate") or {}).get("estimate")
    if estimate is not None and estimate > ACC_DROP_WARNING:
        said.append(f"pbe: it estimates that the erasure cost {100 * estimate:.1f} points of clean accuracy (from "
                    "training samples it never fine-tuned on); measure the purified model on held-out clean data, "
                    "or try a smaller lr")
    for message in said:
        warnings.warn(message, PBEWarning, stacklevel=3)
    return said


def ground_truth(model: nn.Module, ev: Evaluation | None, suspicion: torch.Tensor, z: torch.Tensor,
                 z0: torch.Tensor, changed: torch.Tensor | None) -> dict:
    """What the caller's ``Evaluation`` says of a round (never used by the defence): ACC / ASR / RA, how well
    the suspicion ranks the poison, and how many relabelled samples were poison."""
    row = {"metrics": measure(model, ev)}
    if ev is not None and ev.poison_indices is not None:
        row["detection"] = ranking_quality(suspicion, z.argmax(1) != z0.argmax(1), ev.poison_indices)
        if changed is not None:
            poison = torch.zeros(len(z), dtype=torch.bool)
            poison[ev.poison_indices] = True
            row["relabelled_poison"] = int((changed & poison).sum())
    return row


@dataclass
class Rounds:
    """What one round hands the next: the plan (the check may switch it), the samples it distrusts, those the
    isolation holds as poison, those a subset may take, the next subset, every sample fine-tuned on so far, and the
    labels the rounds train with."""

    plan: Plan
    distrusted: torch.Tensor
    isolated: torch.Tensor
    allowed: torch.Tensor
    subset: torch.Tensor
    trained: torch.Tensor
    train_view: ImageDataset

    @classmethod
    def start(cls, plan: Plan, distrusted: torch.Tensor, isolated: torch.Tensor, data: ImageDataset, fraction: float,
              ctx: Context) -> "Rounds":
        """Round 1's subset: a random `fraction` of the training set, none of it distrusted."""
        allowed = ~distrusted if plan.distrust != "none" else torch.ones(len(data), dtype=torch.bool)
        pool, size = allowed.nonzero().flatten(), max(1, round(fraction * len(data)))
        subset = pool[torch.randperm(len(pool), generator=ctx.gen)[:size]].sort().values
        return cls(plan, distrusted, isolated, allowed, subset, torch.zeros(len(data), dtype=torch.bool), data)

    def check(self, model: nn.Module, iso: Isolation | None, data: ImageDataset, ctx: Context, row: dict) -> None:
        """A held-back cluster's trigger tried on the purified model: still working, the plan switches to it."""
        if not self.plan.check_cluster:
            return
        row["trigger_reach"] = trigger_reach(model, iso.trigger, data, self.plan.target, self.trained, ctx)
        if row["trigger_reach"] >= VERIFY_REACH:  # the optimised family missed the trigger
            self.plan, row["switched_to_isolation"] = self.plan.switch_to_cluster(), True
            self.distrusted = iso.suspected
            self.allowed = ~self.distrusted

    def select(self, z: torch.Tensor, suspicion: torch.Tensor, labels: torch.Tensor, fraction: float,
               balanced: bool) -> None:
        """The next subset: the least suspicious `fraction` (of every label, `balanced`) of the allowed samples,
        with the distrusted target's samples ``readmitted`` where the plan says."""
        if self.plan.distrust == "target" and self.plan.readmit:
            self.allowed = (labels != self.plan.target) | readmitted(z, labels, self.plan.target, self.isolated)
        self.subset = least_suspicious(suspicion.masked_fill(~self.allowed, float("inf")), labels, fraction, balanced)

    def relabel(self, z: torch.Tensor, data: ImageDataset, row: dict) -> torch.Tensor | None:
        """The distrusted samples ``relabelled`` join the next subset with their new labels; the changed ones."""
        if self.plan.relabel == "none":
            return None
        labels = relabelled(z, data.labels, self.distrusted & ~self.allowed, self.plan.relabel)  # readmitted: kept
        changed = (labels != data.labels) | (self.distrusted if self.plan.relabel == "all" else False)
        self.train_view = ImageDataset(data.images, labels, data.classes, data.name, data.flip, data.source)
        self.subset = torch.cat([self.subset, changed.nonzero().flatten()]).unique()
        row["relabelled"] = int(changed.sum())
        return changed


class PBE(Defense):
    """Progressive Backdoor Erasing without clean data (Mu et al., CVPR 2023,
    https://arxiv.org/abs/2202.06312); the module docstring says what the default does.

    Arguments:
        schedule (str | Schedule): a name in ``SCHEDULES`` (default ``DEFAULT_SCHEDULE``; ``"paper"``: the
            authors' 4 rounds x 10 epochs, lr 1e-3, PGD-7 at 6/255, subsets 5/20/50/70 %) or a ``Schedule``.
        lr (float | None): overrides the schedule's learning rate (default None: keep it).
        target (int | None): a target label the defender already knows or suspects (default None: the
            scan names it, or none). It takes the place of the scan's label in the plan; the scan still runs.

    The report holds the plan, per round the selected subset, the erasure tracker's reading, the monitor (where the
    schedule runs it) and (with an ``Evaluation``) ACC / ASR / RA and the ranking quality; ``scores`` are per-sample
    suspicion (higher = more suspicious: disagreement with the infected model).

    Example::

        >>> result = pbe.defenses.create("pbe")(model, poisoned_train_set)
        >>> result.model, result.report["plan"]["target"]
    """

    name = "pbe"
    setting = "no-clean"

    def __init__(self, schedule: str | Schedule = DEFAULT_SCHEDULE, lr: float | None = None,
                 target: int | None = None):
        if not isinstance(schedule, Schedule) and schedule not in SCHEDULES:
            raise PBEError(f"pbe: unknown schedule {schedule!r}; available: {', '.join(SCHEDULES)}")
        if lr is not None and not (isinstance(lr, (int, float)) and lr > 0):
            raise PBEError(f"pbe: lr must be a positive number, got {lr!r}")
        if target is not None and not (isinstance(target, int) and target >= 0):
            raise PBEError(f"pbe: target must be a label (an int >= 0) or None, got {target!r}")
        super().__init__(schedule=schedule, lr=lr, target=target)

    def resolved(self) -> dict:
        return {**self.params, "schedule": get_schedule(self.params["schedule"], lr=self.params["lr"]).as_dict()}

    def _defend(self, model, data, ctx: Context):
        s, given = get_schedule(self.params["schedule"], lr=self.params["lr"]), self.params["target"]
        if len(data) < 10:
            raise PBEError("pbe needs the (possibly poisoned) training set; got fewer than 10 samples")
        if given is not None and given >= data.num_classes:
            raise PBEError(f"pbe: target {given} is not a label of the data ({data.num_classes} classes)")
        original = copy.deepcopy(model).eval()
        feats, z0 = self._original_outputs(original, data, s, ctx)
        s, data, augmentation = with_fitting_augmentation(original, data, s, ctx, plain_logits=z0)
        probe = probe_indices(data.labels, s.probe_size, ctx.seed)
        before = run_monitor(model, data, probe, s, ctx).as_dict() if s.monitor else None
        report = {"schedule": s.as_dict(), "augmentation": augmentation, "probe_indices": probe.tolist(),
                  "monitor_before": before, "rounds": []}
        # 1. plan
        plan, iso, scan = self._plan(original, data, feats, given, s, ctx, report)
        distrusted = self._distrusted(plan, iso, data)
        # 2. calibrate
        families = tuple(c for c in s.families if plan.families is None or c.kind in plan.families) or s.families
        if s.targeted and plan.target is not None and plan.trigger == "optimised" and s.universal_reach > 0:
            families, report["universal_calibration"] = calibrate(original, data, plan.target, families, s, ctx)
        # 3. rounds: fine-tune -> measure -> check -> select -> relabel
        isolated = iso.suspected.clone() if iso is not None else torch.zeros(len(data), dtype=torch.bool)
        state = Rounds.start(plan, distrusted, isolated, data, s.fractions[0], ctx)
        report["tracker_before"] = track(original, plan, scan, iso, data, s, ctx, state.trained, before=True)
        for t in range(len(s.fractions)):
            state.trained[state.subset] = True
            adversarial_finetune(model, state.train_view.subset(state.subset), s, ctx, epochs=s.epochs[t],
                                 adv_batches=s.adv_batches[t], desc=f"PBE round {t + 1}/{len(s.fractions)}",
                                 families=families, target=plan.target if s.targeted else None,
                                 trigger=iso.trigger if state.plan.trigger == "estimated" else None)
            z = logits(model, data, ctx)
            suspicion = 0.5 - 0.5 * F.cosine_similarity(z0, z, dim=1)  # higher = more suspicious
            mon = run_monitor(model, data, probe, s, ctx) if s.monitor else None
            row = {"round": t + 1, "subset_size": len(state.subset), "subset_indices": state.subset.tolist(),
                   "epochs": s.epochs[t], "monitor": mon.as_dict() if mon else None,
                   "tracker": track(model, state.plan, scan, iso, data, s, ctx, state.trained),
                   "epoch_equivalents": ctx.cost.epoch_equivalents(len(data))}
            last = t + 1 == len(s.fractions)
            stopped = s.early_stop and not last and plan.target is None and before["suspected"] and not mon.suspected
            changed = None
            if not (last or stopped):
                state.check(model, iso, data, ctx, row)
                state.select(z, suspicion, data.labels, s.fractions[t + 1], s.balanced)
                changed = state.relabel(z, data, row)
            row.update(ground_truth(model, ctx.evaluation, suspicion, z, z0, changed))
            report["rounds"].append(row)
            if stopped:
                break
        report.update(plan=asdict(state.plan), scores=[round(float(v), 6) for v in suspicion], stopped_early=stopped,
                      monitor_after=report["rounds"][-1]["monitor"], tracker_after=report["rounds"][-1]["tracker"],
                      acc_drop_estimate=acc_drop_estimate(z0, z, data.labels, state.allowed, state.trained))
        report["warnings"] = warn_on(report)
        return model, report, None

    @staticmethod
    def _original_outputs(original, data, s: Schedule, ctx: Context) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The infected model's penultimate features (for the isolation; None without a linear head) and logits."""
        if s.targeted and has_linear_head(original):
            feats, z0 = penultimate(original, data.images, device=ctx.device, with_logits=True)
            ctx.cost.add(Cost(forward=len(data)))
            return feats, z0
        return None, logits(original, data, ctx)

    @staticmethod
    def _plan(original, data, feats, given: int | None, s: Schedule, ctx: Context,
              report: dict) -> tuple[Plan, Isolation | None, Detection | None]:
        """Step 1: the target scan and the isolation, their verdict (``pbe.detection.decide``), then
        ``make_plan``; all recorded in the report."""
        if not s.targeted:
            plan = Plan(target=given, named_by="given" if given is not None else "none")
            report["target"] = plan.target
            return plan, None, None
        scan = target_scan(original, data, s, ctx)
        report["scan"] = scan.as_dict()
        scan_label = scan_target(scan, data.num_classes)
        iso = None
        if feats is None:
            report["isolation"] = "skipped: the model has no nn.Linear head to read features from"
        else:  # a whole label is looked for only where nothing else names a target
            iso = run_isolation(original, data, feats, named=given is not None or scan_label is not None, ctx=ctx)
            report["isolation"] = iso.as_dict()
        # the labels whose poison the isolation holds (a flagged prototype label has no sample to act on: PBE leaves
        # it to the scan, where pbe.detect counts it as a cluster)
        clusters = [] if iso is None else sorted(set(data.labels[iso.suspected].tolist()))
        verdict = decide({k: tuple(v) for k, v in scan.tests.items()}, len(scan.scores), scan.alpha, clusters, None)
        report["verdict"] = asdict(verdict)
        plan = make_plan(given=given, verdict=verdict, scan_label=scan_label, scan_evidence=scan.evidence,
                         cluster_labels=clusters, whole_label=None if iso is None else iso.whole_label,
                         labels=data.labels)
        if plan.target is not None and iso is not None:
            iso.suspected &= data.labels == plan.target  # a named target: only a cluster of that label counts
        report["target"] = plan.target
        return plan, iso, scan

    @staticmethod
    def _distrusted(plan: Plan, iso: Isolation | None, data: ImageDataset) -> torch.Tensor:
        """The samples the plan distrusts (a mask): the target's, or the isolated poison."""
        if plan.distrust == "cluster":
            return iso.suspected.clone()
        if plan.distrust == "target":
            return data.labels == plan.target
        return torch.zeros(len(data), dtype=torch.bool)


def decisions(report: dict) -> dict:
    """What a PBE run decided, from its report, for a reader: the plan, the scan's top label and robust z, the
    labels whose poison the isolation confirmed, the samples it isolated, per round the check of a held-back
    cluster and whether the run switched to it, and the erasure tracker before and after every round (``pbe.tracker``:
    whether the backdoor is still there)."""
    scan, iso = report.get("scan") or {}, report.get("isolation")
    iso = iso if isinstance(iso, dict) else {}
    return {"target": report.get("target"), "plan": report.get("plan"), "scan_top_label": scan.get("top_label"),
            "scan_z": scan.get("score"), "isolation_flagged": iso.get("flagged"),
            "isolation_prototypes": iso.get("prototypes"), "isolated": iso.get("suspected"),
            "whole_label": iso.get("whole_label"),
            "trigger_reach": [r.get("trigger_reach") for r in report.get("rounds", [])],
            "switched_to_isolation": any(r.get("switched_to_isolation") for r in report.get("rounds", [])),
            "verdict": report.get("verdict"), "tracker": [report.get("tracker_before")] + [
                r.get("tracker") for r in report.get("rounds", [])]}


def erase(model: nn.Module, train_set: ImageDataset, schedule: str | Schedule = DEFAULT_SCHEDULE, *, seed: int = 0,
          device="auto", progress: bool = True, evaluation: Evaluation | None = None,
          target: int | None = None) -> tuple[nn.Module, dict]:
    """PBE without clean data: ``(purified copy of model, report)``; see ``PBE``."""
    result = PBE(schedule=schedule, target=target)(model, train_set, seed=seed, device=device, progress=progress,
                                                   evaluation=evaluation)
    return result.model, result.report
