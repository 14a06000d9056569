import contextlib
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@contextlib.contextmanager
def one_thread():
    """Train the session's tiny models on one thread: torch's float order, hence the model, then no longer
    depends on the machine's thread count (a digits Blend model's scan z went from 3.2 to 6.2 between 1
    and 2 threads), so a check that passes here passes in CI on the same kind of CPU. OMP_NUM_THREADS is set
    too: torch's CPU kernels read it as well, and set_num_threads alone left that model's scan z at 2.84 with
    the variable unset (as in CI), 4.66 with it 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OMP_NUM_THREADS", "1")
            yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def cli_here(capsys):
    """`pbe ARGS` run in this process, without starting an interpreter and importing torch again (seconds
    per call): returns its exit code and what it wrote to stderr. For refusals and other short calls; a
    run whose floats must not depend on this process's threads goes through a subprocess."""
    from pbe.cli import main

    def run(*argv) -> tuple[int, str]:
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as exit_:  # argparse's errors
            rc = exit_.code
        return rc, capsys.readouterr().err
    return run


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
    with one_thread():
        poisoned, _ = attack.plant(model, train, None, rate=0.1, recipe="tiny", seed=0, epochs=12, progress=False)
    return model, attack, poisoned


@pytest.fixture(scope="session")
def blend_model(digits):
    """A tiny Blend-infected digits model (noise key, alpha 0.2, target 0, 10%)."""
    import attacks
    from pbe import models
    attack = attacks.create("blend", target=0, seed=0)
    model = models.create("small_cnn", 10, 1, dataset="digits", width=16, seed=0)
    with one_thread():
        poisoned, _ = attack.plant(model, digits[0], None, rate=0.1, recipe="tiny", seed=0, epochs=12, progress=False)
    return model, attack, poisoned


@pytest.fixture(scope="session")
def clean_model(digits):
    from pbe import models
    from pbe.train import train
    model = models.create("small_cnn", 10, 1, dataset="digits", width=16, seed=0)
    with one_thread():
        train(model, digits[0], recipe="tiny", seed=0, epochs=12, progress=False)
    return model


def needs_shared(name):
    path = SHARED / name
    return pytest.mark.skipif(not path.exists(), reason=f"{path} absent (shared offline datasets not mounted)")


def tiny_images(n=6, c=3, h=8, w=8, seed=0):
    return torch.rand(n, c, h, w, generator=torch.Generator().manual_seed(seed))
