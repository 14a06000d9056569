import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PBE_CACHE", str(tmp_path_factory.getbasetemp() / "pbe-cache"))


@pytest.fixture(scope="session")
def digits():
    from pbe import data
    return data.load("digits", split="train"), data.load("digits", split="test")


@pytest.fixture(scope="session")
def badnets_model(digits):
    """A tiny BadNets-infected digits model (2x2 patch, target 0, 10%): trained once per session."""
    import attacks
    from pbe import models
    train, _ = digits
    attack = attacks.create("badnets", target=0, size=2, seed=0)
    model = models.create("small_cnn", 10, 1, dataset="digits", width=16, seed=0)
    poisoned, _ = attack.plant(model, train, None, rate=0.1, recipe="tiny", seed=0, epochs=12, progress=False)
    return model, attack, poisoned


@pytest.fixture(scope="session")
def blend_model(digits):
    """A tiny Blend-infected digits model (noise key, alpha 0.2, target 0, 10%)."""
    import attacks
    from pbe import models
    attack = attacks.create("blend", target=0, seed=0)
    model = models.create("small_cnn", 10, 1, dataset="digits", width=16, seed=0)
    poisoned, _ = attack.plant(model, digits[0], None, rate=0.1, recipe="tiny", seed=0, epochs=12, progress=False)
    return model, attack, poisoned


@pytest.fixture(scope="session")
def clean_model(digits):
    from pbe import models
    from pbe.train import train
    model = models.create("small_cnn", 10, 1, dataset="digits", width=16, seed=0)
    train(model, digits[0], recipe="tiny", seed=0, epochs=12, progress=False)
    return model


def needs_shared(name):
    path = SHARED / name
    return pytest.mark.skipif(not path.exists(), reason=f"{path} absent (shared offline datasets not mounted)")


def tiny_images(n=6, c=3, h=8, w=8, seed=0):
    return torch.rand(n, c, h, w, generator=torch.Generator().manual_seed(seed))
