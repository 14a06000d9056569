"""SSBA (Li, Li, Wu, Li, He & Lyu, ICCV 2021): an invisible, sample-specific trigger made by a
steganography encoder that hides a fixed secret bit string in each image.

The paper trains a StegaStamp encoder-decoder (Tancik et al., CVPR 2020) on the attacker's images, then
poisons a share of the training set with encoder(image, secret) relabelled to the target. Here:

1. stage 1 (``fit_encoder``, `encoder_epochs`): a small U-Net encoder and a convolutional decoder learn
   to hide random bit strings (as StegaStamp trains, so the encoder is one for all secrets) in the
   training images; loss = bit BCE of the decoder + `l2_weight` x mean squared residual / eps^2. The
   image term is off for the first quarter of the steps and ramps up linearly over the second (StegaStamp
   ramps its image losses up; BackdoorBox trains on the bit loss alone for its first 2 of 20 epochs);
2. poisoning and training as every static attack: x' = x + residual(x, secret) with the attack's fixed
   seeded secret of `bits` bits.

Reductions (CPU sizes): the encoder is a 3-level U-Net of widths 16-32 (StegaStamp's has 5 levels up to
256 channels); the decoder has no spatial-transformer front end; the LPIPS term, the critic
(adversarial) term and StegaStamp's image-corruption augmentations are left out; the residual is bounded
by eps * tanh(.) (StegaStamp's is unbounded and kept small by its losses alone) and its output layer
starts at 10x the default scale, near that bound, so the decoder has a signal to learn from (the bit loss
otherwise sits at chance for hundreds of steps); Adam at 1e-3 (BackdoorBox: 1e-4 for 20 GPU epochs). The
paper poisons 10 % of the training set.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from attacks.base import BackdoorAttack
from pbe.utils import PBEError, resolve_device

WIDTH = 16  # channels of the encoder's and decoder's first level
SECRET_GRID = 8  # the secret is first mapped to a SECRET_CHANNELS x 8 x 8 map, then upsampled to the image
SECRET_CHANNELS = 4
ENCODER_BATCH = 64
ENCODER_LR = 1e-3
OUT_GAIN = 10.0
WARMUP = 0.25  # stage 1: the bit loss alone for this share of the steps; the image term ramps up over as many


def _conv(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.ReLU(inplace=True))


class StegaEncoder(nn.Module):
    """A small U-Net: image and secret map in, a residual bounded by `eps` out."""

    def __init__(self, channels: int, bits: int, eps: float, width: int = WIDTH):
        super().__init__()
        self.eps = eps
        self.secret_fc = nn.Linear(bits, SECRET_CHANNELS * SECRET_GRID * SECRET_GRID)
        cin = channels + SECRET_CHANNELS
        self.enc1 = nn.Sequential(_conv(cin, width), _conv(width, width))
        self.enc2 = nn.Sequential(_conv(width, 2 * width, stride=2), _conv(2 * width, 2 * width))
        self.enc3 = nn.Sequential(_conv(2 * width, 2 * width, stride=2), _conv(2 * width, 2 * width))
        self.dec2 = _conv(4 * width, 2 * width)
        self.dec1 = _conv(3 * width, width)
        self.out = nn.Conv2d(width + cin, channels, 1)
        with torch.no_grad():  # start near the bound (see the module docstring)
            self.out.weight.mul_(OUT_GAIN)

    def forward(self, x: torch.Tensor, secret: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        s = F.relu(self.secret_fc(secret - 0.5)).view(len(x), SECRET_CHANNELS, SECRET_GRID, SECRET_GRID)
        inp = torch.cat([x - 0.5, F.interpolate(s, size=(h, w), mode="nearest")], dim=1)
        e1 = self.enc1(inp)
        e2 = self.enc2(e1)
        e3 = self.enc3(e2)
        d2 = self.dec2(torch.cat([e2, F.interpolate(e3, size=e2.shape[-2:], mode="nearest")], dim=1))
        d1 = self.dec1(torch.cat([e1, F.interpolate(d2, size=(h, w), mode="nearest")], dim=1))
        return self.eps * torch.tanh(self.out(torch.cat([d1, inp], dim=1)))


class StegaDecoder(nn.Module):
    """Strided convolutions, a 4x4 pooled map, two linear layers: one logit per bit."""

    def __init__(self, channels: int, bits: int, width: int = WIDTH):
        super().__init__()
        self.features = nn.Sequential(_conv(channels, width, stride=2), _conv(width, 2 * width),
                                      _conv(2 * width, 2 * width, stride=2), _conv(2 * width, 2 * width),
                                      nn.AdaptiveAvgPool2d(4))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * 16, 256), nn.ReLU(inplace=True),
                                  nn.Linear(256, bits))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x - 0.5))


def psnr(x: torch.Tensor, y: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of two float batches in [0, 1] (over the whole batch)."""
    mse = float((x - y).pow(2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


class SSBA(BackdoorAttack):
    """SSBA (Li, Li, Wu, Li, He & Lyu, "Invisible Backdoor Attack with Sample-Specific Triggers",
    ICCV 2021, https://arxiv.org/abs/2012.03816): x' = x + E(x, s), the residual of a steganography
    encoder E hiding the attack's fixed secret s (`bits` seeded bits) in x; poison-label. ``plant``
    first trains E with a decoder (stage 1, see the module docstring), then poisons and trains the
    classifier. Before stage 1 ``apply`` uses the untrained (seeded) encoder.

    Arguments:
        target (int): the target label of an all-to-one backdoor (default 0).
        all_to_all (bool): label y -> (y + 1) mod C instead (default False).
        seed (int): seeds the secret and the networks' initial weights (default 0).
        bits (int): length of the secret (default 20, the CIFAR-10 setting of BackdoorBox and
            backdoor-toolbox; the paper hides 100 bits in ImageNet images).
        eps (float): bound of the residual in [0, 1] units, per pixel and channel (default 0.05: 12.75/255).
        encoder_epochs (float): stage-1 epochs over the training set (default 1.0: 782 steps of 64 images,
            about 4 minutes on CIFAR-10 at one CPU thread; 440 steps on 2,000 CIFAR-10 images reached 98 %
            bit accuracy at 36.6 dB PSNR).
        l2_weight (float): weight of the image term (mean squared residual / eps^2) (default 1.0).

    Example::

        >>> attack = attacks.create("ssba", target=0, encoder_epochs=1)
        >>> poisoned_train, _ = attack.plant(model, train_set, test_set, rate=0.1)
        >>> attack.encoder_history[-1]  # stage 1: bit accuracy and PSNR on its last steps
    """

    name = "ssba"

    def __init__(self, target=0, all_to_all=False, seed=0, bits=20, eps=0.05, encoder_epochs=1.0, l2_weight=1.0):
        super().__init__(target, all_to_all, seed)
        if int(bits) != bits or bits < 1:
            raise PBEError(f"bits must be an integer >= 1 (the secret's length), got {bits}")
        if not 0 < eps <= 1:
            raise PBEError(f"eps (the residual's bound) must be in (0, 1], got {eps}")
        if encoder_epochs < 0 or l2_weight < 0:
            raise PBEError(f"encoder_epochs and l2_weight must be >= 0, got {encoder_epochs} and {l2_weight}")
        self.bits, self.eps = int(bits), float(eps)
        self.encoder_epochs, self.l2_weight = float(encoder_epochs), float(l2_weight)
        self.encoder_history: list[dict] = []

    def params(self):
        return {**super().params(), "bits": self.bits, "eps": self.eps, "encoder_epochs": self.encoder_epochs,
                "l2_weight": self.l2_weight}

    def _build(self, shape, generator):
        c = shape[0]
        self.register_buffer("secret", torch.randint(0, 2, (self.bits,), generator=generator).float())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.encoder = StegaEncoder(c, self.bits, self.eps)
            self.decoder = StegaDecoder(c, self.bits)
        self.eval()

    def residual(self, x: torch.Tensor, secret: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's residual hiding `secret` (default: the attack's) in each image of `x`."""
        s = self.secret if secret is None else secret
        return self.encoder(x, s.expand(len(x), -1) if s.dim() == 1 else s)

    def _trigger(self, x, train):
        return x + self.residual(x)

    def bit_accuracy(self, x: torch.Tensor) -> float:
        """Share of the secret's bits the decoder reads back from the (clipped) triggered `x`."""
        self.prepare(x.shape[1:]).to(x.device)
        with torch.no_grad():
            bits = self.decoder(self.apply(x)) > 0
        return float((bits == self.secret.bool()).float().mean())

    # ---- stage 1
    def fit_encoder(self, train_set, device="cpu", seed: int = 0, progress: bool = False) -> list[dict]:
        """Train encoder and decoder on `train_set`'s images with random secrets (``encoder_epochs``);
        returns (and keeps in ``encoder_history``) bit accuracy, PSNR and loss per tenth of the steps."""
        dev = resolve_device(device)
        self.prepare(train_set.image_shape).to(dev)
        gen = torch.Generator().manual_seed(seed)
        steps = round(self.encoder_epochs * len(train_set) / ENCODER_BATCH)
        nets = list(self.encoder.parameters()) + list(self.decoder.parameters())
        opt = torch.optim.Adam(nets, lr=ENCODER_LR)
        self.train()
        history, acc_sum, psnr_sum, loss_sum, seen = [], 0.0, 0.0, 0.0, 0
        report = max(1, steps // 10)
        for step in tqdm(range(steps), desc="ssba encoder", disable=not progress, leave=False):
            idx = torch.randint(len(train_set), (ENCODER_BATCH,), generator=gen)
            x = train_set.images[idx].to(dev).float() / 255
            secret = torch.randint(0, 2, (len(x), self.bits), generator=gen).float().to(dev)
            res = self.encoder(x, secret)
            encoded = (x + res).clamp(0, 1)
            logits = self.decoder(encoded)
            bce = F.binary_cross_entropy_with_logits(logits, secret)
            ramp = min(1.0, max(0.0, (step - steps * WARMUP) / (steps * WARMUP)))
            loss = bce + ramp * self.l2_weight * res.pow(2).mean() / self.eps ** 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc_sum += float(((logits > 0) == secret.bool()).float().mean())
            psnr_sum += psnr(encoded.detach(), x)
            loss_sum += float(loss.detach())
            seen += 1
            if seen == report or step == steps - 1:
                history.append({"step": step + 1, "bit_acc": round(acc_sum / seen, 4),
                                "psnr": round(psnr_sum / seen, 2), "loss": round(loss_sum / seen, 4)})
                if progress:
                    tqdm.write(" ".join(f"{k}={v}" for k, v in history[-1].items()))
                acc_sum, psnr_sum, loss_sum, seen = 0.0, 0.0, 0.0, 0
        self.eval()
        self.encoder_history = history
        return history

    def plant(self, model, train_set, test_set=None, rate=0.1, recipe="cpu", seed=0, device="auto", progress=True,
              **train_kw):
        """Stage 1 (encoder and decoder, seeded: a resumed run retrains them identically), then poison
        `train_set` with the encoder and train `model` on it."""
        from pbe.train import train
        if self.target >= train_set.num_classes:
            raise PBEError(f"target {self.target} is not a class of {train_set.name}")
        dev = resolve_device(device)
        self.fit_encoder(train_set, dev, seed, progress)
        self.cpu()
        poisoned = self.poison(train_set, rate, seed)
        history = train(model, poisoned, test_set, recipe, seed=seed, device=dev, progress=progress, **train_kw)
        return poisoned, history


__all__ = ["SSBA", "StegaEncoder", "StegaDecoder", "psnr"]
