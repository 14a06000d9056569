import json
import subprocess
import sys

import pytest
import torch

import pbe
from pbe import checkpoint, models
from pbe.train import get_recipe, lr_at, train
from pbe.utils import PBEError


def test_save_load_roundtrip_without_pickle(tmp_path):
    m = models.create("preact_resnet18", 10, 3, dataset="cifar10", width=4).eval()
    path = pbe.save(m, tmp_path / "model", {"dataset": "cifar10", "seed": 3})
    side = json.loads((tmp_path / "model.json").read_text())
    assert path.suffix == ".safetensors" and side["architecture"]["width"] == 4 and side["seed"] == 3
    assert "toolkit_version" in side
    m2, meta = pbe.load(tmp_path)
    x = torch.rand(2, 3, 32, 32)
    assert torch.equal(m(x), m2(x)) and meta["dataset"] == "cifar10"


def test_interrupted_save_leaves_no_file(tmp_path, monkeypatch):
    m = models.create("small_cnn", 10, 1, width=4)

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(checkpoint, "save_file", boom)
    with pytest.raises(OSError):
        pbe.save(m, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_legacy_pt_weights_only(tmp_path):
    m = models.create("small_cnn", 10, 1, width=4)
    torch.save(m.state_dict(), tmp_path / "legacy.pt")
    arch = {"name": "small_cnn", "num_classes": 10, "in_channels": 1, "width": 4}
    m2, _ = pbe.load(tmp_path / "legacy.pt", architecture=arch)
    assert torch.equal(m2.linear.weight, m.linear.weight)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(PBEError, match="weights-only"):
        pbe.load(tmp_path / "evil.pt", architecture=arch)
    with pytest.raises(PBEError, match="bare state dict"):
        pbe.load(tmp_path / "legacy.pt")


def test_training_is_seeded_and_learns(digits, tmp_path):
    train_set, test_set = digits
    import copy
    a = models.create("small_cnn", 10, 1, dataset="digits", width=16, seed=1)  # seeded init: not flaky
    b = copy.deepcopy(a)
    ha = train(a, train_set, test_set, "tiny", seed=1, epochs=6, progress=False, log_path=tmp_path / "log.jsonl")
    train(b, train_set, test_set, "tiny", seed=1, epochs=6, progress=False)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert ha[-1]["test_acc"] > 0.85
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3, 4, 5, 6]


def test_onecycle_schedule_shape():
    r = get_recipe("cpu", lr=1.0, warmup=0.25)
    lrs = [lr_at(s, 100, r) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and max(lrs) == pytest.approx(1.0) and lrs.index(1.0) == 25
    assert lrs[-1] < 0.05
    with pytest.raises(PBEError, match="unknown recipe field"):
        get_recipe("cpu", epoch=3)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "pbe.cli", *args], capture_output=True, text=True)


def test_cli_train_and_evaluate(tmp_path):
    r = run_cli("train", "--dataset", "digits", "--epochs", "2", "--out", str(tmp_path), "--no-progress")
    assert r.returncode == 0, r.stderr
    written = {p.name for p in tmp_path.iterdir()}
    assert {"model.safetensors", "model.json", "metrics.json", "train_log.jsonl"} <= written
    r = run_cli("evaluate", "--model", str(tmp_path))
    assert r.returncode == 0 and json.loads(r.stdout)["acc"] > 0.3


def test_cli_user_errors_are_one_line(tmp_path):
    r = run_cli("train", "--dataset", "cifar10", "--data-root", str(tmp_path / "none"), "--out", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "CIFAR-10 not found" in r.stderr
    r = run_cli("evaluate", "--model", str(tmp_path / "missing"))
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_out_is_checked_writable_before_work_and_files_follow_the_umask(tmp_path):
    import os
    import time

    from pbe.utils import write_json
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    start = time.time()
    r = run_cli("train", "--recipe", "tiny", "--out", str(blocker / "run"))
    assert r.returncode == 2 and "is not writable" in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.glob("**/model.safetensors")) and time.time() - start < 60
    old = os.umask(0o027)
    try:
        write_json(tmp_path / "x.json", {"a": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "x.json").stat().st_mode & 0o777 == 0o640
