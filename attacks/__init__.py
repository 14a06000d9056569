"""Backdoor attacks behind one interface: ``attacks.create(name, **params)``.

>>> atk = attacks.create("badnets", target=0)
>>> poisoned = atk.poison(train_set, rate=0.1, seed=0)      # records poisoned indices
>>> x_trig = atk.apply(x)                                    # float (N, C, H, W) in [0, 1]
"""
from __future__ import annotations

from attacks.adap_blend import AdapBlend
from attacks.adap_patch import AdapPatch
from attacks.badnets import BadNets
from attacks.base import BackdoorAttack, PoisonedDataset, load_state
from attacks.blend import Blend
from attacks.bpp import BPP
from attacks.input_aware import InputAware
from attacks.lc import LC
from attacks.lf import LF
from attacks.sig import SIG
from attacks.ssba import SSBA
from attacks.trojannn import TrojanNN
from attacks.wanet import WaNet
from pbe.registry import Registry

REGISTRY: Registry[type[BackdoorAttack]] = Registry("attack")
for _cls in (BadNets, Blend, SIG, WaNet, InputAware, TrojanNN, LC, LF, BPP, AdapBlend, AdapPatch, SSBA):
    REGISTRY.register(_cls.name, _cls)
available = REGISTRY.available


def create(name: str, **params) -> BackdoorAttack:
    """``attacks.create("badnets", target=0, size=3)``; register your own with ``REGISTRY.register``."""
    return REGISTRY.create(name, **params)


def load(path) -> BackdoorAttack:
    """Rebuild an attack saved with ``attack.save(path)`` (exact trigger tensors)."""
    return load_state(path, REGISTRY)


__all__ = ["REGISTRY", "BackdoorAttack", "PoisonedDataset", "create", "load", "available", "BadNets", "Blend", "SIG",
           "WaNet", "InputAware", "TrojanNN", "LC", "LF", "BPP", "AdapBlend", "AdapPatch", "SSBA"]
