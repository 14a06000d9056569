"""Backdoor attacks behind one interface: ``attacks.create(name, **params)``.

>>> atk = attacks.create("badnets", target=0)
>>> poisoned = atk.poison(train_set, rate=0.1, seed=0)      # records poisoned indices
>>> x_trig = atk.apply(x)                                    # float (N, C, H, W) in [0, 1]
"""
from __future__ import annotations

from attacks.badnets import BadNets
from attacks.base import BackdoorAttack, PoisonedDataset, load_state
from attacks.blend import Blend
from attacks.input_aware import InputAware
from attacks.sig import SIG
from attacks.wanet import WaNet
from pbe.utils import PBEError

REGISTRY: dict[str, type[BackdoorAttack]] = {
    cls.name: cls for cls in (BadNets, Blend, SIG, WaNet, InputAware)
}


def available() -> list[str]:
    return sorted(REGISTRY)


def create(name: str, **params) -> BackdoorAttack:
    if name not in REGISTRY:
        raise PBEError(f"unknown attack {name!r}; available: {', '.join(available())}")
    try:
        return REGISTRY[name](**params)
    except TypeError as err:
        raise PBEError(f"bad parameters for attack {name!r}: {err}") from err


def load(path) -> BackdoorAttack:
    """Rebuild an attack saved with ``attack.save(path)`` (exact trigger tensors)."""
    return load_state(path, REGISTRY)


__all__ = ["BackdoorAttack", "PoisonedDataset", "create", "load", "available", *REGISTRY]
