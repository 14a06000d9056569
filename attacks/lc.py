"""Label-consistent backdoor (Turner, Tsipras & Madry, 2019): clean-label poisoning of target-class images
that are first made hard to classify, then stamped with a small corner pattern.

A poisoned image keeps its (correct, target-class) label, so its natural features already explain the
label and a model has no reason to learn a trigger. The paper therefore first perturbs each poisoned
image adversarially, L-inf PGD within `eps` AWAY from its own class, so that its natural features stop
pointing to it, and only then stamps the trigger: the model has to lean on the trigger to fit the label.
The trigger (the authors' code): a 3x3 black/white pattern in each corner, mirrored left to right so that
it survives horizontal flips, added with amplitude `amplitude` (x + amplitude * (+-1), clipped); the
paper's reduced amplitudes make it less visible in the training set, and the test-time trigger is always
the full-amplitude one (pixels set to black or white).

Paper: PGD at eps 8/255 or 16/255 on an adversarially trained (robust) model, whose perturbations carry
the features of other classes (the authors also interpolate in a GAN's latent space); BackdoorBench: 100
steps of 1.5/255 at 8/255 on an adversarially trained ResNet-18, amplitude 1.
Reduction: no robust model is at hand, so the PGD runs on a ``clean_surrogate`` (a standard model trained
`surrogate_epochs` on the clean training set) with `steps` steps. Perturbations of a standard model are
less semantic than a robust model's, and the attack is known to be weaker so (lower ASR than the paper's
at the same poison rate).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from attacks.base import BackdoorAttack, PoisonedDataset, clean_surrogate, to_uint8
from pbe.adversarial import PGDConfig, adversarial_examples
from pbe.data import ImageDataset
from pbe.utils import PBEError

TRIGGERS = ("all-corners", "bottom-right")
# the authors' corner pattern (+1 white, -1 black) for the left corners, mirrored on the right ones
CORNER_PATTERN = ((1, -1, -1), (-1, 1, -1), (1, -1, 1))
TEST_AMPLITUDE = 1.0  # the test-time trigger: full amplitude
PGD_BATCH = 256


class LC(BackdoorAttack):
    """Label-consistent backdoor (Turner, Tsipras & Madry, "Label-Consistent Backdoor Attacks", 2019,
    https://arxiv.org/abs/1912.02771, code https://github.com/MadryLab/label-consistent-backdoor-code):
    target-class training images, labels kept, adversarially perturbed away from their class on a clean
    surrogate, then stamped with a corner pattern (see the module docstring for the recipe and the reduction).

    ``poison`` needs the surrogate model for the adversarial step: ``plant`` trains one
    (`surrogate_epochs`) or takes ``surrogate=``, and ``poison(..., surrogate=model)`` takes one too. The
    surrogate is not saved; the poisoned images it made are (buffer `poisoned`, uint8: 3 KB per CIFAR-10
    image), so a loaded attack re-poisons the same training set exactly, on any machine and thread count
    (a PGD rerun would differ in a few pixels between thread counts).

    Arguments:
        target (int): the target label; the poisoned images are the target class's own (default 0).
        all_to_all (bool): must stay False: a clean-label attack is all-to-one (default False).
        seed (int): seeds which target-class images are poisoned (default 0).
        eps (float): L-inf budget of the adversarial perturbation, in [0, 1] pixel units (default 16/255,
            the paper's stronger setting, to make up for a non-robust surrogate; 0: trigger only).
        steps (int): PGD steps (default 10; BackdoorBench 100, cut for CPUs).
        step (float | None): PGD step size (default None: eps / 4).
        amplitude (float): the training trigger's amplitude in (0, 1] (default 1.0, full, BackdoorBench's
            and the authors' default; the paper also studies 16/255, 32/255 and 64/255). At test time the
            trigger is always at full amplitude.
        trigger (str): "all-corners" (default, the pattern in all four corners: flip-proof) or
            "bottom-right" (the paper's first trigger: one corner).
        surrogate_epochs (int): epochs of the clean surrogate ``plant`` trains for the PGD (default 3).

    Example::

        >>> attack = attacks.create("lc", target=0, eps=16 / 255, amplitude=1.0)
        >>> poisoned_train, _ = attack.plant(model, train_set, test_set, rate=0.1, recipe="cpu")
        >>> x_trig = attack.apply(x)     # the full-amplitude four-corner trigger
    """

    name = "lc"
    clean_label = True

    def __init__(self, target=0, all_to_all=False, seed=0, eps=16 / 255, steps=10, step=None, amplitude=1.0,
                 trigger="all-corners", surrogate_epochs=3):
        super().__init__(target, all_to_all, seed)
        if all_to_all:
            raise PBEError("the label-consistent attack is clean-label, hence all-to-one; drop all_to_all")
        if trigger not in TRIGGERS:
            raise PBEError(f"LC trigger must be one of {TRIGGERS}, got {trigger!r}")
        if not 0 < float(amplitude) <= 1:
            raise PBEError(f"LC amplitude must be in (0, 1] (1 = full), got {amplitude}")
        if int(surrogate_epochs) < 1:
            raise PBEError(f"surrogate_epochs must be >= 1, got {surrogate_epochs}")
        self.eps, self.steps = float(eps), int(steps)
        self.step = None if step is None else float(step)
        self.pgd = PGDConfig(eps=self.eps, steps=self.steps, step=self.step)  # checks eps, steps and step
        self.amplitude, self.trigger, self.surrogate_epochs = float(amplitude), trigger, int(surrogate_epochs)
        self.use_surrogate(None)

    def params(self):
        return {**super().params(), "eps": self.eps, "steps": self.steps, "step": self.step,
                "amplitude": self.amplitude, "trigger": self.trigger, "surrogate_epochs": self.surrogate_epochs}

    def use_surrogate(self, model: nn.Module | None) -> None:
        """The clean model the adversarial step attacks. Kept outside the module tree: not saved, not moved."""
        object.__setattr__(self, "_surrogate", model)

    # ---- the trigger
    def _build(self, shape, generator):
        c, h, w = shape
        k = len(CORNER_PATTERN)
        need = 2 * k if self.trigger == "all-corners" else k
        if min(h, w) < need:
            raise PBEError(f"the {self.trigger} trigger needs images of at least {need}x{need} pixels, got {h}x{w}")
        left = torch.tensor(CORNER_PATTERN, dtype=torch.float32)
        right = left.flip(1)
        sign = torch.zeros(h, w)
        sign[h - k:, w - k:] = right
        if self.trigger == "all-corners":
            sign[:k, :k] = left
            sign[h - k:, :k] = left
            sign[:k, w - k:] = right
        self.register_buffer("pattern", sign.expand(c, h, w).clone())
        self.register_buffer("poisoned", torch.zeros(0, c, h, w, dtype=torch.uint8))  # filled by the PGD poisoning

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A saved `poisoned` buffer holds as many images as its poisoning made: take its shape first."""
        if prefix + "poisoned" in state_dict:
            self.poisoned = torch.empty_like(state_dict[prefix + "poisoned"])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _trigger(self, x, train):
        return x + (self.amplitude if train else TEST_AMPLITUDE) * self.pattern

    # ---- poisoning
    def poison(self, dataset: ImageDataset, rate: float, seed: int | None = None, include_target: bool = False,
               surrogate: nn.Module | None = None) -> PoisonedDataset:
        """The base class's poisoning; `surrogate` (kept for later calls) replaces the one ``plant`` trained."""
        if surrogate is not None:
            self.use_surrogate(surrogate)
        return super().poison(dataset, rate, seed, include_target)

    def _poison_images(self, images, labels, generator):
        """PGD away from the true label on the surrogate, then the training-amplitude trigger."""
        if self.eps == 0 or len(images) == 0:
            return self._batched_uint8(images, train=True)
        if self._surrogate is None and len(self.poisoned) == len(images):
            return self.poisoned.clone()  # the images this attack's own PGD made (saved with it)
        if self._surrogate is None:
            raise PBEError("LC perturbs its poisoned images adversarially on a clean surrogate model and has none: "
                           "call plant() (which trains one) or pass poison(..., surrogate=model); a loaded LC "
                           "attack keeps only its trigger (eps=0 poisons with the trigger alone)")
        adv = adversarial_examples(self._surrogate, images, labels, self.pgd, batch_size=PGD_BATCH)
        self.poisoned = torch.cat([to_uint8(self.apply(adv[s:s + PGD_BATCH], train=True))
                                   for s in range(0, len(adv), PGD_BATCH)]).cpu()
        return self.poisoned.clone()

    def plant(self, model, train_set, test_set=None, rate=0.1, recipe="cpu", seed=0, device="auto",
              progress=True, surrogate=None, **train_kw):
        """Train a clean surrogate (`surrogate_epochs`; or use `surrogate`), poison `train_set` with it and
        train `model` on the poisoned set in place. Returns the poisoned set and the training history. A
        resumed run (``state_path``) trains the surrogate again: the same seed gives the same poison."""
        from pbe.train import train
        if self.target >= train_set.num_classes:
            raise PBEError(f"target {self.target} is not a class of {train_set.name}")
        eligible = len(self.candidates(train_set.labels))
        if not 0 <= rate <= 1 or round(rate * len(train_set)) > eligible:
            raise PBEError(f"rate {rate} asks for {round(rate * len(train_set))} poisoned samples but LC poisons "
                           f"only the {eligible} target-class ones; lower --rate")
        if surrogate is None and self.eps > 0:
            surrogate = clean_surrogate(model, train_set, recipe, self.surrogate_epochs, seed, device, progress)
        poisoned = self.poison(train_set, rate, seed, surrogate=surrogate)
        history = train(model, poisoned, test_set, recipe, seed=seed, device=device, progress=progress, **train_kw)
        return poisoned, history


__all__ = ["LC", "TRIGGERS", "CORNER_PATTERN"]
