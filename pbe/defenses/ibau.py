"""i-BAU: implicit backdoor adversarial unlearning (Zeng et al., ICLR 2022).

A min-max problem: the inner player finds a universal perturbation delta that most changes the
model's predictions on clean data; the outer player updates the model so that delta stops working.
The outer gradient goes through delta's dependence on the weights (implicit hypergradient): with
the inner fixed-point map Phi(delta, theta) = delta - a * d/d delta L_inner, the hypergradient is
dL/dtheta + (dPhi/dtheta)^T v, where v solves v = (dPhi/d delta)^T v + dL/d delta, approximated by
K fixed-point iterations.

Defaults from the authors' code (``defense.py``, ``hypergrad.py``) and BackdoorBench
``config/defense/i-bau``: 5 rounds, K = 5, batch 100, outer Adam lr 1e-3 (BackdoorBench: 1e-4),
inner step 0.1, the universal perturbation found per round by SGD lr 10 over one pass with an L2
penalty 0.001 * |delta|^2, and the outer loss on each batch with delta added to a `portion` (1%) of
it. Unlike the authors' code, the inner loss uses the current batch (theirs always uses batch 0).
The model stays in eval mode (BatchNorm statistics fixed), as in theirs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from pbe.data import ImageDataset
from pbe.defenses.base import Context, Defense
from pbe.train import batches


def inner_loss(model, x: torch.Tensor, labels: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """What delta minimises: minus the loss on the given labels, plus a small L2 penalty."""
    return -F.cross_entropy(model(x + delta), labels) + 0.001 * delta.pow(2).sum()


def hypergradient(model, params, x, y, delta, inner_step: float, k: int, portion: float,
                  gen: torch.Generator) -> list[torch.Tensor]:
    """d(outer loss)/d(params) through delta's dependence on params (fixed-point method)."""
    delta = delta.detach().requires_grad_(True)
    patched = torch.zeros(len(x), dtype=torch.bool, device=x.device)
    patched[torch.randperm(len(x), generator=gen)[:max(1, int(len(x) * portion))].to(x.device)] = True
    outer = F.cross_entropy(model(torch.where(patched.view(-1, 1, 1, 1), x + delta, x)), y)
    g_delta, *g_params = torch.autograd.grad(outer, [delta] + params, allow_unused=True)
    g_params = [torch.zeros_like(q) if g is None else g for g, q in zip(g_params, params)]
    (g_inner,) = torch.autograd.grad(inner_loss(model, x, y, delta), delta, create_graph=True)
    mapped = delta - inner_step * g_inner  # Phi(delta, theta)
    v = torch.zeros_like(delta)
    for _ in range(k):
        (jv,) = torch.autograd.grad(mapped, delta, grad_outputs=v, retain_graph=True)
        v = jv + g_delta
    cross = torch.autograd.grad(mapped, params, grad_outputs=v, allow_unused=True)
    return [g + (0 if c is None else c) for g, c in zip(g_params, cross)]


class IBAU(Defense):
    """Implicit backdoor adversarial unlearning (Zeng et al., ICLR 2022, https://arxiv.org/abs/2110.03735):
    a min-max game between a universal perturbation and the model, with implicit hypergradients.

    Arguments:
        rounds (int): outer rounds (default 5).
        k (int): fixed-point iterations of the hypergradient (default 5).
        batch_size (int): default 100.
        lr (float): outer Adam learning rate (default 1e-3).
        inner_step (float): step of the inner fixed-point map (default 0.1).
        delta_lr (float): SGD learning rate of the universal perturbation (default 10.0).
        portion (float): the perturbation's L2 bound as a share of an image's norm (default 0.01).

    Example::

        >>> result = pbe.defenses.create("ibau", rounds=3)(model, clean_set, train_size=50_000)
    """

    name = "ibau"
    setting = "clean-extra"

    def __init__(self, rounds: int = 5, k: int = 5, batch_size: int = 100, lr: float = 1e-3, inner_step: float = 0.1,
                 delta_lr: float = 10.0, portion: float = 0.01):
        super().__init__(rounds=rounds, k=k, batch_size=batch_size, lr=lr, inner_step=inner_step, delta_lr=delta_lr,
                         portion=portion)

    def _defend(self, model, data: ImageDataset, ctx: Context):
        p = self.params
        params = [q for q in model.parameters() if q.requires_grad]
        opt = torch.optim.Adam(params, lr=p["lr"])
        model.eval()
        history = []
        for r in tqdm(range(p["rounds"]), desc="i-BAU rounds", disable=not ctx.progress, leave=False):
            delta = torch.zeros((1, *data.image_shape), device=ctx.device, requires_grad=True)
            delta_opt = torch.optim.SGD([delta], lr=p["delta_lr"])
            for idx in batches(len(data), p["batch_size"], ctx.gen, shuffle=False):
                x = data.images[idx].to(ctx.device).float().div_(255)
                with torch.no_grad():
                    pred = model(x).argmax(1)
                loss = inner_loss(model, x, pred, delta)
                delta_opt.zero_grad()
                loss.backward()
                delta_opt.step()
                ctx.cost.forward += len(idx)
                ctx.cost.forward_backward += len(idx)
            delta = delta.detach()
            for idx in batches(len(data), p["batch_size"], ctx.gen):
                x = data.images[idx].to(ctx.device).float().div_(255)
                y = data.labels[idx].to(ctx.device)
                grads = hypergradient(model, params, x, y, delta, p["inner_step"], p["k"], p["portion"],
                                      ctx.gen)
                opt.zero_grad(set_to_none=True)
                for q, g in zip(params, grads):
                    q.grad = g.detach()
                opt.step()
                # outer + inner + K Jacobian-vector products + the cross term: about 4 + K passes
                ctx.cost.forward_backward += (4 + p["k"]) * len(idx)
            history.append({"round": r + 1, "delta_l2": float(delta.norm())})
            for q in model.parameters():
                q.grad = None
        return model, {"rounds": history}, None
