"""Defences behind one interface: ``pbe.defenses.create(name, **params)(model, data, ...)``.

Model repair with a clean extra set: ``ft``, ``fp``, ``nad``, ``anp``, ``ibau``, ``aft``, ``sau``, ``ftsam``.
Without clean data: ``pbe`` (repair), ``abl`` (training anew) and the filtering defences ``ac``, ``ss``, ``strip``.

    >>> defense = pbe.defenses.create("nad", epochs=20)
    >>> result = defense(model, clean_set, evaluation=Evaluation(test_set, attack))
    >>> result.model, result.report["after"], result.suspected
"""
from __future__ import annotations

from pbe.defenses.abl import ABL
from pbe.defenses.ac import ActivationClustering
from pbe.defenses.anp import ANP
from pbe.defenses.base import (SETTINGS, Context, Cost, Defense, DefenseResult, Evaluation, StagedProgress,
                               staged_progress)
from pbe.defenses.filtering import FilteringDefense
from pbe.defenses.fp import FinePruning
from pbe.defenses.ft import FineTuning
from pbe.defenses.ftsam import FTSAM
from pbe.defenses.ibau import IBAU
from pbe.defenses.nad import NAD
from pbe.defenses.aft import AFT, aft
from pbe.defenses.pbe import PBE, SCHEDULES, Schedule, erase, get_schedule
from pbe.defenses.sau import SAU
from pbe.defenses.ss import SpectralSignatures
from pbe.defenses.strip import STRIP
from pbe.registry import Registry
from pbe.utils import PBEError

REGISTRY: Registry[type[Defense]] = Registry("defence")
for _cls in (FineTuning, FinePruning, NAD, ANP, IBAU, AFT, SAU, FTSAM, PBE, ABL, ActivationClustering,
             SpectralSignatures, STRIP):
    REGISTRY.register(_cls.name, _cls)


def available(setting: str | None = None) -> list[str]:
    """Registered defences (of one setting: "clean-extra" or "no-clean"), sorted."""
    if setting is not None and setting not in SETTINGS:
        raise PBEError(f"unknown setting {setting!r}; use one of {SETTINGS}")
    return [n for n, cls in REGISTRY.items() if setting is None or cls.setting == setting]


def create(name: str, **params) -> Defense:
    """``defenses.create("nad", epochs=20)``; register your own with ``REGISTRY.register``."""
    return REGISTRY.create(name, **params)


__all__ = ["REGISTRY", "SCHEDULES", "SETTINGS", "Context", "Cost", "Defense", "DefenseResult", "Evaluation",
           "FilteringDefense", "Schedule", "StagedProgress", "aft", "available", "create", "erase", "get_schedule",
           "staged_progress"]
