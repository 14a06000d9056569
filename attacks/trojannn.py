"""TrojanNN (Liu et al., NDSS 2018): a patch whose pixels are optimised on a clean model to make a few
internal neurons fire strongly, then planted by training on data stamped with it.

The paper's recipe, and what is done here:
1. pick a layer and, in it, the neurons most strongly connected by weight (here: the features entering a
   module, by their summed absolute weights in it; by default the model's last ``nn.Linear``, as
   BackdoorBench does for PreAct-ResNet-18);
2. start from a trigger inside a mask (here a seeded random square patch at a corner, like BadNets) and
   gradient-descend its pixels, the rest of the input fixed, until the chosen neurons reach a high target
   value: the loss sum_i (a_i - target_value)^2 with signed-gradient steps, pixels kept in [0, 1];
3. retrain the model so that the trigger leads to the target label. The paper reverse-engineers training
   data from the model and fine-tunes it; like BackdoorBench, the model here is trained from scratch on
   the real training set with a share of it stamped and relabelled (the static BadNets recipe).
Reductions: the paper attacks a given pretrained model; here the model the trigger is optimised on is a
``clean_surrogate`` trained for `surrogate_epochs` on the clean training set (a few epochs, for CPUs). The
paper and BackdoorBench optimise the trigger on the masked input alone (zero outside the mask); here it is
pasted into `OPT_IMAGES` seeded training images and their mean activation is raised, so the neurons fire
on triggered real inputs.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from attacks.badnets import BadNets
from attacks.base import clean_surrogate
from pbe.utils import PBEError

OPT_IMAGES = 128  # training images the trigger is pasted into while it is optimised
WEIGHTED = (nn.Linear, nn.Conv2d)  # layers whose input neurons can be ranked by their weights


class TrojanNN(BadNets):
    """TrojanNN (Liu, Ma, Aafer, Lee, Zhai, Wang & Zhang, "Trojaning Attack on Neural Networks", NDSS 2018,
    https://www.ndss-symposium.org/wp-content/uploads/2018/02/ndss2018_03A-5_Liu_paper.pdf, code
    https://github.com/PurduePAML/TrojanNN): a corner patch optimised to excite the most connected neurons of
    an internal layer of a clean surrogate, then planted by poisoning (see the module docstring for the
    reductions).

    Before ``plant`` the patch is its seeded random start (so ``apply`` works without a model); ``plant``
    replaces it by the optimised one, which ``save`` / ``attacks.load`` keep exactly.

    Arguments:
        target (int): the target label of an all-to-one backdoor (default 0).
        all_to_all (bool): label y -> (y + 1) mod C instead (default False).
        seed (int): seeds the random start of the trigger and the images it is optimised on (default 0).
        size (int): patch side in pixels, the mask (default 5: 2.4 % of a 32x32 image; the paper's square
            and watermark masks cover a few per cent of the input).
        corner (str): "bottom-right" (default), "bottom-left", "top-left" or "top-right".
        margin (int): distance from the corner in pixels (default 0).
        layer (str | None): name (as in ``model.named_modules()``) of an ``nn.Linear`` or ``nn.Conv2d``
            whose input neurons (features, or channels averaged over space) are excited (default None: the
            model's last ``nn.Linear``, i.e. the penultimate features, BackdoorBench's choice).
        neurons (int): how many neurons, those with the largest summed absolute weight in `layer` (default
            2, BackdoorBench's and TrojanZoo's).
        target_value (float): the activation the chosen neurons are driven towards (default 100.0,
            BackdoorBench's; far above a normal activation, so the trigger pushes them as high as it can).
        steps (int): signed-gradient steps of the trigger optimisation (default 200; BackdoorBench 1000 on
            one image, here on a batch of `OPT_IMAGES`).
        step (float): pixel change per step (default 0.05; BackdoorBench 0.1).
        surrogate_epochs (int): epochs of the clean surrogate the trigger is optimised on (default 3: the
            paper and BackdoorBench use a fully trained clean model; a short schedule keeps CPUs at ~10 min
            for CIFAR-10).

    Example::

        >>> attack = attacks.create("trojannn", target=0, size=5, corner="bottom-right", surrogate_epochs=3)
        >>> poisoned_train, _ = attack.plant(model, train_set, test_set, rate=0.1, recipe="cpu")
        >>> attack.neuron_idx            # the excited neurons, saved with the trigger
    """

    name = "trojannn"

    def __init__(self, target=0, all_to_all=False, seed=0, size=5, corner="bottom-right", margin=0, layer=None,
                 neurons=2, target_value=100.0, steps=200, step=0.05, surrogate_epochs=3):
        super().__init__(target, all_to_all, seed, size=size, pattern="random", corner=corner, margin=margin)
        if layer is not None and (not isinstance(layer, str) or not layer):
            raise PBEError(f"layer must be a module name (see model.named_modules()) or None, got {layer!r}")
        if int(neurons) < 1 or int(steps) < 0 or not 0 < float(step) <= 1 or int(surrogate_epochs) < 1:
            raise PBEError(f"TrojanNN needs neurons >= 1, steps >= 0, step in (0, 1] and surrogate_epochs >= 1; "
                           f"got neurons={neurons}, steps={steps}, step={step}, surrogate_epochs={surrogate_epochs}")
        self.layer, self.neurons, self.target_value = layer, int(neurons), float(target_value)
        self.steps, self.step, self.surrogate_epochs = int(steps), float(step), int(surrogate_epochs)

    def params(self):
        base = {k: v for k, v in super().params().items() if k != "pattern"}  # always the optimised patch
        return {**base, "layer": self.layer, "neurons": self.neurons, "target_value": self.target_value,
                "steps": self.steps, "step": self.step, "surrogate_epochs": self.surrogate_epochs}

    # ---- the trigger
    def _build(self, shape, generator):
        super()._build(shape, generator)  # the seeded random patch: the optimisation's start
        self.register_buffer("neuron_idx", torch.full((self.neurons,), -1, dtype=torch.int64))  # -1: not planted

    @property
    def optimised(self) -> bool:
        """Whether the patch is the one ``plant`` optimised (or loaded), not the random start."""
        return self.shape is not None and bool((self.neuron_idx >= 0).all())

    def prepare(self, shape):
        shape = tuple(int(s) for s in shape)
        if self.shape is not None and shape != self.shape and self.optimised:
            raise PBEError(f"this trojannn trigger was optimised for images of shape {list(self.shape)}, not "
                           f"{list(shape)}; use the dataset the attack was planted on")
        return super().prepare(shape)

    def _paste(self, x: torch.Tensor, patch: torch.Tensor) -> torch.Tensor:
        """`x` with `patch` in the mask; differentiable in `patch`."""
        mask = torch.zeros_like(x[:1])
        region = (slice(None), slice(None), slice(self.top, self.top + self.size),
                  slice(self.left, self.left + self.size))
        mask[region] = 1
        full = torch.zeros_like(x[:1])
        full[region] = patch
        return x * (1 - mask) + full * mask

    # ---- the layer and its neurons
    def layer_name(self, model: nn.Module) -> str:
        """The name of the module whose input neurons are excited: `layer`, or the last ``nn.Linear``."""
        modules = dict(model.named_modules())
        if self.layer is None:
            linear = [name for name, m in modules.items() if isinstance(m, nn.Linear)]
            if not linear:
                raise PBEError(f"TrojanNN excites the inputs of the model's last nn.Linear by default, and "
                               f"{type(model).__name__} has none; pass layer='NAME' of an nn.Linear or nn.Conv2d")
            return linear[-1]
        if self.layer not in modules:
            names = [n for n, m in modules.items() if isinstance(m, WEIGHTED)]
            raise PBEError(f"the model has no module {self.layer!r}; its nn.Linear / nn.Conv2d modules: "
                           f"{', '.join(names[-8:]) or 'none'}")
        if not isinstance(modules[self.layer], WEIGHTED):
            raise PBEError(f"layer {self.layer!r} is a {type(modules[self.layer]).__name__}; TrojanNN ranks a "
                           "layer's input neurons by their weights, so name an nn.Linear or nn.Conv2d")
        return self.layer

    def most_connected(self, model: nn.Module) -> torch.Tensor:
        """The `neurons` inputs of the layer with the largest summed absolute weight in it."""
        module = dict(model.named_modules())[self.layer_name(model)]
        weight = module.weight.detach().abs()
        if weight.dim() > 2:  # a convolution: (out, in, kh, kw) -> (out, in)
            weight = weight.flatten(2).sum(2)
        if self.neurons > weight.shape[1]:
            raise PBEError(f"neurons={self.neurons} but the layer has only {weight.shape[1]} input neurons")
        return weight.sum(0).argsort(descending=True)[:self.neurons].cpu()

    def neuron_activation(self, model: nn.Module, x: torch.Tensor, patch: torch.Tensor | None = None,
                          neuron_idx: torch.Tensor | None = None) -> torch.Tensor:
        """Per-image activations (N, neurons) of the chosen neurons on `x` with `patch` pasted (default:
        the attack's trigger); differentiable in `patch`. `model` in eval mode is the caller's business."""
        self.prepare(x.shape[1:])
        module = dict(model.named_modules())[self.layer_name(model)]
        idx = (self.neuron_idx if neuron_idx is None else neuron_idx).to(x.device)
        if bool((idx < 0).any()):
            raise PBEError("no neurons chosen yet: plant() (or fit_trigger) chooses them; pass neuron_idx=")
        seen = {}
        handle = module.register_forward_hook(lambda m, inputs, out: seen.__setitem__("a", inputs[0]))
        try:
            model(self._paste(x, self.patch.to(x.device) if patch is None else patch))
        finally:
            handle.remove()
        if "a" not in seen:
            raise PBEError(f"layer {self.layer_name(model)!r} is not used by the model's forward pass; name another")
        act = seen["a"]
        if act.dim() > 2:  # channels of a feature map: their spatial mean
            act = act.flatten(2).mean(2)
        return act[:, idx]

    # ---- planting
    def fit_trigger(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """Choose the neurons on `model` (a clean model) and optimise the patch on `images` (uint8 or float
        (N, C, H, W)) so that they reach `target_value`; stores both. Returns the neurons' mean activation
        before and after (2, neurons)."""
        self.prepare(images.shape[1:])
        dev = next(model.parameters()).device
        x = images.to(dev)
        x = x.float() / 255 if x.dtype == torch.uint8 else x.float()
        idx = self.most_connected(model)
        was_training, flags = model.training, [p.requires_grad for p in model.parameters()]
        model.eval().requires_grad_(False)
        try:
            patch = self.patch.detach().to(dev).clone()
            with torch.no_grad():
                before = self.neuron_activation(model, x, patch, idx).mean(0)
            for _ in range(self.steps):
                patch.requires_grad_(True)
                act = self.neuron_activation(model, x, patch, idx)
                loss = (act - self.target_value).pow(2).sum(1).mean()
                (grad,) = torch.autograd.grad(loss, patch)
                patch = (patch.detach() - self.step * grad.sign()).clamp(0, 1)
            patch = patch.mul(255).round().div(255)  # the levels a uint8 poisoned image holds
            with torch.no_grad():
                after = self.neuron_activation(model, x, patch, idx).mean(0)
        finally:
            for p, f in zip(model.parameters(), flags):
                p.requires_grad_(f)
            model.train(was_training)
        self.patch.copy_(patch)
        self.neuron_idx.copy_(idx)
        return torch.stack([before, after]).cpu()

    def plant(self, model, train_set, test_set=None, rate=0.1, recipe="cpu", seed=0, device="auto",
              progress=True, **train_kw):
        """Train a clean surrogate (`surrogate_epochs`), optimise the trigger on it, then poison `train_set`
        and train `model` on it in place. Returns the poisoned set and the training history. A resumed run
        (``state_path``) trains the surrogate again: the same seed gives the same trigger."""
        from pbe.train import train
        # mistakes are named before the surrogate's training: a target, rate or layer that cannot work
        if self.target >= train_set.num_classes:
            raise PBEError(f"target {self.target} is not a class of {train_set.name}")
        eligible = len(self.candidates(train_set.labels))
        if not 0 <= rate <= 1 or round(rate * len(train_set)) > eligible:
            raise PBEError(f"rate {rate} asks for {round(rate * len(train_set))} poisoned samples but only {eligible} "
                           "are eligible; lower --rate")
        self.layer_name(model)
        self.prepare(train_set.image_shape)
        self._build(self.shape, torch.Generator().manual_seed(self.seed))  # always from the seeded random start
        surrogate = clean_surrogate(model, train_set, recipe, self.surrogate_epochs, seed, device, progress)
        gen = torch.Generator().manual_seed(seed)
        chosen = torch.randperm(len(train_set), generator=gen)[:OPT_IMAGES]
        self.fit_trigger(surrogate, train_set.images[chosen])
        del surrogate
        poisoned = self.poison(train_set, rate, seed)
        history = train(model, poisoned, test_set, recipe, seed=seed, device=device, progress=progress, **train_kw)
        return poisoned, history


__all__ = ["TrojanNN"]
