"""PBE's premise, measured: do untargeted adversarial perturbations of an infected model land on the
backdoor's target more often than natural confusion predicts?

``label_shares(model, images, labels, target=..., perturbations=FAMILIES)`` attacks a probe of
correctly classified images with each perturbation family (per-image L-inf / L2 PGD, a sparse
patch, and universal L-inf / L2 / patch perturbations optimised on one half of the probe and
measured on the other) and returns, per family, the success rate, the share of fooled images that
land on the target (all-to-all: on ``(y + 1) mod C``), the share the clean runner-up labels predict
(natural confusion), their ratio (lift) and the most attracting label.

>>> rows = label_shares(model, x, y, num_classes=10, target=0)
>>> [(r["family"], r["eps"], r["target_share"], r["expected_share"]) for r in rows]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from pbe.activations import runner_up_labels
from pbe.adversarial import (PGDConfig, UniversalConfig, adversarial_examples, apply_universal, patch_attack,
                             universal_perturbation)
from pbe.metrics import predict, target_labels
from pbe.utils import PBEError

PGD_STEPS = 10  # per-image PGD steps of the premise probes
PATCH_STEPS = 20


@dataclass(frozen=True)
class Family:
    """One perturbation family at one budget. `kind`: linf | l2 | patch; `eps`: the norm budget (linf
    in [0, 1] pixel units, l2 in the same units) or the patch side in pixels."""

    kind: str
    eps: float
    universal: bool = False

    @property
    def label(self) -> str:
        budget = f"{round(self.eps * 255)}/255" if self.kind == "linf" else (
            f"{self.eps:g}" if self.kind == "l2" else f"{int(self.eps)}x{int(self.eps)}")
        return f"{'universal ' if self.universal else ''}{self.kind} {budget}"


FAMILIES = (
    *(Family("linf", e / 255) for e in (2, 4, 6, 8, 16)),
    *(Family("l2", e) for e in (0.25, 0.5, 1.0)),
    *(Family("patch", s) for s in (3, 5)),
    *(Family("linf", e / 255, True) for e in (8, 16)),
    *(Family("l2", e, True) for e in (2.0, 4.0)),
    *(Family("patch", s, True) for s in (3, 5)),
)


def _perturb(model, x, y, fam: Family, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Adversarial images for the evaluated half (universal) or all images; their indices; and the
    forward+backward image passes spent."""
    if fam.universal:
        half = len(x) // 2
        cfg = (UniversalConfig(kind="patch", size=int(fam.eps)) if fam.kind == "patch"
               else UniversalConfig(kind=fam.kind, eps=fam.eps))
        delta = universal_perturbation(model, x[:half], y[:half], cfg, generator=gen)
        return apply_universal(x[half:], delta, cfg, gen), torch.arange(half, len(x)), cfg.epochs * half
    if fam.kind == "patch":
        return patch_attack(model, x, y, size=int(fam.eps), steps=PATCH_STEPS, generator=gen), \
            torch.arange(len(x)), PATCH_STEPS * len(x)
    cfg = PGDConfig(eps=fam.eps, steps=PGD_STEPS, step=fam.eps / 4, norm=fam.kind)
    return adversarial_examples(model, x, y, cfg), torch.arange(len(x)), PGD_STEPS * len(x)


def label_shares(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, num_classes: int,
                 target: int | None = None, all_to_all: bool = False, families=FAMILIES,
                 seed: int = 0) -> tuple[list[dict], int]:
    """Per family: success, target share vs natural-confusion share, lift, top label. `images` float in
    [0, 1] (or uint8), all classified correctly by `model` (the caller filters). For a clean model
    pass ``target=None``: only the top label is reported. Returns the rows and the image passes
    spent (forward+backward, plus forward-only / 3)."""
    if len(images) < 4:
        raise PBEError(f"the premise probe needs at least 4 images, got {len(images)}")
    x = images.float() / 255 if images.dtype == torch.uint8 else images
    gen = torch.Generator().manual_seed(seed)
    logits = predict(model, x, return_logits=True)
    runner_up = runner_up_labels(logits, labels)
    rows, passes = [], len(x) / 3
    for fam in families:
        x_adv, idx, cost = _perturb(model, x, labels, fam, gen)
        pred = predict(model, x_adv)
        y = labels[idx]
        fooled = pred != y
        passes += cost + len(idx) / 3
        hist = torch.bincount(pred[fooled], minlength=num_classes).float()
        row = {"family": fam.kind, "eps": fam.eps, "universal": fam.universal, "label": fam.label,
               "images": int(len(idx)), "success": float(fooled.float().mean()),
               "top_label": int(hist.argmax()) if fooled.any() else None,
               "top_share": float(hist.max() / hist.sum()) if fooled.any() else None,
               "target_share": None, "expected_share": None, "lift": None}
        if target is not None or all_to_all:
            tl = target_labels(y, target, all_to_all, num_classes)
            hit = (pred == tl) & fooled
            row["target_share"] = float(hit.sum() / fooled.sum()) if fooled.any() else 0.0
            row["expected_share"] = float((runner_up[idx] == tl).float().mean())
            row["lift"] = row["target_share"] / max(row["expected_share"], 1e-6)
        rows.append(row)
    return rows, int(passes)
