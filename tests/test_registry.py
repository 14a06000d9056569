"""One registry pattern for attacks, defences, models and datasets; users add their own."""
import pytest
import torch.nn as nn

import attacks
from pbe import data, defenses, models
from pbe.registry import Registry
from pbe.utils import PBEError


def test_registry_lists_sorted_suggests_and_refuses_duplicates():
    reg = Registry("widget")
    reg.register("zeta", dict)

    @reg.register("alpha")
    def make(x=1):
        return {"x": x}
    assert reg.available() == ["alpha", "zeta"] and list(reg) == ["alpha", "zeta"] and "alpha" in reg
    assert reg.create("alpha", x=3) == {"x": 3}
    with pytest.raises(PBEError, match="unknown widget 'alpah' \\(did you mean alpha\\?\\)"):
        reg.get("alpah")
    with pytest.raises(PBEError, match=r"widget 'alpha': unknown parameter\(s\) \['y'\]; known: x"):
        reg.create("alpha", y=2)
    with pytest.raises(PBEError, match="already registered"):
        reg.register("zeta", list)
    reg.register("zeta", list, replace=True)
    assert reg.get("zeta") is list


def test_every_kind_uses_it_and_a_user_can_register_their_own():
    for module, name in ((attacks, "badnets"), (defenses, "pbe")):
        assert isinstance(module.REGISTRY, Registry) and name in module.available()
    with pytest.raises(PBEError, match="did you mean badnets"):
        attacks.create("badnet")
    with pytest.raises(PBEError, match="did you mean nad"):
        defenses.create("nadd")
    with pytest.raises(PBEError, match="did you mean small_vgg"):
        models.create("small_vg", 10)
    with pytest.raises(PBEError, match="defence 'pbe': unknown parameter.*did you mean 'schedule'"):
        defenses.create("pbe", shedule="fast")

    class Tiny(nn.Module):
        def __init__(self, num_classes=10, in_channels=1, mean=None, std=None):
            super().__init__()
            self.linear = nn.Linear(in_channels * 64, num_classes)

        def forward(self, x):
            return self.linear(x.flatten(1))
    models.register("user_tiny_test", Tiny)
    assert models.create("user_tiny_test", 10, 1).linear.out_features == 10

    @data.register("user_digits_test")
    def load_user(root=None, split="train", download=False):
        return data.load("digits", split=split)
    assert "user_digits_test" in data.available() and len(data.load("user_digits_test", root=".", split="test")) > 0
