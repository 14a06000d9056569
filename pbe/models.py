"""Model registry. Every model takes inputs in [0, 1] and normalises inside, so adversarial
budgets are in pixel units and attack bounds are (0, 1). Any user ``nn.Module`` following that
convention works with the rest of the toolkit: wrap one that normalises outside with ``Normalize``,
one that ends in a softmax with ``Logits``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from pbe.registry import Registry
from pbe.utils import PBEError

DATASET_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "mnist": ((0.1307,), (0.3081,)),
    "gtsrb": ((0.3403, 0.3121, 0.3214), (0.2724, 0.2608, 0.2669)),
    "digits": ((0.3,), (0.38,)),
}


class Normalize(nn.Module):
    """``(x - mean) / std`` per channel: puts a model's input normalisation inside it, so that it takes
    [0, 1] images as the whole toolkit gives them. A model trained on normalised inputs (normalised
    outside, e.g. by a torchvision transform) is wrapped with the statistics it was trained with::

        >>> model = nn.Sequential(Normalize(mean=[0.4914, 0.4822, 0.4465], std=[0.2470, 0.2435, 0.2616]), net)

    Arguments:
        mean: one value per input channel.
        std: one value per input channel.
    """

    def __init__(self, mean: Iterable[float], std: Iterable[float]):
        super().__init__()
        self.register_buffer("mean", torch.tensor(list(mean)).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(list(std)).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class Logits(nn.Module):
    """Log-probabilities of a model that ends in a softmax (its outputs are probabilities): every method of
    the toolkit takes logits (cross-entropy, PGD, the scan's statistics), and the log of a probability is
    one up to a constant. Removing the final softmax is better where you can: a probability that rounds
    to 0 has no gradient left.

        >>> model = Logits(net_ending_in_softmax)

    Arguments:
        model: the module whose outputs are probabilities (rows of non-negative numbers summing to 1).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.model(x)
        return p.clamp_min(torch.finfo(p.dtype).tiny).log()


def _normalizer(in_channels: int, mean, std) -> Normalize:
    mean = [0.5] * in_channels if mean is None else list(mean)
    std = [0.25] * in_channels if std is None else list(std)
    if len(mean) != in_channels or len(std) != in_channels:
        raise PBEError(f"mean/std need {in_channels} values (one per channel), got {mean} / {std}")
    return Normalize(mean, std)


# ---------------------------------------------------------------- PreAct-ResNet-18
class PreActBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.shortcut = (nn.Conv2d(cin, cout, 1, stride, bias=False)
                         if stride != 1 or cin != cout else None)

    def forward(self, x):
        out = F.relu(self.bn1(x))
        skip = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        return out + skip


class PreActResNet18(nn.Module):
    """PreAct-ResNet-18 (He et al. 2016) as used by PBE and BackdoorBench; `width` scales channels."""

    def __init__(self, num_classes=10, in_channels=3, width=64, mean=None, std=None):
        super().__init__()
        self.normalize = _normalizer(in_channels, mean, std)
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        layers, cin = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2 ** i
            layers.append(nn.Sequential(PreActBlock(cin, cout, stride), PreActBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.bn = nn.BatchNorm2d(cin)
        self.linear = nn.Linear(cin, num_classes)

    def features(self, x):
        out = self.conv1(self.normalize(x))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.relu(self.bn(out))
        return F.adaptive_avg_pool2d(out, 1).flatten(1)

    def forward(self, x):
        return self.linear(self.features(x))


# ---------------------------------------------------------------- small nets
def _conv_bn(cin, cout):
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class SmallCNN(nn.Module):
    """Two conv stages and a linear head, for 28x28 (MNIST) and 8x8 (digits) inputs."""

    def __init__(self, num_classes=10, in_channels=1, width=32, mean=None, std=None):
        super().__init__()
        self.normalize = _normalizer(in_channels, mean, std)
        self.block1 = nn.Sequential(*_conv_bn(in_channels, width), *_conv_bn(width, width), nn.MaxPool2d(2))
        self.block2 = nn.Sequential(*_conv_bn(width, 2 * width), *_conv_bn(2 * width, 2 * width),
                                    nn.AdaptiveAvgPool2d(1))
        self.linear = nn.Linear(2 * width, num_classes)

    def features(self, x):
        return self.block2(self.block1(self.normalize(x))).flatten(1)

    def forward(self, x):
        return self.linear(self.features(x))


class SmallVGG(nn.Module):
    """VGG-style: three stages of two 3x3 convs with max-pooling, global pooling, linear head."""

    def __init__(self, num_classes=10, in_channels=3, width=32, mean=None, std=None):
        super().__init__()
        self.normalize = _normalizer(in_channels, mean, std)
        w = width
        self.block1 = nn.Sequential(*_conv_bn(in_channels, w), *_conv_bn(w, w), nn.MaxPool2d(2))
        self.block2 = nn.Sequential(*_conv_bn(w, 2 * w), *_conv_bn(2 * w, 2 * w), nn.MaxPool2d(2))
        self.block3 = nn.Sequential(*_conv_bn(2 * w, 4 * w), *_conv_bn(4 * w, 4 * w), nn.AdaptiveAvgPool2d(1))
        self.linear = nn.Linear(4 * w, num_classes)

    def features(self, x):
        return self.block3(self.block2(self.block1(self.normalize(x)))).flatten(1)

    def forward(self, x):
        return self.linear(self.features(x))


class LeNet(nn.Module):
    """LeNet-5 style (LeCun et al. 1998), as in many published backdoor demos: two 5x5 conv + max-pool
    stages and three linear layers; `width` is the first stage's channels (the second has 8/3 of them)."""

    def __init__(self, num_classes=10, in_channels=3, width=6, mean=None, std=None):
        super().__init__()
        self.normalize = _normalizer(in_channels, mean, std)
        w2 = max(1, round(width * 8 / 3))
        self.conv = nn.Sequential(nn.Conv2d(in_channels, width, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                                  nn.Conv2d(width, w2, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                                  nn.AdaptiveAvgPool2d(5))
        self.fc = nn.Sequential(nn.Linear(w2 * 25, 120), nn.ReLU(inplace=True), nn.Linear(120, 84),
                                nn.ReLU(inplace=True))
        self.linear = nn.Linear(84, num_classes)

    def features(self, x):
        return self.fc(self.conv(self.normalize(x)).flatten(1))

    def forward(self, x):
        return self.linear(self.features(x))


class ConvMixer(nn.Module):
    """ConvMixer (Trockman & Kolter, "Patches Are All You Need?", TMLR 2023, https://arxiv.org/abs/2201.09792):
    a patch embedding, then `depth` blocks of a residual depthwise `kernel` x `kernel` conv and a pointwise
    conv at constant resolution (4x4 patches: 8x8 tokens, for CPU speed); `width` is the channel count.
    A third architecture family beside the ResNet and the VGG: no pooling inside, large depthwise kernels,
    GELU."""

    def __init__(self, num_classes=10, in_channels=3, width=128, depth=8, kernel=5, patch=4, mean=None, std=None):
        super().__init__()
        self.normalize = _normalizer(in_channels, mean, std)

        def act_bn(module):
            return [module, nn.GELU(), nn.BatchNorm2d(width)]

        self.embed = nn.Sequential(*act_bn(nn.Conv2d(in_channels, width, patch, stride=patch)))
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"mix": nn.Sequential(*act_bn(nn.Conv2d(width, width, kernel, groups=width,
                                                                  padding=kernel // 2))),
                           "point": nn.Sequential(*act_bn(nn.Conv2d(width, width, 1)))})
            for _ in range(depth))
        self.linear = nn.Linear(width, num_classes)

    def features(self, x):
        x = self.embed(self.normalize(x))
        for block in self.blocks:
            x = block["point"](x + block["mix"](x))
        return F.adaptive_avg_pool2d(x, 1).flatten(1)

    def forward(self, x):
        return self.linear(self.features(x))


# ---------------------------------------------------------------- registry
MODELS: Registry[Callable[..., nn.Module]] = Registry("model")
for _name, _factory in (("preact_resnet18", PreActResNet18), ("small_cnn", SmallCNN), ("small_vgg", SmallVGG),
                        ("lenet", LeNet), ("convmixer", ConvMixer)):
    MODELS.register(_name, _factory)
available = MODELS.available


def register(name: str, factory: Callable[..., nn.Module]) -> None:
    """Add a model: `factory(num_classes=, in_channels=, mean=, std=, **kw)` returns an nn.Module
    that takes [0, 1] inputs (normalise inside, e.g. with ``Normalize``)."""
    MODELS.register(name, factory)


MAX_CLASSES = 100_000
MAX_WIDTH = 4096  # a sidecar asking for more would allocate tens of GB before any weight is read


def create(name: str, num_classes: int, in_channels: int = 3, dataset: str | None = None,
           seed: int | None = None, **kw) -> nn.Module:
    """Build a registered model; `dataset` fills in its normalisation statistics when known, and
    `seed` makes the initial weights reproducible (without touching the global random state)."""
    factory = MODELS.get(name)
    if not isinstance(num_classes, int) or not 2 <= num_classes <= MAX_CLASSES or in_channels not in (1, 3):
        raise PBEError(f"a model needs 2 to {MAX_CLASSES} classes and 1 or 3 input channels, got {num_classes!r} "
                       f"and {in_channels!r}")
    width = kw.get("width")
    if width is not None and (not isinstance(width, int) or isinstance(width, bool) or not 1 <= width <= MAX_WIDTH):
        raise PBEError(f"model width must be an integer in [1, {MAX_WIDTH}], got {width!r}")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2 ** 63):
        raise PBEError(f"a model seed must be an integer in [0, 2**63), got {seed!r}")
    if dataset in DATASET_STATS and "mean" not in kw and len(DATASET_STATS[dataset][0]) == in_channels:
        kw["mean"], kw["std"] = DATASET_STATS[dataset]
    try:
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            model = factory(num_classes=num_classes, in_channels=in_channels, **kw)
    except TypeError as err:
        raise PBEError(f"bad arguments for model {name!r}: {err}") from err
    model.pbe_spec = {"name": name, "num_classes": num_classes, "in_channels": in_channels,
                      **{k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()}}
    return model


def describe(model: nn.Module) -> str:
    spec = getattr(model, "pbe_spec", None)
    if not spec:
        return type(model).__name__
    args = ", ".join(f"{k}={v}" for k, v in spec.items()
                     if k not in ("name", "num_classes", "in_channels", "mean", "std"))
    return f"{spec['name']}({args})"


# ---------------------------------------------------------------- activations
def layer_names(model: nn.Module) -> list[str]:
    """Names usable with `activations` (every named submodule)."""
    return [n for n, _ in model.named_modules() if n]


def last_conv_name(model: nn.Module) -> str:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    if not names:
        raise PBEError("the model has no Conv2d layer")
    return names[-1]


@contextmanager
def capture(model: nn.Module, layers: Iterable[str | nn.Module], inputs: bool = False):
    """While inside ``with capture(model, layers) as out:``, every forward pass of `model` stores each
    layer's output (its first input with `inputs`) in ``out[layer]`` (keyed as given: a name or the
    module), replacing the previous pass's; the tensors keep their graph. Hooks go on exit."""
    modules = dict(model.named_modules())
    layers = list(layers)
    missing = [n for n in layers if isinstance(n, str) and n not in modules]
    if missing:
        raise PBEError(f"unknown layer(s) {missing}; see pbe.models.layer_names(model)")
    out: dict = {}

    def hook(key):
        return lambda m, i, o: out.__setitem__(key, i[0] if inputs else o)
    hooks = [(modules[n] if isinstance(n, str) else n).register_forward_hook(hook(n)) for n in layers]
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


def has_linear_head(model: nn.Module) -> bool:
    """Whether ``last_linear`` (and so ``penultimate``) has a layer to read."""
    return any(isinstance(m, nn.Linear) for m in model.modules())


def last_linear(model: nn.Module) -> nn.Linear:
    """The model's last ``nn.Linear`` (its classification head, for the models of this toolkit)."""
    if not has_linear_head(model):
        raise PBEError("the model has no nn.Linear head to read penultimate features from")
    return [m for m in model.modules() if isinstance(m, nn.Linear)][-1]


@torch.no_grad()
def penultimate(model: nn.Module, images: torch.Tensor, batch_size: int = 512, device=None,
                with_logits: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Inputs of the last linear layer (the representation AC, SS and ``pbe.isolation`` cluster) for
    uint8 images, in eval mode; `with_logits`: ``(features, logits)`` from the same pass (the logits
    equal ``pbe.metrics.predict``'s). `device`: default the model's."""
    device = device if device is not None else next(model.parameters()).device
    store: list[torch.Tensor] = []
    logits: list[torch.Tensor] = []
    head = last_linear(model)
    was_training = model.training
    model.eval()
    try:
        with capture(model, [head], inputs=True) as out:
            for s in range(0, len(images), batch_size):
                logits.append(model(images[s:s + batch_size].to(device).float().div_(255)).float().cpu())
                store.append(out[head].flatten(1).float().cpu())
    finally:
        model.train(was_training)
    return (torch.cat(store), torch.cat(logits)) if with_logits else torch.cat(store)


@torch.no_grad()
def activations(model: nn.Module, x: torch.Tensor, layers: list[str], batch_size: int = 256) -> dict[str, torch.Tensor]:
    """Outputs of the named submodules for inputs `x` (eval mode)."""
    store: dict[str, list[torch.Tensor]] = {n: [] for n in layers}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with capture(model, layers) as out:
            for start in range(0, len(x), batch_size):
                model(x[start:start + batch_size].to(device))
                for n in layers:
                    store[n].append(out[n].detach().cpu())
    finally:
        model.train(was_training)
    return {n: torch.cat(v) for n, v in store.items()}
