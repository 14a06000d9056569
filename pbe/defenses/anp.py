"""ANP: adversarial neuron pruning (Wu & Wang, NeurIPS 2021).

Backdoor neurons are the ones whose small multiplicative perturbation flips the model most. Every
BatchNorm channel gets a mask m in [0, 1] and bounded noise (delta on the scale, xi on the shift,
both in [-eps, eps]): the channel outputs gamma * (m + delta) * x_hat + beta * (1 + xi). Per batch
of clean data the noise takes `steps` signed-gradient ascent steps from a random start, then the masks
descend on alpha * L(masks) + (1 - alpha) * L(masks, noise). Channels whose mask ends below a
threshold are pruned (their BatchNorm scale set to 0) in a copy of the original model.

Defaults from the authors' code (``optimize_mask_cifar.py``, ``prune_neuron_cifar.py``) and
BackdoorBench ``config/defense/anp``: eps 0.4, 1 step, alpha 0.2, mask SGD lr 0.2 momentum 0.9,
2000 iterations of batch 128 (sampled with replacement). Pruning as BackdoorBench does it
(`threshold=None`): the largest threshold in 0.05, 0.10, ..., `pruning_max` = 0.90 whose pruned
model keeps clean-set accuracy within `acc_ratio` = 10% of the original's. A number fixes the
threshold instead (the ANP paper's 0.2).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from pbe.data import ImageDataset
from pbe.defenses.base import Context, Defense
from pbe.metrics import accuracy, predict
from pbe.utils import PBEError


class _Perturbation:
    """Masks and noise on every BatchNorm2d of a model, applied through forward hooks."""

    def __init__(self, model: nn.Module, device):
        self.bns = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d) and m.affine]
        if not self.bns:
            raise PBEError("ANP perturbs BatchNorm2d channels; the model has none with affine parameters")
        self.mask = [torch.ones(m.num_features, device=device, requires_grad=True) for _, m in self.bns]
        self.delta = [torch.zeros(m.num_features, device=device, requires_grad=True) for _, m in self.bns]
        self.xi = [torch.zeros(m.num_features, device=device, requires_grad=True) for _, m in self.bns]
        self.noisy = False
        self.hooks = [m.register_forward_hook(self._hook(i)) for i, (_, m) in enumerate(self.bns)]

    def _hook(self, i):
        def forward(module, inputs, out):
            view = (1, -1, 1, 1)
            shift = module.bias.view(view)
            scale = self.mask[i] + (self.delta[i] if self.noisy else 0)
            new_shift = shift * (1 + self.xi[i].view(view)) if self.noisy else shift
            return (out - shift) * scale.view(view) + new_shift
        return forward

    def remove(self):
        for h in self.hooks:
            h.remove()


def prune_by_mask(model: nn.Module, masks: dict[str, torch.Tensor], threshold: float) -> nn.Module:
    """Zero the BatchNorm scale of every channel whose mask is below `threshold` (in place)."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, m in masks.items():
            weight = modules[name].weight
            weight[(m < threshold).to(weight.device)] = 0
    return model


class ANP(Defense):
    """Adversarial neuron pruning (Wu & Wang, NeurIPS 2021, https://arxiv.org/abs/2110.14430): prune the
    BatchNorm channels most sensitive to a small adversarial perturbation of the weights.

    Arguments:
        eps (float): bound of the neuron noise (default 0.4).
        steps (int): noise ascent steps per batch (default 1).
        alpha (float): weight of the natural loss in the mask objective (default 0.2).
        lr (float): mask SGD learning rate (default 0.2).
        iterations (int): mask optimisation batches (default 2000).
        batch_size (int): default 128.
        threshold (float | None): mask pruning threshold (default None: chosen by clean accuracy).
        acc_ratio (float): largest clean-accuracy drop the chosen threshold may cost (default 0.1).
        pruning_max (float): largest threshold tried (default 0.9).
        pruning_step (float): threshold grid step (default 0.05).

    Example::

        >>> result = pbe.defenses.create("anp", iterations=500)(model, clean_set, train_size=50_000)
    """

    name = "anp"
    setting = "clean-extra"

    def __init__(self, eps: float = 0.4, steps: int = 1, alpha: float = 0.2, lr: float = 0.2, iterations: int = 2000,
                 batch_size: int = 128, threshold: float | None = None, acc_ratio: float = 0.1,
                 pruning_max: float = 0.9, pruning_step: float = 0.05):
        super().__init__(eps=eps, steps=steps, alpha=alpha, lr=lr, iterations=iterations, batch_size=batch_size,
                         threshold=threshold, acc_ratio=acc_ratio, pruning_max=pruning_max,
                         pruning_step=pruning_step)

    def _check(self):
        p = self.params
        if not 0 <= p["alpha"] <= 1 or p["eps"] < 0 or p["iterations"] < 1:
            raise PBEError("anp: alpha must be in [0, 1], eps >= 0 and iterations >= 1")
        if p["threshold"] is not None and not 0 < p["threshold"] < 1:
            raise PBEError("anp: threshold must be in (0, 1), or None to choose it by clean accuracy")

    def _defend(self, model, data: ImageDataset, ctx: Context):
        p = self.params
        original = copy.deepcopy(model)
        for q in model.parameters():
            q.requires_grad_(False)
        pert = _Perturbation(model, ctx.device)
        mask_opt = torch.optim.SGD(pert.mask, lr=p["lr"], momentum=0.9)
        model.train()  # batch statistics, as in the authors' mask_train
        try:
            for _ in tqdm(range(p["iterations"]), desc="ANP masks", disable=not ctx.progress, leave=False):
                idx = torch.randint(len(data), (p["batch_size"],), generator=ctx.gen)
                x = data.images[idx].to(ctx.device).float().div_(255)
                y = data.labels[idx].to(ctx.device)
                if p["eps"] > 0:
                    with torch.no_grad():
                        for t in pert.delta + pert.xi:
                            t.uniform_(-p["eps"], p["eps"])
                    pert.noisy = True
                    for _ in range(p["steps"]):
                        loss = -F.cross_entropy(model(x), y)
                        grads = torch.autograd.grad(loss, pert.delta + pert.xi)
                        with torch.no_grad():  # descend on -loss: ascend on the loss
                            for t, g in zip(pert.delta + pert.xi, grads):
                                t.sub_(p["eps"] / p["steps"] * g.sign()).clamp_(-p["eps"], p["eps"])
                    loss_rob = F.cross_entropy(model(x), y)
                    ctx.cost.forward_backward += (p["steps"] + 1) * len(y)
                else:
                    loss_rob = torch.zeros((), device=ctx.device)
                pert.noisy = False
                loss = p["alpha"] * F.cross_entropy(model(x), y) + (1 - p["alpha"]) * loss_rob
                mask_opt.zero_grad(set_to_none=True)
                loss.backward()
                mask_opt.step()
                with torch.no_grad():
                    for m in pert.mask:
                        m.clamp_(0, 1)
                ctx.cost.forward_backward += len(y)
        finally:
            pert.remove()
        masks = {name: m.detach().cpu() for (name, _), m in zip(pert.bns, pert.mask)}
        threshold, trace, start = p["threshold"], [], None
        if threshold is None:
            start = accuracy(predict(original, data.images), data.labels)
            threshold = p["pruning_step"]
            for k in range(1, int(round(p["pruning_max"] / p["pruning_step"])) + 1):
                t = k * p["pruning_step"]
                acc = accuracy(predict(prune_by_mask(copy.deepcopy(original), masks, t), data.images), data.labels)
                ctx.cost.forward += len(data)
                trace.append({"threshold": round(t, 4), "clean_acc": acc})
                if acc < (1 - p["acc_ratio"]) * start:
                    break
                threshold = t
        pruned = prune_by_mask(original, masks, threshold)
        dead = {name: (m < threshold).nonzero().flatten().tolist() for name, m in masks.items()}
        return pruned, {"threshold": threshold, "threshold_trace": trace, "start_clean_acc": start,
                        "pruned_count": sum(len(v) for v in dead.values()),
                        "pruned_neurons": {k: v for k, v in dead.items() if v},
                        "neurons": sum(len(m) for m in masks.values()),
                        "mask_values": {k: [round(float(v), 4) for v in m] for k, m in masks.items()}}, None
