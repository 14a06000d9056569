"""Adversarial fine-tuning (AFT, setting 1) and Progressive Backdoor Erasing (PBE, setting 2).

Both fine-tune on untargeted adversarial examples labelled with the samples' *own* labels, which
breaks the trigger -> target shortcut without knowing the trigger or the target. PBE also finds
clean training samples by itself: after each round it scores every training image by how much the
current model agrees with the original one (poisoned images disagree) and fine-tunes next on the
most-agreeing share. The defence never looks at the trigger, the target or the poison indices;
they are used only for the optional evaluation in the report.

Cost is counted in epoch-equivalents: (forward+backward image passes, every PGD step included, plus
forward-only passes / 3) / training-set size.
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from pbe.activations import Monitor, monitor, probe_indices
from pbe.adversarial import PGDConfig, UniversalConfig, apply_universal, pgd, universal_perturbation
from pbe.data import ImageDataset, augment
from pbe.metrics import evaluate, predict
from pbe.train import batches
from pbe.utils import PBEError, resolve_device, seed_everything, use_all_cpus


@dataclass(frozen=True)
class Schedule:
    """What PBE does per round t: fine-tune `epochs[t]` epochs on a subset of size `fractions[t]`
    of the training set (round 0: a random draw), with the first `adv_batches[t]` batches of the
    round adversarial (None: all of them).

    Levers beyond the paper: `adv_share` (share of an adversarial batch that gets per-image PGD; the
    rest stays clean, which protects accuracy), and `universal` (a universal perturbation of the
    current model, re-optimised every epoch on `universal_images` samples of the subset, pasted on a
    `universal_share` of every batch with the samples' own labels: a trigger-like direction the
    backdoor opens, unlearned without knowing the trigger)."""

    fractions: tuple[float, ...] = (0.05, 0.3)
    epochs: tuple[int, ...] = (4, 2)
    adv_batches: tuple[int | None, ...] = (None, 10)
    pgd: PGDConfig = PGDConfig(eps=6 / 255, steps=4, step=2 / 255)
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-4
    batch_size: int = 128
    crop_padding: int = 4
    early_stop: bool = True  # stop once a backdoor the monitor flagged before the defence is gone
    probe_size: int = 500  # images attacked for the monitor
    monitor_pgd: PGDConfig = PGDConfig(eps=6 / 255, steps=5, step=2 / 255)
    adv_share: float = 1.0
    universal: UniversalConfig | None = None
    universal_share: float = 0.0
    universal_images: int = 512

    def __post_init__(self):
        if not (0 <= self.adv_share <= 1 and 0 <= self.universal_share <= 1):
            raise PBEError(f"adv_share and universal_share must be in [0, 1], got {self.adv_share}, "
                           f"{self.universal_share}")
        if self.universal is not None and self.adv_share + self.universal_share > 1:
            raise PBEError("adv_share + universal_share must be <= 1 (they are disjoint parts of a batch)")
        n = len(self.fractions)
        if not (len(self.epochs) == len(self.adv_batches) == n) or n == 0:
            raise PBEError("schedule: fractions, epochs and adv_batches need one entry per round")
        if any(not 0 < f <= 1 for f in self.fractions):
            raise PBEError(f"schedule fractions must be in (0, 1], got {self.fractions}")

    def as_dict(self) -> dict:
        return asdict(self)


SCHEDULES = {
    # the authors' code: 4 rounds of 10 epochs, lr 1e-3, PGD-7 at 6/255, subsets 5/20/50/70%
    "paper": Schedule(fractions=(0.05, 0.2, 0.5, 0.7), epochs=(10, 10, 10, 10), adv_batches=(None, 31, 31, 31),
                      pgd=PGDConfig(eps=6 / 255, steps=7), lr=0.001, crop_padding=5, early_stop=False),
    # the default: two short rounds, fewer PGD steps, early stop (about 2-3 epoch-equivalents)
    "fast": Schedule(),
}


def get_schedule(schedule: str | Schedule, **overrides) -> Schedule:
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise PBEError(f"unknown schedule {schedule!r}; available: {', '.join(SCHEDULES)}")
        schedule = SCHEDULES[schedule]
    return replace(schedule, **{k: v for k, v in overrides.items() if v is not None})


class Cost:
    """Counts image passes to report epoch-equivalents."""

    def __init__(self):
        self.forward_backward = 0
        self.forward = 0

    def epoch_equivalents(self, train_size: int) -> float:
        return (self.forward_backward + self.forward / 3) / train_size


@dataclass
class Evaluation:
    """Ground truth the *caller* may pass to have the report measure the defence (never used by it)."""

    test_set: ImageDataset | None = None
    attack: object | None = None  # has apply(x), target, all_to_all
    poison_indices: torch.Tensor | None = None


def finetune(model: nn.Module, data: ImageDataset, epochs: int, adv_batches: int | None, s: Schedule,
             gen: torch.Generator, device, cost: Cost, progress: bool, desc: str) -> None:
    """SGD on `data` (shuffled, augmented); in the first `adv_batches` batches an `adv_share` of the
    batch becomes PGD examples of itself, with their own labels; with `s.universal`, a
    `universal_share` of every batch gets the epoch's universal perturbation, with their own labels."""
    opt = torch.optim.SGD(model.parameters(), lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay)
    done_adv, steps = 0, epochs * -(-len(data) // s.batch_size)
    bar = tqdm(total=steps, desc=desc, disable=not progress, leave=False, unit="batch")
    for _ in range(epochs):
        delta = None
        if s.universal is not None and s.universal_share > 0:
            pick = torch.randperm(len(data), generator=gen)[:s.universal_images]
            delta = universal_perturbation(model, data.images[pick], data.labels[pick], s.universal, gen, device)
            cost.forward_backward += s.universal.epochs * len(pick)
        for idx in batches(len(data), s.batch_size, gen):
            x = data.images[idx].to(device).float().div_(255)
            y = data.labels[idx].to(device)
            x = augment(x, s.crop_padding, data.flip, gen)
            n_adv = 0
            if adv_batches is None or done_adv < adv_batches:
                n_adv = round(s.adv_share * len(x))
                if n_adv:
                    x = torch.cat([pgd(model, x[:n_adv], y[:n_adv], s.pgd, gen), x[n_adv:]])
                    cost.forward_backward += n_adv * s.pgd.steps
                done_adv += 1
            if delta is not None:  # the batch is shuffled: any slice is a random share
                n_uni = round(s.universal_share * len(x))
                end = min(len(x), n_adv + n_uni)
                x = torch.cat([x[:n_adv], apply_universal(x[n_adv:end], delta, s.universal, gen), x[end:]])
            model.train()
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            cost.forward_backward += len(x)
            bar.update(1)
    bar.close()
    model.eval()


def _monitor(model, data: ImageDataset, probe: torch.Tensor, s: Schedule, cost: Cost) -> Monitor:
    cost.forward_backward += len(probe) * s.monitor_pgd.steps
    cost.forward += 2 * len(probe)
    return monitor(model, data.images[probe], data.labels[probe], data.num_classes, s.monitor_pgd)


def _measure(model, ev: Evaluation | None) -> dict:
    if ev is None or ev.test_set is None:
        return {}
    return evaluate(model, ev.test_set, ev.attack)


def ranking_quality(scores: torch.Tensor, flagged: torch.Tensor, poison_indices: torch.Tensor) -> dict:
    """Precision/recall of `flagged` as poisoned, and ROC-AUC of low score = poisoned."""
    from sklearn.metrics import roc_auc_score
    truth = torch.zeros(len(scores), dtype=torch.bool)
    truth[poison_indices] = True
    tp = int((flagged & truth).sum())
    auc = float(roc_auc_score(truth.numpy(), (-scores).numpy())) if 0 < truth.sum() < len(truth) else None
    return {"precision": tp / max(1, int(flagged.sum())), "recall": tp / max(1, int(truth.sum())), "auc": auc,
            "flagged": int(flagged.sum())}


def erase(model: nn.Module, train_set: ImageDataset, schedule: str | Schedule = "fast", *, seed: int = 0,
          device="auto", progress: bool = True, evaluation: Evaluation | None = None) -> tuple[nn.Module, dict]:
    """PBE without clean data. Returns a purified copy of `model` and a report (per round: selected
    subset, monitor, and with `evaluation` ACC/ASR/RA and ranking quality)."""
    s = get_schedule(schedule)
    if len(train_set) < 10:
        raise PBEError("erase() needs the (possibly poisoned) training set; got fewer than 10 samples")
    dev = resolve_device(device)
    if dev.type == "cpu":
        use_all_cpus()
    gen = seed_everything(seed)
    start, cost, n = time.time(), Cost(), len(train_set)
    original = copy.deepcopy(model).to(dev).eval()
    model = copy.deepcopy(model).to(dev).eval()
    z0 = predict(original, train_set.images, return_logits=True)
    cost.forward += n
    probe = probe_indices(train_set.labels, s.probe_size, seed)
    report = {"defense": "pbe", "setting": "no-clean", "seed": seed, "schedule": s.as_dict(), "train_size": n,
              "probe_indices": probe.tolist(), "monitor_before": _monitor(model, train_set, probe, s, cost).as_dict(),
              "before": _measure(model, evaluation), "rounds": []}
    subset = torch.randperm(n, generator=gen)[:max(1, round(s.fractions[0] * n))].sort().values
    for t in range(len(s.fractions)):
        finetune(model, train_set.subset(subset), s.epochs[t], s.adv_batches[t], s, gen, dev, cost, progress,
                 f"PBE round {t + 1}/{len(s.fractions)}")
        z = predict(model, train_set.images, return_logits=True)
        cost.forward += n
        scores = 0.5 + 0.5 * F.cosine_similarity(z0, z, dim=1)
        mon = _monitor(model, train_set, probe, s, cost)
        row = {"round": t + 1, "subset_size": len(subset), "subset_indices": subset.tolist(),
               "epochs": s.epochs[t], "monitor": mon.as_dict(), "metrics": _measure(model, evaluation),
               "epoch_equivalents": cost.epoch_equivalents(n), "elapsed_s": round(time.time() - start, 1)}
        if evaluation is not None and evaluation.poison_indices is not None:
            changed = z.argmax(1) != z0.argmax(1)
            row["detection"] = ranking_quality(scores, changed, evaluation.poison_indices)
        report["rounds"].append(row)
        # stop early only on evidence: the monitor flagged a backdoor before and no longer does
        if s.early_stop and report["monitor_before"]["suspected"] and not mon.suspected:
            report["stopped_early"] = t + 1 < len(s.fractions)
            break
        if t + 1 < len(s.fractions):
            subset = scores.topk(max(1, round(s.fractions[t + 1] * n))).indices.sort().values
    report["scores"] = [round(float(v), 6) for v in scores]
    report.setdefault("stopped_early", False)
    _finish(report, model, evaluation, cost, n, start)
    return model, report


def aft(model: nn.Module, clean_set: ImageDataset, *, epochs: int = 20, adv_epochs: int = 3,
        pgd_config: PGDConfig | None = None, lr: float = 0.001, seed: int = 0, device="auto",
        progress: bool = True, train_size: int | None = None, evaluation: Evaluation | None = None,
        **schedule_overrides) -> tuple[nn.Module, dict]:
    """AFT with a small clean set: `epochs` of fine-tuning, the first `adv_epochs` on PGD examples
    (authors' code: 20 and 3, lr 1e-3, PGD-7 at 6/255). `train_size` (the full training set's size)
    sets the unit of the reported epoch-equivalents; default the clean set's size."""
    if len(clean_set) == 0:
        raise PBEError("aft() needs a non-empty clean set")
    s = get_schedule(Schedule(fractions=(1.0,), epochs=(epochs,), adv_batches=(None,), lr=lr,
                              pgd=pgd_config or PGDConfig(eps=6 / 255, steps=7)), **schedule_overrides)
    dev = resolve_device(device)
    if dev.type == "cpu":
        use_all_cpus()
    gen = seed_everything(seed)
    start, cost, n = time.time(), Cost(), train_size or len(clean_set)
    model = copy.deepcopy(model).to(dev).eval()
    probe = probe_indices(clean_set.labels, min(s.probe_size, len(clean_set)), seed)
    report = {"defense": "aft", "setting": "clean-extra", "seed": seed, "schedule": s.as_dict(),
              "clean_size": len(clean_set), "train_size": n,
              "monitor_before": _monitor(model, clean_set, probe, s, cost).as_dict(),
              "before": _measure(model, evaluation), "rounds": []}
    adv_batches = adv_epochs * -(-len(clean_set) // s.batch_size)
    finetune(model, clean_set, epochs, adv_batches, s, gen, dev, cost, progress, "AFT")
    mon = _monitor(model, clean_set, probe, s, cost)
    report["rounds"].append({"round": 1, "subset_size": len(clean_set), "epochs": epochs, "monitor": mon.as_dict(),
                             "metrics": _measure(model, evaluation), "epoch_equivalents": cost.epoch_equivalents(n)})
    _finish(report, model, evaluation, cost, n, start)
    return model, report


def _finish(report: dict, model, evaluation, cost: Cost, n: int, start: float) -> None:
    report["monitor_after"] = report["rounds"][-1]["monitor"]
    report["after"] = report["rounds"][-1]["metrics"]
    report["epoch_equivalents"] = cost.epoch_equivalents(n)
    report["passes"] = {"forward_backward": cost.forward_backward, "forward": cost.forward}
    report["wall_s"] = round(time.time() - start, 1)
    if report["before"] and report["after"] and report["before"].get("asr") is not None:
        from pbe.metrics import der
        b, a = report["before"], report["after"]
        report["der"] = der(b["acc"], b["asr"], a["acc"], a["asr"])
