"""Adversarial fine-tuning (AFT) with a small clean extra set: PBE's first setting.

Mu et al., "Progressive Backdoor Erasing via connecting Backdoor and Adversarial Attacks", CVPR 2023,
https://arxiv.org/abs/2202.06312. The paper fine-tunes on the clean set with untargeted PGD examples labelled with
their own labels (authors' code: 20 epochs, the first 3 on PGD-7 at 6/255, step eps/5, SGD lr 1e-3 constant,
momentum 0.9, weight decay 5e-4, batch 128): ``schedule="paper"``. On this toolkit's models that leaves the
backdoors in place (untargeted examples rarely land on the target: ``experiments/results/premise_cifar10.md``).

The default (``schedule="targeted"``) uses PBE's machinery on the clean set, which needs no distrust, no selection
and no relabelling there: every sample is clean, the target's own images included. ``AFT._defend`` runs:

1. **split** the clean set: a `check_fraction` is held out to measure the defence's own work;
2. **scan** the clean images for the target (PBE's target scan, ``pbe.detection``): its label where the statistic
   or the weak evidence names one, else no target;
3. **calibrate** each perturbation family toward the target (``pbe.defenses.pbe.calibrate``);
4. **fine-tune** on the rest with the samples' own labels, a third of every batch carrying universal perturbations
   of PBE's families (additive, mask, warp) re-optimised toward the target each epoch, continuing from the last
   epoch's (untargeted where none is named), `check_every` epochs at a time; after each, **check** on the held-out
   part: its accuracy against the original model's, and the erasure tracker (``pbe.tracker``: the scan's statistic
   re-measured on the target). It runs its `epochs` and does not stop on the tracker unless told (`stop_after`):
   on the dev BadNets model the tracker read "gone" at every check while the ASR was 2-55 %
   (``experiments/results/aft_checks.md``).

Like PBE, it fine-tunes with the strongest augmentation, up to its random crops and flips, that the model keeps its
accuracy under (``pbe.defenses.base.fitting_augmentation``): the plain images for a model trained without them.
"""
from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn

from pbe.activations import probe_indices
from pbe.adversarial import PAPER_PGD, PGDConfig
from pbe.data import ImageDataset
from pbe.defenses.base import Context, Defense, Evaluation, measure
from pbe.defenses.pbe import (ACC_DROP_WARNING, SCAN_FAMILIES, Plan, Schedule, adversarial_finetune, calibrate,
                              run_monitor, scan_target, target_scan, track, with_fitting_augmentation)
from pbe.metrics import predict
from pbe.utils import Cost, PBEError, PBEWarning

AFT_SCHEDULES = ("targeted", "paper")


class AFT(Defense):
    """Adversarial fine-tuning on a clean extra set (Mu et al., CVPR 2023, https://arxiv.org/abs/2202.06312); the
    default aims it at the target PBE's scan names on the clean images (see the module docstring).

    Arguments:
        schedule (str): "targeted" (default: the module docstring's steps) or "paper" (the authors' recipe).
        epochs (int): at most this many epochs on the clean set (default 20, the authors').
        adv_epochs (int): "paper" only: how many of them, first, are on PGD examples, at most `epochs` (default 3).
        lr (float): SGD learning rate, constant (default 1e-3, the authors').
        pgd (PGDConfig | None): "paper" only: the PGD budget (default None: PGD-7 at 6/255, step eps/5).
        batch_size (int): default 128; crop_padding (int): random-crop padding, default 4.
        check_fraction (float): "targeted" only: share of the clean set held out to check the work (default 0.2).
        check_every (int): "targeted" only: epochs between checks (default 2).
        stop_after (int | None): "targeted" only: stop once the tracker, which read the backdoor before, read it
            "gone" this many checks in a row (default None: never; see the module docstring).
        target (int | None): "targeted" only: the target label, if known (default None: the scan names it).

    Example::

        >>> result = pbe.defenses.create("aft")(model, clean_set, train_size=50_000)
        >>> result.report["stopped"], result.report["check"][-1]
    """

    name = "aft"
    setting = "clean-extra"

    def __init__(self, schedule: str = "targeted", epochs: int = 20, adv_epochs: int = 3, lr: float = 1e-3,
                 pgd: PGDConfig | None = None, batch_size: int = 128, crop_padding: int = 4,
                 check_fraction: float = 0.2, check_every: int = 2, stop_after: int | None = None,
                 target: int | None = None):
        if schedule not in AFT_SCHEDULES:
            raise PBEError(f"aft: schedule must be one of {AFT_SCHEDULES}, got {schedule!r}")
        if schedule == "paper" and isinstance(epochs, int) and isinstance(adv_epochs, int) and adv_epochs > epochs:
            raise PBEError(f"aft: the paper schedule's adv_epochs ({adv_epochs}) cannot exceed its epochs ({epochs})")
        if not (isinstance(lr, (int, float)) and lr > 0):
            raise PBEError(f"aft: lr must be a positive number, got {lr!r}")
        if not (isinstance(batch_size, int) and batch_size >= 1
                and isinstance(crop_padding, int) and crop_padding >= 0):
            raise PBEError(f"aft: batch_size must be an int >= 1 and crop_padding an int >= 0, got {batch_size}, "
                           f"{crop_padding}")
        if not (0 < check_fraction < 1 and isinstance(check_every, int) and check_every >= 1
                and (stop_after is None or isinstance(stop_after, int) and stop_after >= 1)):
            raise PBEError(f"aft: check_fraction must be in (0, 1), check_every an int >= 1 and stop_after one or "
                           f"None; got "
                           f"{check_fraction}, {check_every}, {stop_after}")
        if target is not None and (schedule == "paper" or not (isinstance(target, int) and target >= 0)):
            raise PBEError(f"aft: target must be a label (an int >= 0) and is the targeted schedule's; got {target!r} "
                           f"with schedule {schedule!r}")
        super().__init__(schedule=schedule, epochs=epochs, adv_epochs=adv_epochs, lr=lr, pgd=pgd,
                         batch_size=batch_size, crop_padding=crop_padding, check_fraction=check_fraction,
                         check_every=check_every, stop_after=stop_after, target=target)

    def _defend(self, model, data, ctx: Context):
        if self.params["schedule"] == "paper":
            return self._paper(model, data, ctx)
        return self._targeted(model, data, ctx)

    def _paper(self, model, data, ctx: Context):
        """The authors' recipe: untargeted PGD on the first `adv_epochs` epochs, then plain fine-tuning."""
        p = self.params
        s = Schedule(targeted=False, fractions=(1.0,), epochs=(p["epochs"],), adv_batches=(None,), lr=p["lr"],
                     lr_schedule="constant", pgd_config=p["pgd"] or PAPER_PGD, batch_size=p["batch_size"],
                     crop_padding=p["crop_padding"])
        probe = probe_indices(data.labels, min(s.probe_size, len(data)), ctx.seed)
        report = {"schedule": s.as_dict(), "clean_size": len(data),
                  "monitor_before": run_monitor(model, data, probe, s, ctx).as_dict(), "rounds": []}
        adv_batches = p["adv_epochs"] * -(-len(data) // s.batch_size)
        adversarial_finetune(model, data, s, ctx, epochs=p["epochs"], adv_batches=adv_batches, desc="AFT")
        mon = run_monitor(model, data, probe, s, ctx).as_dict()
        report["rounds"].append({"round": 1, "subset_size": len(data), "epochs": p["epochs"], "monitor": mon,
                                 "metrics": measure(model, ctx.evaluation)})
        report["monitor_after"] = mon
        return model, report, None

    def _targeted(self, model, data, ctx: Context):
        p = self.params
        if p["target"] is not None and p["target"] >= data.num_classes:
            raise PBEError(f"aft: target {p['target']} is not a label of the data ({data.num_classes} classes)")
        if len(data) < 4 * data.num_classes:
            raise PBEError(f"aft needs at least {4 * data.num_classes} clean images ({data.num_classes} classes), "
                           f"got {len(data)}")
        s = Schedule(lr=p["lr"], lr_schedule="constant", batch_size=p["batch_size"], crop_padding=p["crop_padding"])
        original = copy.deepcopy(model).eval()
        s, data, augmentation = with_fitting_augmentation(original, data, s, ctx)
        # 1. split
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(ctx.seed))
        n_check = max(data.num_classes, round(p["check_fraction"] * len(data)))
        check, fit = data.subset(order[:n_check].sort().values), data.subset(order[n_check:].sort().values)
        acc_before = held_out_accuracy(original, check, ctx)
        # 2. scan
        scan = target_scan(original, data, s, ctx)
        target = p["target"] if p["target"] is not None else scan_target(scan, data.num_classes)
        report = {"schedule": "targeted", "clean_size": len(data), "check_size": len(check),
                  "augmentation": augmentation, "scan": scan.as_dict(), "target": target, "check": []}
        # 3. calibrate
        kinds = SCAN_FAMILIES.get(scan.evidence) if target is not None and target == scan.top_label else None
        families = tuple(c for c in s.families if kinds is None or c.kind in kinds) or s.families
        if target is not None and s.universal_reach > 0:
            families, report["universal_calibration"] = calibrate(original, fit, target, families, s, ctx)
        # 4. fine-tune, check
        plan, untouched = Plan(target=target), torch.zeros(len(data), dtype=torch.bool)  # the tracker's view of it
        report["tracker_before"] = track(original, plan, scan, None, data, s, ctx, untouched, before=True)
        done, gone, report["stopped"], deltas = 0, 0, None, None
        while done < p["epochs"] and report["stopped"] is None:
            epochs = min(p["check_every"], p["epochs"] - done)
            deltas = adversarial_finetune(model, fit, s, ctx, epochs=epochs, adv_batches=None, deltas=deltas,
                                          desc=f"AFT epochs {done + 1}-{done + epochs}", families=families,
                                          target=target)
            done += epochs
            reading = track(model, plan, scan, None, data, s, ctx, untouched)
            gone = 0 if reading["there"] else gone + 1
            acc = held_out_accuracy(model, check, ctx)
            report["check"].append({"epochs": done, "tracker": reading, "check_acc": round(acc, 4),
                                    "check_acc_drop": round(acc_before - acc, 4),
                                    "passes": {"forward_backward": ctx.cost.forward_backward,
                                               "forward": ctx.cost.forward},
                                    "metrics": measure(model, ctx.evaluation)})
            if p["stop_after"] is not None and report["tracker_before"]["there"] and gone >= p["stop_after"]:
                report["stopped"] = f"the tracker read the backdoor gone {gone} checks in a row after {done} epochs"
        report.update(check_acc_before=round(acc_before, 4), epochs_run=done,
                      tracker_after=report["check"][-1]["tracker"],
                      check_acc_drop=report["check"][-1]["check_acc_drop"])
        report["warnings"] = warn_aft(report)
        return model, report, None


def held_out_accuracy(model: nn.Module, check: ImageDataset, ctx: Context) -> float:
    """`model`'s accuracy on the held-out clean images (counted in the cost)."""
    ctx.cost.add(Cost(forward=len(check)))
    return float((predict(model, check.images) == check.labels).float().mean())


def warn_aft(report: dict) -> list[str]:
    """What the defence tells its caller (``PBEWarning``): no target named, a backdoor the tracker still reads, an
    accuracy drop on the held-out clean images above ``ACC_DROP_WARNING``."""
    said = []
    if report["target"] is None:
        said.append("aft: the scan of the clean images named no target, so the fine-tuning was untargeted and may "
                    "have left a backdoor in place; if you know the target label, pass it (target=, CLI --target)")
    elif report["tracker_after"]["there"]:
        said.append(f"aft: after {report['epochs_run']} epochs the tracker still reads a backdoor toward label "
                    f"{report['target']} (z {report['tracker_after']['score']}); more epochs or pbe.erase may help")
    if report["check_acc_drop"] > ACC_DROP_WARNING:
        said.append(f"aft: clean accuracy on the held-out clean images fell {100 * report['check_acc_drop']:.1f} "
                    "points; try a smaller lr")
    for message in said:
        warnings.warn(message, PBEWarning, stacklevel=3)
    return said


def aft(model: nn.Module, clean_set: ImageDataset, *, schedule: str = "targeted", epochs: int = 20,
        adv_epochs: int = 3, pgd_config: PGDConfig | None = None, lr: float = 1e-3, seed: int = 0, device="auto",
        progress: bool = True, train_size: int | None = None, evaluation: Evaluation | None = None,
        batch_size: int = 128, crop_padding: int = 4, target: int | None = None) -> tuple[nn.Module, dict]:
    """AFT with a small clean set: ``(purified copy of model, report)``; `train_size` (the full
    training set's size) is the unit of the reported epoch-equivalents. See ``AFT``."""
    result = AFT(schedule=schedule, epochs=epochs, adv_epochs=adv_epochs, lr=lr, pgd=pgd_config,
                 batch_size=batch_size, crop_padding=crop_padding, target=target)(
        model, clean_set, seed=seed, device=device, progress=progress, evaluation=evaluation, train_size=train_size)
    return result.model, result.report
