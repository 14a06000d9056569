"""The bad-input catalogue: every case asserts its exact outcome, a clear error (a PBEError naming the
problem, or on the command line one line and exit code 2), a refusal, or a correct result.

Classes (README, "Reliability"): datasets, numbers, defence parameters, attacks and attack states,
checkpoints, run folders, command line. Kills at every write boundary and concurrent writers are in
tests/test_run_units.py.
"""
import json
import os
import pickle

import numpy as np
import pytest
import torch
from pbe import checkpoint, data, defenses, models, rundir
from pbe.utils import PBEError, seed_everything

import attacks


# ---------------------------------------------------------------- fixtures: small files of every kind
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    f = {"root": root}
    imgs = np.random.default_rng(0).integers(0, 255, (12, 8, 8, 3), dtype=np.uint8)
    labels = np.arange(12) % 3

    def npz(name, **arrays):
        path = root / name
        np.savez(path, **arrays)
        return path

    f["float_labels"] = npz("float_labels.npz", images=imgs, labels=labels.astype(np.float32) + 0.5)
    f["labels_2d"] = npz("labels_2d.npz", images=imgs, labels=labels.reshape(3, 4))
    f["empty"] = npz("empty.npz", images=imgs[:0], labels=labels[:0])
    f["no_keys"] = npz("no_keys.npz", x=imgs)
    f["float_images"] = npz("float_images.npz", images=imgs.astype(np.float32), labels=labels)
    f["bad_ndim"] = npz("bad_ndim.npz", images=imgs[:, :, :, :, None], labels=labels)
    f["length"] = npz("length.npz", images=imgs[:5], labels=labels)
    f["one_class"] = npz("one_class.npz", images=imgs, labels=np.zeros(12, dtype=np.int64))
    f["negative"] = npz("negative.npz", images=imgs, labels=labels - 1)
    f["pickled"] = npz("pickled.npz", images=imgs, labels=np.array([{"a": 1}] * 12, dtype=object))
    split = root / "split"
    split.mkdir()
    np.savez(split / "d_train.npz", images=imgs, labels=labels)
    np.savez(split / "d_test.npz", images=imgs, labels=labels + 1)  # label 3: beyond the training classes
    f["split"] = split
    three = root / "three"
    three.mkdir()
    for part in ("train", "test"):
        np.savez(three / f"d_{part}.npz", images=imgs[..., :1], labels=labels)
    f["three"] = three
    two = root / "two"
    two.mkdir()
    for n in ("a_train.npz", "b_train.npz"):
        np.savez(two / n, images=imgs, labels=labels)
    f["two"] = two
    f["fifo"] = root / "fifo.npz"
    os.mkfifo(f["fifo"])

    def folder(name, layout):
        base = root / name
        for rel, payload in layout.items():
            path = base / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if payload is None:
                path.mkdir(exist_ok=True)
            else:
                path.write_bytes(payload)
        return base

    from io import BytesIO

    from PIL import Image
    buf = BytesIO()
    Image.fromarray(imgs[0]).save(buf, format="PNG")
    png = buf.getvalue()
    good = {f"{s}/{c}/{i}.png": png for s in ("train", "test") for c in ("cat", "dog") for i in range(2)}
    f["no_splits"] = folder("no_splits", {"cat/0.png": png, "dog/0.png": png})
    f["test_fewer"] = folder("test_fewer", {k: v for k, v in good.items() if not k.startswith("test/dog")})
    f["test_extra"] = folder("test_extra", {**good, "test/emu/0.png": png})
    f["empty_class"] = folder("empty_class", {**good, "train/emu": None, "test/emu": None})
    f["single"] = folder("single", {k: v for k, v in good.items() if "/cat/" in k})
    f["corrupt_png"] = folder("corrupt_png", {**good, "train/cat/9.png": b"not an image"})
    f["corrupt_jpg"] = folder("corrupt_jpg", {**{k.replace(".png", ".jpg"): _jpeg(imgs[0]) for k in good},
                                              "train/dog/9.jpg": b"\xff\xd8 broken"})
    f["hidden"] = folder("hidden", {**good, "train/.ipynb_checkpoints/x.png": png,
                                    "test/.ipynb_checkpoints/x.png": png})

    model = models.create("small_cnn", 10, 1, dataset="digits", width=4, seed=0)
    f["model"] = root / "model"
    checkpoint.save(model, f["model"] / "model", {"dataset": "digits"})
    attack = attacks.create("badnets", size=2).prepare((1, 8, 8))
    f["attack"] = root / "attack_run"
    attack.save(f["attack"] / "attack")
    return f


def _jpeg(arr):
    from io import BytesIO

    from PIL import Image
    buf = BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG")
    return buf.getvalue()


def copy_model(files, tmp_path, name="m"):
    import shutil
    dst = tmp_path / name
    shutil.copytree(files["model"], dst)
    return dst


# ---------------------------------------------------------------- datasets
NPZ_CASES = [
    ("float_labels", "integer array"), ("labels_2d", "1-D integer"), ("empty", "holds no images"),
    ("no_keys", "needs the keys"), ("float_images", "uint8"), ("bad_ndim", r"\(N, H, W, C\)"),
    ("length", "N = 12 labels"), ("one_class", "at least 2"), ("negative", "labels span"),
    ("pickled", "plain arrays"), ("fifo", "not a regular file"), ("two", "exactly one"),
]


@pytest.mark.parametrize("name,match", NPZ_CASES, ids=[c[0] for c in NPZ_CASES])
def test_bad_npz_is_a_clear_error(files, name, match):
    with pytest.raises(PBEError, match=match):
        data.load(f"npz:{files[name]}", split="train")


def test_npz_test_labels_beyond_the_training_classes(files):
    assert data.load(f"npz:{files['split']}", split="train").num_classes == 3
    with pytest.raises(PBEError, match="labels span"):
        data.load(f"npz:{files['split']}", split="test")


def test_missing_npz(files):
    with pytest.raises(PBEError, match="does not exist"):
        data.load(f"npz:{files['root'] / 'nothing.npz'}")


FOLDER_CASES = [
    ("no_splits", "train/<class>/ and test/<class>/"), ("test_fewer", "would shift"), ("test_extra", "would shift"),
    ("empty_class", "holds no images"), ("single", "at least 2"), ("corrupt_png", r"9\.png cannot be decoded"),
    ("corrupt_jpg", r"9\.jpg cannot be decoded"),
]


@pytest.mark.parametrize("name,match", FOLDER_CASES, ids=[c[0] for c in FOLDER_CASES])
def test_bad_image_folder_is_a_clear_error(files, name, match):
    split = "test" if name.startswith("test_") else "train"
    with pytest.raises(PBEError, match=match):
        data.load(f"imagefolder:{files[name]}", split=split)


def test_hidden_folders_are_not_classes(files):
    ds = data.load(f"imagefolder:{files['hidden']}", split="test")
    assert ds.classes == ["cat", "dog"] and len(ds) == 4


@pytest.mark.parametrize("name,kwargs,match", [
    ("nonexistent", {}, "unknown dataset"),
    ("cifar10", {}, "needs a root folder"),
    ("digits", {"split": "val"}, "split must be"),
], ids=["unknown", "no-root", "bad-split"])
def test_bad_dataset_names(name, kwargs, match):
    with pytest.raises(PBEError, match=match):
        data.load(name, **kwargs)


@pytest.mark.parametrize("images,labels,classes,match", [
    (torch.rand(4, 1, 8, 8), torch.zeros(4, dtype=torch.int64), ["a", "b"], "uint8"),
    (torch.zeros(4, 8, 8, 3, dtype=torch.uint8), torch.zeros(4, dtype=torch.int64), ["a", "b"], "channels-first"),
    (torch.zeros(4, 1, 8, 8, dtype=torch.uint8), torch.zeros(4, dtype=torch.int32), ["a", "b"], "int64"),
    (torch.zeros(4, 1, 8, 8, dtype=torch.uint8), torch.full((4,), 2), ["a", "b"], "labels span"),
    (torch.zeros(4, 1, 8, 8, dtype=torch.uint8), torch.zeros(4, dtype=torch.int64), ["a"], "at least 2"),
], ids=["float-images", "channels-last", "int32-labels", "label-range", "one-class"])
def test_bad_in_memory_dataset(images, labels, classes, match):
    with pytest.raises(PBEError, match=match):
        data.ImageDataset(images, labels, classes)


# ---------------------------------------------------------------- numbers
RECIPE_CASES = [
    ({"epochs": 0}, "epochs"), ({"epochs": -1}, "epochs"), ({"epochs": 1.5}, "epochs"),
    ({"batch_size": 0}, "batch_size"),
    ({"width": 0}, "width"), ({"width": 10 ** 9}, "width"), ({"lr": 0.0}, "lr"), ({"lr": -0.1}, "lr"),
    ({"lr": float("inf")}, "lr"), ({"lr": float("nan")}, "lr"), ({"momentum": 1.0}, "momentum"),
    ({"warmup": 1.0}, "warmup"), ({"label_smoothing": -0.1}, "label_smoothing"), ({"schedule": "step"}, "schedule"),
    ({"colour": "red"}, "unknown recipe field"),
]


@pytest.mark.parametrize("override,match", RECIPE_CASES, ids=[str(c[0]) for c in RECIPE_CASES])
def test_degenerate_recipe_is_refused(override, match):
    from pbe.train import get_recipe
    with pytest.raises(PBEError, match=match):
        get_recipe("tiny", **override)


def test_unknown_recipe():
    from pbe.train import get_recipe
    with pytest.raises(PBEError, match="available"):
        get_recipe("fastest")


@pytest.mark.parametrize("args,kwargs,match", [
    (("small_cnn", 1, 1), {}, "2 to"), (("small_cnn", 10, 2), {}, "channels"),
    (("small_cnn", 10, 1), {"width": 0}, "width"), (("small_cnn", 10, 1), {"width": 10 ** 6}, "width"),
    (("small_cnn", 10, 1), {"seed": -1}, "seed"), (("small_cnn", 10, 1), {"seed": 2 ** 64}, "seed"),
    (("resnet9000", 10, 1), {}, "unknown"),
], ids=["one-class", "two-channels", "width-0", "width-huge", "seed-negative", "seed-65-bits", "unknown-model"])
def test_bad_model_arguments(args, kwargs, match):
    with pytest.raises(PBEError, match=match):
        models.create(*args, **kwargs)


@pytest.mark.parametrize("seed", [-1, 2 ** 64, 1.5, True], ids=["negative", "65-bits", "float", "bool"])
def test_bad_seed(seed):
    with pytest.raises(PBEError, match="seed"):
        seed_everything(seed)


@pytest.mark.parametrize("kwargs", [{"eps": -0.1}, {"eps": 2.0}, {"eps": float("nan")}, {"steps": -1}, {"steps": 1.5},
                                    {"norm": "l3"}, {"step": 5.0}, {"backend": "cleverhans"}],
                         ids=["eps-negative", "eps-2", "eps-nan", "steps-negative", "steps-float", "norm", "step",
                              "backend"])
def test_bad_pgd_budget(kwargs):
    from pbe.adversarial import PGDConfig
    with pytest.raises(PBEError):
        PGDConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"kind": "l1"}, "kind"), ({"eps": 0.0}, "eps > 0"), ({"epochs": 0}, "epochs"),
    ({"kind": "mask", "eps": 2.0}, "mask"),
], ids=["kind", "eps-0", "epochs-0", "mask-over-1"])
def test_bad_universal_budget(kwargs, match):
    from pbe.adversarial import UniversalConfig
    with pytest.raises(PBEError, match=match):
        UniversalConfig(**kwargs)


def test_probe_smaller_than_the_classes():
    from pbe.activations import probe_indices
    with pytest.raises(PBEError, match="number of classes"):
        probe_indices(torch.arange(20) % 10, 5)


@pytest.mark.parametrize("threshold", [0.0, 1.5, -1.0])
def test_bad_kappa_threshold(digits, threshold):
    from pbe.activations import detect
    model = models.create("small_cnn", 10, 1, dataset="digits", width=4, seed=0)
    with pytest.raises(PBEError, match="threshold"):
        detect(model, digits[1], threshold=threshold)


@pytest.mark.parametrize("k", [0, -1])
def test_bad_top_k(k):
    from pbe.activations import top_k_neurons
    with pytest.raises(PBEError, match="k >= 1"):
        top_k_neurons(torch.rand(4, 8), k)


@pytest.mark.parametrize("kwargs,match", [
    ({"images": 5}, "images"), ({"alpha": 0.0}, "alpha"), ({"alpha": 1.0}, "alpha"), ({"l2_rms": 0.0}, "l2_rms"),
    ({"epochs": 0}, "epochs"), ({"warp_shift": 1.0}, "warp_shift"), ({"pgd_eps": 2.0}, "pgd_eps"),
    ({"held_out": 5}, "held_out"), ({"label_budget": 1}, "label_budget"), ({"label_budget": 2.5}, "label_budget"),
    ({"batch_size": 0}, "batch_size"),
], ids=["images", "alpha-0", "alpha-1", "l2-0", "epochs-0", "warp", "pgd-eps", "held-out", "budget-1", "budget-float",
        "batch-0"])
def test_bad_detection_settings(digits, kwargs, match):
    from pbe.detection import detect
    model = models.create("small_cnn", 10, 1, dataset="digits", width=4, seed=0)
    with pytest.raises(PBEError, match=match):
        detect(model, digits[1], **kwargs)


# ---------------------------------------------------------------- defence parameters
DEFENCE_CASES = [
    ("ft", {"epochs": 0}, "epochs"), ("ft", {"lr": -1.0}, "lr"), ("ft", {"lr": float("inf")}, "lr"),
    ("ft", {"batch_size": 0}, "batch_size"), ("ft", {"momentum": 1.5}, "momentum"),
    ("ft", {"weight_decay": -1.0}, "weight_decay"), ("ft", {"epochs": "ten"}, "must be"),
    ("ft", {"epoch": 3}, "did you mean|unknown parameter"), ("nad", {"epochs": 0}, "epochs"),
    ("nad", {"teacher_epochs": -1}, "teacher_epochs"), ("ibau", {"rounds": -2}, "rounds"), ("ibau", {"k": 0}, "k must"),
    ("ac", {"nb_dims": 0}, "nb_dims"), ("strip", {"n": 0}, "n must"), ("strip", {"frr": 0.7}, "frr"),
    ("ss", {"percentile": 100.0}, "percentile"), ("fp", {"once_prune_ratio": 0.0}, "once_prune_ratio"),
    ("anp", {"iterations": 0}, "iterations"), ("aft", {"epochs": 0}, "epochs"), ("pbe", {"lr": 0.0}, "lr"),
    ("pbe", {"schedule": "slowest"}, "schedule"), ("ss", {"retrain_epochs": 0}, "retrain_epochs"),
]


@pytest.mark.parametrize("name,params,match", DEFENCE_CASES,
                         ids=[f"{n}-{'-'.join(p)}" for n, p, _ in DEFENCE_CASES])
def test_bad_defence_parameter(name, params, match):
    with pytest.raises(PBEError, match=match):
        defenses.create(name, **params)


def test_unknown_defence():
    with pytest.raises(PBEError, match="did you mean"):
        defenses.create("strp")


def test_pbe_target_beyond_the_classes(blend_model):
    model, _, poisoned = blend_model
    with pytest.raises(PBEError, match="not a label"):
        defenses.create("pbe", target=99)(model, poisoned, progress=False)


# ---------------------------------------------------------------- attacks and attack states
@pytest.mark.parametrize("name,kwargs,match", [
    ("badnet", {}, "did you mean"), ("badnets", {"target": -1}, "target"), ("sig", {"mode": "both"}, "mode"),
    ("sig", {"all_to_all": True}, "clean-label"),
], ids=["typo", "negative-target", "sig-mode", "sig-a2a"])
def test_bad_attack_arguments(name, kwargs, match):
    with pytest.raises(PBEError, match=match):
        attacks.create(name, **kwargs)


@pytest.mark.parametrize("rate,target,match", [(1.5, 0, "rate"), (-0.1, 0, "rate"), (0.1, 10, "not a label")],
                         ids=["rate-over-1", "rate-negative", "target-beyond"])
def test_bad_poisoning(digits, rate, target, match):
    with pytest.raises(PBEError, match=match):
        attacks.create("badnets", target=target).poison(digits[0], rate, 0)


def _attack_dir(files, tmp_path, change):
    import shutil
    dst = tmp_path / "a"
    shutil.copytree(files["attack"], dst)
    change(dst)
    return dst


ATTACK_STATE_CASES = [
    ("no-json", lambda d: (d / "attack.json").unlink(), "attack.json not found"),
    ("no-weights", lambda d: (d / "attack.safetensors").unlink(), "attack.safetensors not found"),
    ("json-garbage", lambda d: (d / "attack.json").write_text("{"), "not valid JSON"),
    ("unknown-attack", lambda d: (d / "attack.json").write_text(json.dumps({"attack": "x", "params": {}})),
     "unknown attack"),
    ("weights-garbage", lambda d: (d / "attack.safetensors").write_bytes(b"junk"), "not a readable safetensors"),
]


@pytest.mark.parametrize("name,change,match", ATTACK_STATE_CASES, ids=[c[0] for c in ATTACK_STATE_CASES])
def test_bad_attack_state(files, tmp_path, name, change, match):
    with pytest.raises(PBEError, match=match) as err:
        attacks.load(_attack_dir(files, tmp_path, change))
    assert "None: None" not in str(err.value)


def test_a_saved_trigger_is_not_rebuilt_for_another_image_size(files):
    attack = attacks.load(files["attack"])
    with pytest.raises(PBEError, match="saved for images of shape"):
        attack.apply(torch.rand(2, 3, 32, 32))


# ---------------------------------------------------------------- checkpoints
def _sidecar(d):
    return json.loads((d / "model.json").read_text())


CHECKPOINT_CASES = [
    ("no-sidecar", lambda d: (d / "model.json").unlink(), "sidecar"),
    ("sidecar-garbage", lambda d: (d / "model.json").write_text("{"), "not valid JSON"),
    ("no-weights", lambda d: (d / "model.safetensors").unlink(), "safetensors files|not found"),
    ("weights-garbage", lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), "not a readable"),
    ("other-width", lambda d: (d / "model.json").write_text(json.dumps(
        {**_sidecar(d), "architecture": {**_sidecar(d)["architecture"], "width": 8}})), "do not fit"),
    ("huge-width", lambda d: (d / "model.json").write_text(json.dumps(
        {**_sidecar(d), "architecture": {**_sidecar(d)["architecture"], "width": 10 ** 6}})), "width"),
    ("no-architecture", lambda d: (d / "model.json").write_text(json.dumps({"format": "pbe-checkpoint-1"})),
     "names no architecture"),
    ("architecture-not-dict", lambda d: (d / "model.json").write_text(json.dumps({"architecture": [1]})),
     "must be a dict"),
    ("two-weights", lambda d: [(d / "model.safetensors").rename(d / "a.safetensors"),
                               (d / "b.safetensors").write_bytes((d / "a.safetensors").read_bytes())], "name the one"),
]


@pytest.mark.parametrize("name,change,match", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_bad_checkpoint(files, tmp_path, name, change, match):
    d = copy_model(files, tmp_path)
    change(d)
    with pytest.raises(PBEError, match=match):
        checkpoint.load(d)


def test_non_finite_weights_are_refused(files, tmp_path):
    from safetensors.torch import load_file, save_file
    d = copy_model(files, tmp_path)
    state = load_file(str(d / "model.safetensors"))
    key = next(k for k, v in state.items() if v.is_floating_point())
    state[key][0] = float("nan")
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(PBEError, match="not finite"):
        checkpoint.load(d)


def test_legacy_pt_needs_an_architecture_and_never_unpickles(files, tmp_path):
    model, _ = checkpoint.load(files["model"])
    pt = tmp_path / "legacy.pt"
    torch.save(model.state_dict(), pt)
    with pytest.raises(PBEError, match="--arch"):
        checkpoint.load(pt)
    loaded, _ = checkpoint.load(pt, architecture=model.pbe_spec)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))
    bad = tmp_path / "evil.pt"
    bad.write_bytes(pickle.dumps({"w": Payload()}))
    with pytest.raises(PBEError, match="weights-only"):
        checkpoint.load(bad, architecture=model.pbe_spec)
    assert not (tmp_path / "pwned").exists()


def test_fifo_sidecar_is_refused_not_waited_for(files, tmp_path):
    d = copy_model(files, tmp_path)
    (d / "model.json").unlink()
    os.mkfifo(d / "model.json")
    with pytest.raises(PBEError, match="not a regular file"):
        checkpoint.load(d)


# ---------------------------------------------------------------- run folders
def _unit(tmp_path):
    out = tmp_path / "unit"
    out.mkdir()
    (out / "a.json").write_text("{}")
    (out / "b.bin").write_bytes(b"123")
    rundir.write_manifest(out, {"seed": 0})
    return out


RUN_CASES = [
    ("changed-file", lambda d: (d / "b.bin").write_bytes(b"124"), "mixes two runs"),
    ("missing-file", lambda d: (d / "b.bin").unlink(), "is missing"),
    ("manifest-garbage", lambda d: (d / "manifest.json").write_text("{"), "not valid JSON"),
    ("manifest-foreign", lambda d: (d / "manifest.json").write_text("[1, 2]"), "not a pbe run manifest"),
]


@pytest.mark.parametrize("name,change,match", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_a_damaged_run_folder_is_refused(tmp_path, name, change, match):
    out = _unit(tmp_path)
    assert rundir.verify(out)["run"] == {"seed": 0}
    change(out)
    with pytest.raises(PBEError, match=match):
        rundir.verify(out)


@pytest.mark.parametrize("staging_complete", [True, False], ids=["new-unit", "old-unit"])
def test_recover_finishes_or_undoes_a_cut_swap(tmp_path, staging_complete):
    out = _unit(tmp_path)
    stage = rundir.staging(out)
    stage.mkdir()
    (stage / "a.json").write_text('{"new": 1}')
    if staging_complete:
        rundir.write_manifest(stage, {"seed": 1})
    os.rename(out, out.parent / f".{out.name}.old")  # killed between the two renames
    rundir.recover(out)
    assert rundir.verify(out)["run"] == {"seed": 1 if staging_complete else 0}
    assert not (out.parent / f".{out.name}.old").exists()


def test_a_second_writer_is_refused(tmp_path):
    with rundir.locked(tmp_path / "x"):
        with pytest.raises(PBEError, match="another pbe command"):
            with rundir.locked(tmp_path / "x"):
                pass


def test_out_that_is_a_file_is_refused(tmp_path):
    from pbe.utils import check_writable
    (tmp_path / "f").write_text("x")
    with pytest.raises(PBEError, match="is a file"):
        check_writable(tmp_path / "f")


# ---------------------------------------------------------------- command line: one line, exit 2
CLI_CASES = [
    (["train", "--epochs", "0", "--out", "{tmp}/o"], "epochs"),
    (["train", "--width", "0", "--out", "{tmp}/o"], "width"),
    (["train", "--seed", "-1", "--out", "{tmp}/o"], "seed"),
    (["train", "--seed", "18446744073709551616", "--out", "{tmp}/o"], "seed"),
    (["train", "--recipe", "fastest", "--out", "{tmp}/o"], "invalid choice"),
    (["train", "--dataset", "npz:{tmp}/none.npz", "--out", "{tmp}/o"], "does not exist"),
    (["evaluate", "--model", "{tmp}/nothing"], "not found"),
    (["evaluate", "--model", "{model}", "--attack-state", "{tmp}/nothing"], "not found"),
    (["evaluate", "--model", "{tmp}/legacy.pt"], "--arch"),
    (["evaluate", "--model", "{tmp}/legacy.pt", "--arch", "{{bad json"], "must be JSON"),
    (["evaluate", "--model", "{model}", "--dataset", "npz:{three}"], "does not fit the model"),
    (["detect", "--model", "{model}", "--method", "kappa", "--threshold", "2"], "threshold"),
    (["detect", "--model", "{model}", "--method", "kappa", "--probe-size", "3"], "number of classes"),
    (["detect", "--model", "{model}", "--method", "kappa", "--eps", "2"], "--eps"),
    (["detect", "--model", "{model}", "--method", "kappa", "--steps", "0"], "--steps"),
    (["erase", "--model", "{model}", "--out", "{tmp}/e"], r"needs the \(poisoned\) training set"),
    (["erase", "--model", "{model}", "--train-data", "digits", "--lr", "0", "--out", "{tmp}/e"], "lr"),
    (["defend", "--defense", "ft", "--model", "{model}", "--param", "epochs=0", "--out", "{tmp}/d"], "epochs"),
    (["defend", "--defense", "ft", "--model", "{model}", "--param", "nonsense", "--out", "{tmp}/d"], "KEY=VALUE"),
    (["defend", "--defense", "ft", "--model", "{model}", "--clean-fraction", "0", "--out", "{tmp}/d"],
     "clean-fraction"),
    (["defend", "--defense", "ft", "--model", "{model}", "--out", "{tmp}/file"], "is a file"),
    (["attack", "--attack", "badnets", "--rate", "2", "--epochs", "1", "--out", "{tmp}/a"], "rate"),
    (["attack", "--attack", "badnets", "--target", "12", "--epochs", "1", "--out", "{tmp}/a"], "not a label"),
    (["attack", "--attack", "sig", "--param", "mode=both", "--out", "{tmp}/a"], "mode"),
    (["zoo", "build", "cifar10/badnetz"], "did you mean|unknown"),
]


def test_cli_reader_gone_is_quiet():
    """`pbe ... | head -1`: the closed pipe ends the command with the shell's SIGPIPE status and no error."""
    import os
    import subprocess
    import sys
    from pbe.cli import SIGPIPE_EXIT
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line
    try:
        r = subprocess.run([sys.executable, "-m", "pbe.cli", "zoo", "list"], stdout=write_end,
                           stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    assert r.returncode == SIGPIPE_EXIT and r.stderr == "", r.stderr


@pytest.mark.parametrize("argv,match", CLI_CASES, ids=[" ".join(c[0][:4]) for c in CLI_CASES])
def test_cli_user_error_is_one_line_and_exit_2(files, tmp_path, cli_here, argv, match):
    import re
    model, _ = checkpoint.load(files["model"])
    torch.save(model.state_dict(), tmp_path / "legacy.pt")
    (tmp_path / "file").write_text("x")
    argv = [a.format(tmp=tmp_path, model=files["model"], three=files["three"]) for a in argv]
    rc, err = cli_here(*argv)
    assert rc == 2, err
    assert "Traceback" not in err and re.search(match, err), err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
