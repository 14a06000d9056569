"""SAU: Shared Adversarial Unlearning (Wei et al., NeurIPS 2023), with a small clean set.

A backdoor is most dangerous through adversarial examples that fool the infected model and the model
being purified *the same way* (shared adversarial examples): a triggered image is one. Per batch of
clean images SAU first finds, by signed-gradient steps on a per-image perturbation bounded in L-inf, examples
that fool both models (the adversarial term, weight `beta_1`: their cross-entropy on the true label
rises for each model not yet fooled) and make them agree (the shared term, `beta_2`: the Jensen-Shannon
divergence of the two models' predictions on the examples not yet shared). Then it updates the model
on the clean batch (`lmd_1`, cross-entropy), optionally on the examples themselves (`lmd_2`, adversarial
training) and, where the infected model's label for an example is neither the true one nor its own
clean prediction (a potential backdoor), pushes the purified model's probability of that label down
(`lmd_3`, ``-(log(1 - p) + log(1 - p)) / 2`` as written in the authors' code).

Defaults from BackdoorBench ``config/defense/sau/config.yaml`` and ``defense/sau.py`` (code by the
paper's first author): 5 % clean data, 100 epochs, batch 256, Adam (AMSGrad) lr 1e-4 without weight decay (the
config names a cosine schedule that the code never steps: constant), L-inf bound 0.2 on [0, 1] pixels,
step 0.2, 5 steps, start at +bound ("max"), beta_1 0.01, beta_2 1, lmd_1 1, lmd_2 0, lmd_3 1, the
model in eval mode (BatchNorm fixed), no augmentation. As there, the perturbed images are not clipped
to [0, 1].
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from pbe.data import ImageDataset
from pbe.defenses.base import Context, Defense, Stage
from pbe.train import batches
from pbe.utils import PBEError

PROB_FLOOR = 1e-8  # probabilities in the Jensen-Shannon divergence are floored here (log of 0)
SHARED_CLAMP = (0.001, 0.999)  # the shared loss ignores probabilities below 0.1 % and caps them at 99.9 %
LOG_EPS = 1e-6


def js_divergence(logits_a: torch.Tensor, logits_b: torch.Tensor) -> torch.Tensor:
    """Per-sample Jensen-Shannon divergence of two models' softmax outputs."""
    p, q = F.softmax(logits_a, 1).clamp_min(PROB_FLOOR), F.softmax(logits_b, 1).clamp_min(PROB_FLOOR)
    m = 0.5 * (p + q)
    return (0.5 * (p * (p.log() - m.log()) + q * (q.log() - m.log()))).sum(1)


def shared_adversarial(model, ref, x: torch.Tensor, y: torch.Tensor, eps: float, step: float, steps: int,
                       beta_1: float, beta_2: float) -> tuple[torch.Tensor, int]:
    """Per-image perturbations (|delta| <= eps) that fool `model` and `ref` to the same wrong label;
    with the number of steps taken (it stops early once every example is shared)."""
    with torch.no_grad():
        own, own_ref = model(x).argmax(1), ref(x).argmax(1)
    delta = torch.full_like(x, eps)  # "max" start
    n = len(x)
    for taken in range(1, steps + 1):
        delta.requires_grad_(True)
        moved = x + delta
        out, out_ref = model(moved), ref(moved)
        label, label_ref = out.argmax(1), out_ref.argmax(1)
        fooled, fooled_ref = label != own, label_ref != own_ref
        shared = fooled & fooled_ref & (label == label_ref)
        adv = -(F.cross_entropy(out, y, reduction="none")[~fooled].sum()
                + F.cross_entropy(out_ref, y, reduction="none")[~fooled_ref].sum()) / 2 / n
        share = js_divergence(out, out_ref)[~shared].sum() / n
        (grad,) = torch.autograd.grad(beta_1 * adv + beta_2 * share, delta)
        delta = (delta.detach() - step * grad.sign()).clamp(-eps, eps)
        if shared.all():
            break
    return delta.detach(), taken


def shared_loss(per_logits: torch.Tensor, label_ref: torch.Tensor, potential: torch.Tensor) -> torch.Tensor:
    """The purified model's penalty for giving an example the infected model's adversarial label, over
    the potential backdoor examples (summed; the caller divides by the batch)."""
    if not potential.any():
        return per_logits.new_zeros(())
    pos = F.softmax(per_logits, 1).gather(1, label_ref[:, None])[:, 0][potential]
    lo, hi = SHARED_CLAMP
    return (-torch.log(LOG_EPS + (1 - pos).clamp(max=hi)).sum() - torch.log(1 + LOG_EPS - pos.clamp(min=lo)).sum()) / 2


class SAU(Defense):
    """Shared Adversarial Unlearning (Wei et al., NeurIPS 2023, https://arxiv.org/abs/2307.10562): unlearn
    the adversarial examples the infected and the purified model share, on a small clean set.

    Arguments:
        epochs (int): passes over the clean set (default 100).
        lr (float): Adam learning rate, constant (default 1e-4).
        batch_size (int): default 256.
        eps (float): L-inf bound of the perturbation on [0, 1] pixels (default 0.2).
        step (float): signed-gradient step of the perturbation (default 0.2).
        steps (int): perturbation steps per batch (default 5).
        beta_1 (float): weight of the adversarial term when finding the examples (default 0.01).
        beta_2 (float): weight of the shared (Jensen-Shannon) term (default 1.0).
        lmd_1 (float): weight of the clean cross-entropy (default 1.0).
        lmd_2 (float): weight of adversarial training on the examples (default 0.0).
        lmd_3 (float): weight of the shared adversarial loss (default 1.0).
        train_mode (bool): update BatchNorm statistics during the model's step (default False).

    Example::

        >>> result = pbe.defenses.create("sau", epochs=20)(model, clean_set, train_size=50_000)
    """

    name = "sau"
    setting = "clean-extra"

    def __init__(self, epochs: int = 100, lr: float = 1e-4, batch_size: int = 256, eps: float = 0.2,
                 step: float = 0.2, steps: int = 5, beta_1: float = 0.01, beta_2: float = 1.0, lmd_1: float = 1.0,
                 lmd_2: float = 0.0, lmd_3: float = 1.0, train_mode: bool = False):
        super().__init__(epochs=epochs, lr=lr, batch_size=batch_size, eps=eps, step=step, steps=steps, beta_1=beta_1,
                         beta_2=beta_2, lmd_1=lmd_1, lmd_2=lmd_2, lmd_3=lmd_3, train_mode=train_mode)

    def _check(self) -> None:
        p = self.params
        if not (0 < p["eps"] <= 1 and 0 < p["step"] <= 1):
            raise PBEError(f"sau: eps and step must be in (0, 1], got {p['eps']}, {p['step']}")
        weights = {k: p[k] for k in ("beta_1", "beta_2", "lmd_1", "lmd_2", "lmd_3")}
        if any(v < 0 for v in weights.values()) or not (p["lmd_1"] + p["lmd_2"] + p["lmd_3"]) > 0:
            raise PBEError(f"sau: loss weights must be >= 0 with some lmd > 0, got {weights}")

    def _defend(self, model, data: ImageDataset, ctx: Context):
        p = self.params
        ref = copy.deepcopy(model).eval().requires_grad_(False)
        opt = torch.optim.Adam(model.parameters(), lr=p["lr"], weight_decay=0.0, amsgrad=True)
        model.eval()
        stage = Stage(ctx, p["epochs"], data=data, model=model, optimizer=opt)
        for epoch in range(stage.first, p["epochs"]):
            shared_total, potential_total = 0, 0
            for idx in batches(len(data), p["batch_size"], ctx.gen):
                x = data.images[idx].to(ctx.device).float().div_(255)
                y = data.labels[idx].to(ctx.device)
                delta, taken = shared_adversarial(model, ref, x, y, p["eps"], p["step"], p["steps"], p["beta_1"],
                                                  p["beta_2"])
                ctx.cost.forward += 2 * len(y)
                ctx.cost.forward_backward += 2 * taken * len(y)
                if p["train_mode"]:
                    model.train()
                both = torch.cat([x, x + delta])
                logits, per_logits = model(both).split(len(y))
                model.eval()
                with torch.no_grad():
                    own_ref, label_ref = ref(both).argmax(1).split(len(y))
                potential = (label_ref != y) & (label_ref != own_ref)
                loss = (p["lmd_1"] * F.cross_entropy(logits, y) + p["lmd_2"] * F.cross_entropy(per_logits, y)
                        + p["lmd_3"] * shared_loss(per_logits, label_ref, potential) / len(y))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                ctx.cost.forward_backward += 2 * len(y)
                ctx.cost.forward += 2 * len(y)
                shared_total += int((potential & (per_logits.argmax(1) == label_ref)).sum())
                potential_total += int(potential.sum())
            stage.log.append({"epoch": epoch + 1, "potential_backdoor_examples": potential_total,
                              "shared_before_step": shared_total})
            stage.done(epoch + 1)
        return model, {"epochs": stage.log}, None
