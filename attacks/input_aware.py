"""Input-aware dynamic backdoor (Nguyen & Tran, NeurIPS 2020): a generator makes a different trigger
for every input, a mask network says where to paste it, and both are trained with the classifier.

x' = x + (pattern(x) - x) * mask(x). Training (the paper's two stages):
1. the mask network alone, for `mask_epochs`: masks stay sparse (mean above `mask_density` is
   penalised, weight `lambda_norm`) and differ between inputs (diversity loss);
2. classifier and pattern generator jointly: in each batch a `rate` share gets its own trigger and
   the target label, a `cross_ratio * rate` share gets the trigger made for *another* input and keeps
   its true label (so the trigger works only on the input it was made for), plus the diversity loss
   ||x1 - x2|| / ||G(x1) - G(x2)|| (weight `lambda_div`). The mask network is frozen.
Paper defaults (CIFAR-10): Adam lr 0.01 betas (0.5, 0.9) for both generators, 25 mask epochs,
lambda_div 1, lambda_norm 100, mask_density 0.032, backdoor and cross rates 0.1. Here the second
input of each pair is a permutation of the same batch instead of a second data loader.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from attacks.base import BackdoorAttack, PoisonedDataset
from pbe.utils import PBEError, resolve_device, seed_everything

EPS = 1e-7


def _block(cin, cout, relu=True):
    layers = [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout)]
    return layers + [nn.ReLU(inplace=True)] if relu else layers


class Generator(nn.Sequential):
    """The paper's encoder-decoder: `steps` x (2 convs + max-pool), a middle conv, mirrored decoder."""

    def __init__(self, in_channels: int, out_channels: int, steps: int, channel_init: int):
        layers, cur, nxt = [], in_channels, channel_init
        for step in range(steps):
            layers += _block(cur, nxt) + _block(nxt, nxt) + [nn.MaxPool2d(2)]
            if step < steps - 1:
                cur, nxt = nxt, nxt * 2
        layers += _block(nxt, nxt)
        cur = nxt
        for step in range(steps):
            last = step == steps - 1
            nxt = out_channels if last else cur // 2
            layers += [nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)]
            layers += _block(cur, cur) + _block(cur, nxt, relu=not last)
            cur = nxt
        super().__init__(*layers)

    def forward(self, x):
        return torch.tanh(super().forward(x)) / (2 + EPS) + 0.5


def _threshold(m: torch.Tensor) -> torch.Tensor:
    """The paper's soft step that pushes mask values towards 0 or 1."""
    return torch.tanh(m * 20 - 10) / (2 + EPS) + 0.5


def _diversity(x1, x2, p1, p2) -> torch.Tensor:
    """Mean ratio of input distance to trigger (or mask) distance: small when triggers differ."""
    d_in = (x1 - x2).pow(2).flatten(1).mean(1).sqrt()
    d_out = (p1 - p2).pow(2).flatten(1).mean(1).sqrt()
    return (d_in / (d_out + EPS)).mean()


class InputAware(BackdoorAttack):
    """Input-aware dynamic backdoor (Nguyen & Tran, NeurIPS 2020, https://arxiv.org/abs/2010.08138): a
    trigger generator and a mask network trained with the classifier (see the module docstring).

    Arguments:
        target (int): the target label of an all-to-one backdoor (default 0).
        all_to_all (bool): label y -> (y + 1) mod C instead (default False).
        seed (int): seeds the trigger (default 0).
        cross_ratio (float): cross-trigger samples per poisoned sample (default 1.0).
        mask_epochs (int): epochs of the mask network's first stage (default 25, the paper's).
        lr_g (float): Adam learning rate of the pattern generator (default 0.01).
        lr_m (float): Adam learning rate of the mask network (default 0.01).
        lambda_div (float): weight of the diversity loss (default 1.0).
        lambda_norm (float): weight of the mask-density penalty (default 100.0).
        mask_density (float): mask density above which it is penalised (default 0.032).
        channel_init (int | None): generator width (default None: by image size, as the paper).

    Example::

        >>> attack = attacks.create("input_aware", target=6, mask_epochs=1)
        >>> poisoned_train, _ = attack.plant(model, train_set, test_set, rate=0.1, recipe="cpu")
    """

    name = "input_aware"

    def __init__(self, target=0, all_to_all=False, seed=0, cross_ratio=1.0, mask_epochs=25, lr_g=0.01,
                 lr_m=0.01, lambda_div=1.0, lambda_norm=100.0, mask_density=0.032, channel_init=None):
        super().__init__(target, all_to_all, seed)
        self.cross_ratio, self.mask_epochs = float(cross_ratio), float(mask_epochs)
        self.lr_g, self.lr_m = float(lr_g), float(lr_m)
        self.lambda_div, self.lambda_norm = float(lambda_div), float(lambda_norm)
        self.mask_density = float(mask_density)
        self.channel_init = channel_init

    def params(self):
        return {**super().params(), "cross_ratio": self.cross_ratio, "mask_epochs": self.mask_epochs,
                "lr_g": self.lr_g, "lr_m": self.lr_m, "lambda_div": self.lambda_div,
                "lambda_norm": self.lambda_norm, "mask_density": self.mask_density,
                "channel_init": self.channel_init}

    def _build(self, shape, generator):
        c, h, w = shape
        steps = 0
        while steps < 3 and h % 2 ** (steps + 1) == 0 and w % 2 ** (steps + 1) == 0:
            steps += 1
        if steps == 0:
            raise PBEError(f"input-aware generators need even image sides, got {h}x{w}")
        ch = self.channel_init or (32 if c == 3 else 16)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.pattern_net = Generator(c, c, steps, ch)
            self.mask_net = Generator(c, 1, steps, ch)
        self.eval()

    def trigger_parts(self, x: torch.Tensor, patterns_from: torch.Tensor | None = None):
        """Pattern (made from `patterns_from`, default `x`) and thresholded mask for `x`'s source."""
        src = x if patterns_from is None else patterns_from
        return self.pattern_net(src), _threshold(self.mask_net(src))

    def _trigger(self, x, train):
        was = self.training
        self.eval()
        pattern, mask = self.trigger_parts(x)
        self.train(was)
        return x + (pattern - x) * mask

    # ---- training
    def _fit_mask(self, train_set, batch_size, device, gen, progress):
        opt = torch.optim.Adam(self.mask_net.parameters(), lr=self.lr_m, betas=(0.5, 0.9))
        steps = max(1, round(self.mask_epochs * len(train_set) / batch_size))
        self.mask_net.train()
        for _ in tqdm(range(steps), desc="input-aware mask", disable=not progress, leave=False):
            idx = torch.randint(len(train_set), (2, batch_size), generator=gen)
            x1 = train_set.images[idx[0]].to(device).float() / 255
            x2 = train_set.images[idx[1]].to(device).float() / 255
            m1, m2 = _threshold(self.mask_net(x1)), _threshold(self.mask_net(x2))
            sparsity = F.relu(m1 - self.mask_density).mean()
            loss = self.lambda_norm * sparsity + self.lambda_div * _diversity(x1, x2, m1, m2)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        self.mask_net.eval().requires_grad_(False)

    def plant(self, model, train_set, test_set=None, rate=0.1, recipe="cpu", seed=0, device="auto",
              progress=True, **train_kw):
        """Stage 1 (mask), stage 2 (classifier + generator jointly), then a static poisoned copy of
        `train_set` made with the trained generator (what a defender would hold)."""
        from pbe.train import get_recipe, train
        if self.target >= train_set.num_classes:
            raise PBEError(f"target {self.target} is not a class of {train_set.name}")
        dev = resolve_device(device)
        gen = seed_everything(seed)
        self.prepare(train_set.image_shape).to(dev)
        batch = get_recipe(recipe, **{k: v for k, v in train_kw.items() if k in ("batch_size",)}).batch_size
        resuming = train_kw.get("state_path") is not None and Path(train_kw["state_path"]).exists()
        if resuming:  # the mask network (and the rest of the attack) comes back with the training state
            self.mask_net.eval().requires_grad_(False)
        else:
            self._fit_mask(train_set, batch, dev, gen, progress)
        hook = _JointHook(self, rate, train_set.num_classes, gen)
        history = train(model, train_set, test_set, recipe, seed=seed, device=dev, progress=progress,
                        hook=hook, **train_kw)
        self.eval()
        return self.poison(train_set, rate, seed), history


class _JointHook:
    """Per batch: backdoor share, cross-trigger share, clean rest; the generator learns with the model."""

    def __init__(self, attack: InputAware, rate: float, num_classes: int, gen: torch.Generator):
        self.a, self.rate, self.num_classes, self.gen = attack, rate, num_classes, gen
        self.opt = torch.optim.Adam(attack.pattern_net.parameters(), lr=attack.lr_g, betas=(0.5, 0.9))
        attack.pattern_net.train()

    def before_step(self, x, y):
        a, n = self.a, len(x)
        n_bd = int(self.rate * n)
        n_cross = int(a.cross_ratio * self.rate * n)
        other = x[torch.randperm(n, generator=self.gen).to(x.device)]
        self.opt.zero_grad(set_to_none=True)
        p_bd, m_bd = a.trigger_parts(x[:n_bd])
        bd = x[:n_bd] + (p_bd - x[:n_bd]) * m_bd
        p_cr, m_cr = a.trigger_parts(x[n_bd:n_bd + n_cross], patterns_from=other[n_bd:n_bd + n_cross])
        cross = x[n_bd:n_bd + n_cross] + (p_cr - x[n_bd:n_bd + n_cross]) * m_cr
        x_all = torch.cat([bd, cross, x[n_bd + n_cross:]])
        y_all = torch.cat([a.target_of(y[:n_bd], self.num_classes), y[n_bd:]])
        div = None
        if n_bd > 0:
            p_other = a.pattern_net(other[:n_bd])
            div = a.lambda_div * _diversity(x[:n_bd], other[:n_bd], p_bd, p_other)
        return x_all, y_all, div

    def after_step(self):
        self.opt.step()

    def state_dict(self) -> dict:
        return {"attack": self.a.state_dict(), "optimizer": self.opt.state_dict(), "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.a.load_state_dict(state["attack"])
        self.opt.load_state_dict(state["optimizer"])
        self.gen.set_state(state["gen"])


__all__ = ["InputAware", "Generator", "PoisonedDataset"]
