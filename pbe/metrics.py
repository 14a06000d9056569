"""Backdoor metrics (definitions in PBE.md): ACC, ASR, RA, DER and accuracy under an attack.

Pure functions take predictions and labels; `predict` and `evaluate` run a model in batches.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from pbe.checks import check_attack, check_model_and_data
from pbe.utils import PBEError, resolve_device

AttackFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x in [0,1], y) -> x'


def _as_float(x: torch.Tensor) -> torch.Tensor:
    return x.float().div(255) if x.dtype == torch.uint8 else x.float()


def predict(model: nn.Module, images: torch.Tensor, labels: torch.Tensor | None = None,
            transform: AttackFn | None = None, batch_size: int = 512, device="auto",
            return_logits: bool = False) -> torch.Tensor:
    """Predicted labels (or logits) for uint8 or [0, 1] float images, in eval mode, batched.

    `transform(x, y)` is applied to each float batch first (a trigger or an adversarial attack);
    it may need gradients, so only the model's forward pass runs under ``no_grad``.
    """
    dev = resolve_device(device) if device != "auto" else next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    try:
        for s in range(0, len(images), batch_size):
            x = _as_float(images[s:s + batch_size].to(dev))
            y = None if labels is None else labels[s:s + batch_size].to(dev)
            if transform is not None:
                x = transform(x, y)
            with torch.no_grad():
                logits = model(x)
            out.append(logits.float().cpu() if return_logits else logits.argmax(1).cpu())
    finally:
        model.train(was_training)
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


def accuracy(pred: torch.Tensor, labels: torch.Tensor) -> float:
    if pred.shape != labels.shape:
        raise PBEError(f"predictions {tuple(pred.shape)} and labels {tuple(labels.shape)} differ in shape")
    return float((pred == labels).float().mean()) if len(labels) else float("nan")


def target_labels(labels: torch.Tensor, target: int | None, all_to_all: bool, num_classes: int) -> torch.Tensor:
    """The label a triggered image should get: ``t`` (all-to-one) or ``(y + 1) mod C`` (all-to-all)."""
    if all_to_all:
        return (labels + 1) % num_classes
    if target is None:
        raise PBEError("an all-to-one attack needs a target label")
    return torch.full_like(labels, int(target))


def asr_mask(labels: torch.Tensor, target: int | None, all_to_all: bool) -> torch.Tensor:
    """Which test images count for ASR/RA: all for all-to-all, non-target ones for all-to-one."""
    return torch.ones_like(labels, dtype=torch.bool) if all_to_all else labels != int(target)


def attack_success_rate(pred_triggered: torch.Tensor, labels: torch.Tensor, target: int | None = None,
                        all_to_all: bool = False, num_classes: int | None = None) -> float:
    """Fraction of counted triggered images classified as the attack's target label."""
    if all_to_all and num_classes is None:
        raise PBEError("all-to-all ASR needs num_classes")
    keep = asr_mask(labels, target, all_to_all)
    goal = target_labels(labels, target, all_to_all, num_classes or 0)
    return accuracy(pred_triggered[keep], goal[keep])


def robust_accuracy(pred_triggered: torch.Tensor, labels: torch.Tensor, target: int | None = None,
                    all_to_all: bool = False) -> float:
    """RA: fraction of the same counted triggered images classified as their true label."""
    keep = asr_mask(labels, target, all_to_all)
    return accuracy(pred_triggered[keep], labels[keep])


def der(acc_before: float, asr_before: float, acc_after: float, asr_after: float) -> float:
    """Defence effectiveness rating in [0, 1]; 0.5 means no change, 1 a full ASR drop at no ACC cost."""
    return (max(0.0, asr_before - asr_after) - max(0.0, acc_before - acc_after) + 1.0) / 2.0


def accuracy_under(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, attack_fn: AttackFn,
                   batch_size: int = 256, device="auto") -> float:
    """Accuracy on ``attack_fn(x, y)``, e.g. adversarial robust accuracy under PGD."""
    return accuracy(predict(model, images, labels, attack_fn, batch_size, device), labels)


def evaluate(model: nn.Module, test_set, attack=None, batch_size: int = 512, device="auto", *,
             check: bool = True) -> dict:
    """ACC on `test_set`; with an attack (``apply(x)``, ``target``, ``all_to_all``), also ASR and RA.

    Arguments:
        model: a classifier taking [0, 1] images and returning logits.
        test_set: a ``pbe.data.ImageDataset``.
        attack: an attack object (``attacks.create(...)`` or ``attacks.load(path)``), or None for ACC only.
        batch_size: images per forward pass.
        device: "auto" (the model's), "cpu" or "cuda[:N]".
        check: run ``pbe.checks``' boundary checks first (False for a caller that already did).
    """
    if check:
        check_attack(attack, where="metrics.evaluate")
        check_model_and_data(model, test_set, where="metrics.evaluate", what="the test set")
    pred = predict(model, test_set.images, batch_size=batch_size, device=device)
    result = {"acc": accuracy(pred, test_set.labels), "asr": None, "ra": None}
    if attack is not None:
        trig = predict(model, test_set.images, test_set.labels, lambda x, y: attack.apply(x),
                       batch_size, device)
        result["asr"] = attack_success_rate(trig, test_set.labels, attack.target, attack.all_to_all,
                                            test_set.num_classes)
        result["ra"] = robust_accuracy(trig, test_set.labels, attack.target, attack.all_to_all)
    return result


def ranking_quality(scores: torch.Tensor, flagged: torch.Tensor, poison_indices: torch.Tensor) -> dict:
    """How well a defence found the poison: precision / recall of the `flagged` mask, and ROC-AUC of
    `scores` (higher = more suspicious, the rule of every defence here) against the true poison."""
    from sklearn.metrics import roc_auc_score
    scores = torch.as_tensor(scores, dtype=torch.float64)
    truth = torch.zeros(len(scores), dtype=torch.bool)
    truth[poison_indices] = True
    tp = int((flagged & truth).sum())
    auc = float(roc_auc_score(truth.numpy(), scores.numpy())) if 0 < truth.sum() < len(truth) else None
    return {"precision": tp / max(1, int(flagged.sum())), "recall": tp / max(1, int(truth.sum())), "auc": auc,
            "flagged": int(flagged.sum())}
