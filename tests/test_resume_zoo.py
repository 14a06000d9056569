"""Resumable training (kill -9 at any moment -> bit-identical weights) and the model zoo."""
import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
from pbe import models, rundir, zoo
from pbe.train import train
from pbe.utils import PBEError

EPOCHS = "6"


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pbe_cmd(*args):
    return [sys.executable, "-m", "pbe.cli", *args]


def train_args(kind, out):
    common = ["--dataset", "digits", "--recipe", "tiny", "--epochs", EPOCHS, "--out", str(out), "--no-progress"]
    if kind == "train":
        return ["train", *common]
    return ["attack", "--attack", kind, "--param", "mask_epochs=0.5", *common] if kind == "input_aware" else \
        ["attack", "--attack", kind, *common]


def kill_mid_epoch(args, out, after_epochs=2):
    """Start a run, kill -9 it a fraction of an epoch after `after_epochs` epochs were logged."""
    for delay in (0.05, 0.0):
        proc = subprocess.Popen(pbe_cmd(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        log, t0 = rundir.staging(out) / "train_log.jsonl", time.time()
        while proc.poll() is None and time.time() - t0 < 120:
            if log.exists() and len(log.read_text().splitlines()) >= after_epochs:
                break
            time.sleep(0.005)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if not (out / "metrics.json").exists():
            return
        shutil.rmtree(out)  # it finished before the kill: try again, faster
    pytest.skip("the run always finished before it could be killed")


@pytest.mark.parametrize("kind", ["train", "input_aware"])
def test_killed_run_resumes_to_bit_identical_weights(kind, tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert subprocess.run(pbe_cmd(*train_args(kind, whole)), capture_output=True).returncode == 0
    kill_mid_epoch(train_args(kind, cut), cut)
    stage = rundir.staging(cut)  # the unfinished run lives beside --out until it is complete
    assert (stage / "train_state.safetensors").exists() and not cut.exists()
    done = len((stage / "train_log.jsonl").read_text().splitlines())
    assert 0 < done < int(EPOCHS)
    r = subprocess.run(pbe_cmd(*train_args(kind, cut)), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sha(cut / "model.safetensors") == sha(whole / "model.safetensors")
    assert not (cut / "train_state.safetensors").exists() and not stage.exists()
    rundir.verify(cut)
    log = [json.loads(line) for line in (cut / "train_log.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in log] == list(range(1, int(EPOCHS) + 1))
    if kind != "train":
        assert sha(cut / "attack.safetensors") == sha(whole / "attack.safetensors")
        assert json.loads((cut / "poison.json").read_text()) == json.loads((whole / "poison.json").read_text())


def test_finished_run_is_not_redone_and_another_run_is_refused(tmp_path, cli_here):
    out = tmp_path / "run"
    args = ["train", "--dataset", "digits", "--epochs", "2", "--out", str(out), "--no-progress"]
    assert subprocess.run(pbe_cmd(*args), capture_output=True).returncode == 0
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    rc, err = cli_here(*args)  # neither this nor the refusal trains: in this process
    assert rc == 0 and "nothing to do" in err
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    other = ["train", "--dataset", "digits", "--epochs", "2", "--seed", "1", "--out", str(out), "--no-progress"]
    rc, err = cli_here(*other)
    assert rc == 2 and "holds another run" in err and "--overwrite" in err
    r = subprocess.run(pbe_cmd(*other, "--overwrite"), capture_output=True, text=True)
    assert r.returncode == 0 and json.loads((out / "model.json").read_text())["seed"] == 1


def test_state_of_another_run_is_refused(digits, tmp_path):
    state = tmp_path / "state.safetensors"
    m = models.create("small_cnn", 10, 1, dataset="digits", width=8, seed=0)
    train(m, digits[0], recipe="tiny", seed=0, epochs=1, progress=False, state_path=state)
    with pytest.raises(PBEError, match="another run"):
        train(m, digits[0], recipe="tiny", seed=1, epochs=1, progress=False, state_path=state)
    state.write_bytes(b"not a state")
    with pytest.raises(PBEError, match="delete it"):
        train(m, digits[0], recipe="tiny", seed=0, epochs=1, progress=False, state_path=state)


ZOO_YAML = """
defaults: {dataset: digits, recipe: tiny, epochs: 4, rate: 0.1, target: 0, all_to_all: false, seed: 0}
models:
  - {name: digits/badnets, set: dev, attack: badnets, params: {size: 2}}
  - {name: digits/clean, set: generalisation, attack: none}
"""


@pytest.fixture
def tiny_zoo(tmp_path, monkeypatch):
    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo" / "zoo.yaml").write_text(ZOO_YAML)
    monkeypatch.setenv("PBE_ZOO", str(tmp_path / "zoo"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "zoo"


def test_zoo_builds_loads_checks_and_reproduces(tiny_zoo, tmp_path):
    assert zoo.available() == ["digits/badnets", "digits/clean"] and zoo.available("dev") == ["digits/badnets"]
    with pytest.raises(PBEError, match="not built"):
        zoo.load("digits/badnets")
    r = subprocess.run(pbe_cmd("zoo", "build", "--all"), capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads((tiny_zoo / "zoo.json").read_text())
    assert [(row["zoo"], row["zoo_set"]) for row in rows] == [("digits/badnets", "dev"),
                                                              ("digits/clean", "generalisation")]
    assert rows[0]["asr"] > 0.5 and rows[1]["asr"] is None and "digits/badnets" in (tiny_zoo / "README.md").read_text()
    z = zoo.load("digits/badnets")
    assert z.zoo_keys == {"zoo": "digits/badnets", "zoo_set": "dev"}
    info = json.loads((tiny_zoo / "digits/badnets/poison.json").read_text())
    assert z.train_set.poison_indices.tolist() == info["poison_indices"]
    x = z.train_set.images[z.train_set.poison_indices[:4]].float() / 255
    assert (z.model(x).argmax(1) == 0).all()  # the poisoned images it was trained on hit the target
    assert zoo.load("digits/clean").attack is None
    # rebuilding from scratch reproduces the committed checksum
    r = subprocess.run(pbe_cmd("zoo", "build", "digits/badnets", "--force", "--runs", "rebuild"),
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "reproduce the committed" in r.stdout, r.stdout + r.stderr
    # nothing is redone without --force
    r = subprocess.run(pbe_cmd("zoo", "build", "digits/clean"), capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "skipped" in r.stdout


def test_zoo_bad_input_is_named(tiny_zoo, cli_here):
    with pytest.raises(PBEError, match="did you mean digits/badnets"):
        zoo.get("digits/badnet")
    rc, err = cli_here("zoo", "build", "digits/nope")
    assert rc == 2 and "available: digits/badnets, digits/clean" in err and "Traceback" not in err
    assert cli_here("zoo", "build", "digits/badnets")[0] == 0  # (its training runs in a subprocess)
    weights = tiny_zoo / "digits/badnets/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(PBEError, match="does not match its committed sha256"):
        zoo.load("digits/badnets")
    (tiny_zoo / "zoo.yaml").write_text(ZOO_YAML + "  - {name: digits/clean, set: dev, attack: none}\n")
    with pytest.raises(PBEError, match="listed twice"):
        zoo.entries()
    (tiny_zoo / "zoo.yaml").write_text(ZOO_YAML.replace("set: generalisation", "set: test"))
    with pytest.raises(PBEError, match="has set 'test'"):
        zoo.entries()


def test_committed_zoo_config_is_valid(monkeypatch):
    from pbe.cli import parser
    monkeypatch.delenv("PBE_ZOO", raising=False)
    found = zoo.entries()
    dev = [e for e in found.values() if e.set == "dev" and e.dataset == "cifar10"]
    assert {e.attack for e in dev} >= {"none", "badnets", "blend", "sig", "wanet", "input_aware"}
    assert any(e.all_to_all for e in dev)
    for e in found.values():  # every committed entry's command parses
        args = parser().parse_args(e.command(zoo.REPO / "runs" / "x", None)[1:])
        assert args.seed == e.seed and args.dataset == e.dataset


def test_a_backdoor_the_model_did_not_learn_is_not_installed(tmp_path, monkeypatch):
    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo" / "zoo.yaml").write_text(
        "defaults: {dataset: digits, recipe: tiny, epochs: 1, rate: 0.001, target: 0, all_to_all: false, seed: 0}\n"
        "models:\n  - {name: digits/weak, set: dev, attack: badnets, params: {size: 2}}\n")
    monkeypatch.setenv("PBE_ZOO", str(tmp_path / "zoo"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PBEError, match="not learnt"):
        zoo.build("digits/weak")
    assert not zoo.is_built("digits/weak") and (tmp_path / "runs/zoo/digits/weak/metrics.json").exists()
