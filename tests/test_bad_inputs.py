"""The bad-input catalogue: every case asserts its exact outcome, a clear error (a PBEError naming the
problem, or on the command line one line and exit code 2), a refusal, or a correct result.

Classes (README, "Reliability"): datasets, numbers, defence parameters, attacks and attack states, models
and data handed to the Python API (``pbe.checks``), checkpoints, run folders, command line. Kills at every
write boundary and concurrent writers are in tests/test_run_units.py.
"""
import copy
import json
import os
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import pbe
from pbe import checkpoint, data, defenses, metrics, models, rundir
from pbe.utils import PBEError, PBEWarning, seed_everything

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


FROM_TENSORS_CASES = [
    (torch.rand(4, 8, 8, 3), torch.zeros(4, dtype=torch.int64), "channels-last"),
    (torch.rand(4, 1, 8, 8) * 255, torch.zeros(4, dtype=torch.int64), "divide them by 255"),
    (torch.randn(4, 1, 8, 8) * 3, torch.zeros(4, dtype=torch.int64), "standardised.*Normalize"),
    (torch.full((4, 1, 8, 8), float("nan")), torch.zeros(4, dtype=torch.int64), "NaN"),
    (torch.zeros(4, 1, 8, 8, dtype=torch.int32), torch.zeros(4, dtype=torch.int64), "uint8 .* or float"),
    (torch.rand(4, 1, 8, 8), torch.zeros(4) + 0.5, "integer class ids"),
    (torch.rand(4, 1, 8, 8), torch.zeros(3, dtype=torch.int64), "4 images but 3 labels"),
    (torch.rand(4, 8), torch.zeros(4, dtype=torch.int64), r"\(N, C, H, W\)"),
]


@pytest.mark.parametrize("images,labels,match", FROM_TENSORS_CASES,
                         ids=["channels-last", "0-255-floats", "standardised", "nan", "int32", "float-labels",
                              "lengths", "2-d"])
def test_from_tensors_refuses_what_it_cannot_read(images, labels, match):
    with pytest.raises(PBEError, match=match):
        data.ImageDataset.from_tensors(images, labels, classes=10)


def test_from_tensors_takes_floats_in_0_1_uint8_and_arrays(digits):
    test = digits[1]
    again = data.ImageDataset.from_tensors(test.images.float() / 255, test.labels)
    assert torch.equal(again.images, test.images) and torch.equal(again.labels, test.labels)
    assert again.classes == test.classes and again.flip
    grey = data.ImageDataset.from_tensors(test.images[:, 0].numpy(), test.labels.numpy().astype(np.int32),
                                          classes=12, flip=False)
    assert torch.equal(grey.images, test.images) and grey.num_classes == 12 and not grey.flip


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
    from pbe.activations import kappa_detect
    model = models.create("small_cnn", 10, 1, dataset="digits", width=4, seed=0)
    with pytest.raises(PBEError, match="threshold"):
        kappa_detect(model, digits[1], threshold=threshold)


@pytest.mark.parametrize("k", [0, -1])
def test_bad_top_k(k):
    from pbe.activations import top_k_neurons
    with pytest.raises(PBEError, match="k >= 1"):
        top_k_neurons(torch.rand(4, 8), k)


@pytest.mark.parametrize("kwargs,match", [
    ({"images": 5}, "images"), ({"alpha": 0.0}, "alpha"), ({"alpha": 1.0}, "alpha"), ({"l2_rms": 0.0}, "l2_rms"),
    ({"epochs": 0}, "epochs"), ({"warp_shift": 1.0}, "warp_shift"), ({"pgd_eps": 2.0}, "pgd_eps"),
    ({"held_out": 5}, "held_out"), ({"label_budget": 1}, "label_budget"), ({"label_budget": 2.5}, "label_budget"),
    ({"batch_size": 0}, "batch_size"), ({"budget": "huge"}, "scan budget"),
], ids=["images", "alpha-0", "alpha-1", "l2-0", "epochs-0", "warp", "pgd-eps", "held-out", "budget-1", "budget-float",
        "batch-0", "preset"])
def test_bad_detection_settings(digits, kwargs, match):
    from pbe.detection import ScanBudget, detect
    budget_fields = set(ScanBudget.__dataclass_fields__)
    kwargs = {**{k: v for k, v in kwargs.items() if k not in budget_fields},
              **({"budget": ScanBudget(**{k: v for k, v in kwargs.items() if k in budget_fields})}
                 if budget_fields & set(kwargs) else {})}
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


# ---------------------------------------------------------------- models and data handed to the Python API
def _plain_three_channel_net():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))


def _tiny(num_classes=10, channels=1):
    return models.create("small_cnn", num_classes, channels, dataset="digits", width=4, seed=0)


API_CASES = {  # name: (model, data from the digits test split, what the PBEError says)
    "five-outputs": (lambda: _tiny(5), lambda t: t, "outputs 5 scores per image but .* has 10 classes"),
    "three-channel-net": (_plain_three_channel_net, lambda t: t,
                          r"does not take the images .*\(1, 8, 8\).* raised RuntimeError"),
    "three-channel-model": (lambda: _tiny(10, 3), lambda t: t, "built for 3 input channels .* have 1"),
    "softmax": (lambda: nn.Sequential(_tiny(), nn.Softmax(dim=1)), lambda t: t, "probabilities.*Logits"),
    "tensor-dataset": (_tiny, lambda t: torch.utils.data.TensorDataset(t.images.float() / 255, t.labels),
                       r"must be a pbe\.data\.ImageDataset.*from_tensors\(\*dataset\.tensors\)"),
    "tuple": (_tiny, lambda t: (t.images, t.labels), r"must be a pbe\.data\.ImageDataset.*from_tensors\(\*data\)"),
}
ENTRY_POINTS = {
    "evaluate": lambda model, d: metrics.evaluate(model, d),
    "detect": lambda model, d: pbe.detect(model, d),
    "erase": lambda model, d: pbe.erase(model, d, progress=False),
    "aft": lambda model, d: pbe.aft(model, d, epochs=1, adv_epochs=1, progress=False),
    "defence": lambda model, d: defenses.create("ft", epochs=1)(model, d, progress=False),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", API_CASES)
def test_the_python_api_refuses_a_model_or_data_that_do_not_fit(digits, case, entry):
    """The same checks before any work in pbe.detect, pbe.erase, pbe.aft, every defence and evaluate: one
    PBEError naming the problem and the fix, never a raw error from deep inside."""
    make_model, make_data, match = API_CASES[case]
    with pytest.raises(PBEError, match=match):
        ENTRY_POINTS[entry](make_model(), make_data(digits[1]))


def test_the_fixes_the_errors_name_work(digits):
    test = digits[1]
    inner = _tiny()
    wrapped = models.Logits(nn.Sequential(inner, nn.Softmax(dim=1)))
    assert torch.equal(metrics.predict(wrapped, test.images), metrics.predict(inner, test.images))
    tensors = torch.utils.data.TensorDataset(test.images.float() / 255, test.labels)
    assert metrics.evaluate(inner, data.ImageDataset.from_tensors(*tensors.tensors)) == metrics.evaluate(inner, test)


def test_a_model_that_normalises_outside_gets_the_warning(clean_model, digits):
    """A model trained on standardised images (here: the clean model without its Normalize) is near chance
    on [0, 1] images: evaluate and the defences warn, naming pbe.models.Normalize; wrapped, it is quiet."""
    test = digits[1]
    outside = copy.deepcopy(clean_model)
    outside.normalize = nn.Identity()
    with pytest.warns(PBEWarning, match=r"standardised per channel.*pbe\.models\.Normalize"):
        low = metrics.evaluate(outside, test)["acc"]
    with pytest.warns(PBEWarning, match="Normalize"):
        defenses.create("ft", epochs=1)(outside, test.subset(range(100)), progress=False)
    fixed = nn.Sequential(models.Normalize(*models.DATASET_STATS["digits"]), outside)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PBEWarning)
        right = metrics.evaluate(fixed, test)["acc"]
        assert metrics.evaluate(clean_model, test)["acc"] == right > 0.9 > 0.3 > low


def test_the_checks_draw_no_random_number_and_restore_the_modes(clean_model, digits):
    from pbe.checks import check_model_and_data
    model = copy.deepcopy(clean_model).train()
    model.block1.eval()  # mixed modes come back as they were
    modes = [m.training for m in model.modules()]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    passes = check_model_and_data(model, digits[0], where="test")
    assert torch.equal(torch.get_rng_state(), before) and [m.training for m in model.modules()] == modes
    assert 0 < passes <= 512
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), clean_model.state_dict().values()))


def test_a_defence_gives_the_same_bits_with_and_without_the_checks(clean_model, digits, monkeypatch):
    from pbe.defenses import base
    extra = digits[0].subset(range(200))

    def run():
        model = copy.deepcopy(clean_model).train()  # a model handed over in train mode: the checks run it in eval
        return defenses.create("ft", epochs=1)(model, extra, progress=False, evaluation=defenses.Evaluation(digits[1]))
    checked = run()
    monkeypatch.setattr(base, "check_model_and_data", lambda *a, **k: 0)
    monkeypatch.setattr(base, "check_evaluation", lambda *a, **k: None)
    plain = run()
    assert checked.report["after"] == plain.report["after"]
    assert all(torch.equal(a, b) for a, b in zip(checked.model.state_dict().values(),
                                                 plain.model.state_dict().values()))


@pytest.mark.parametrize("attack", ["badnets", object()], ids=["name", "no-apply"])
def test_an_attack_must_be_an_attack_object(digits, attack):
    with pytest.raises(PBEError, match="attacks.create"):
        metrics.evaluate(_tiny(), digits[1], attack=attack)
    with pytest.raises(PBEError, match="attacks.create"):
        defenses.create("ft", epochs=1)(_tiny(), digits[1], progress=False,
                                        evaluation=defenses.Evaluation(digits[1], attack))


def test_an_evaluation_test_set_must_match_the_data(digits):
    with pytest.raises(PBEError, match="evaluation.test_set must be a pbe.data.ImageDataset"):
        defenses.create("ft", epochs=1)(_tiny(), digits[1], progress=False,
                                        evaluation=defenses.Evaluation((digits[1].images, digits[1].labels)))
    other = data.ImageDataset.from_tensors(torch.rand(20, 1, 8, 8), torch.arange(20) % 5)
    with pytest.raises(PBEError, match="5 classes, the data .* 10"):
        defenses.create("ft", epochs=1)(_tiny(), digits[1], progress=False, evaluation=defenses.Evaluation(other))


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


def test_your_own_model_is_saved_and_loaded_into_a_module_you_build(tmp_path):
    def net(hidden=16):
        return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    mine = net()
    pbe.save(mine, tmp_path / "m", {"dataset": "digits"})
    with pytest.raises(PBEError, match=r"names no architecture \(the saved model is a torch\.nn.*Sequential.*"
                                       r"pbe\.load\(path, model=MyNet"):
        pbe.load(tmp_path / "m")
    fresh = net()
    loaded, meta = pbe.load(tmp_path / "m", model=fresh)
    assert loaded is fresh and meta["dataset"] == "digits" and not loaded.training
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), mine.state_dict().values()))
    with pytest.raises(PBEError, match=r"other shapes: 1\.weight \[16, 64\] in the file, \[8, 64\] in the model"):
        pbe.load(tmp_path / "m", model=net(hidden=8))
    with pytest.raises(PBEError, match=r"missing from the file: 0\.bias, 0\.weight; not in the model: 1\.bias, "
                                       r"1\.weight, 3\.bias, 3\.weight"):
        pbe.load(tmp_path / "m", model=nn.Sequential(nn.Linear(64, 16), nn.Flatten()))
    with pytest.raises(PBEError, match="not both"):
        pbe.load(tmp_path / "m", model=net(), architecture={"name": "small_cnn", "num_classes": 10})
    torch.save(mine.state_dict(), tmp_path / "legacy.pt")  # a bare state dict: read weights-only into the module
    assert torch.equal(pbe.load(tmp_path / "legacy.pt", model=net())[0][1].weight, mine[1].weight)


def test_tied_weights_are_saved(tmp_path):
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    pbe.save(tied, tmp_path / "t")
    other = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    other[1].weight = other[0].weight
    assert torch.equal(pbe.load(tmp_path / "t", model=other)[0][1].weight, tied[0].weight)


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
    # an option the command or its method would ignore is refused
    (["detect", "--model", "{model}", "--probe-size", "0"], "--probe-size is an option of --method kappa"),
    (["detect", "--model", "{model}", "--threshold", "0.5", "--eps", "0.1"], "--threshold, --eps are options of"),
    (["detect", "--model", "{model}", "--method", "kappa", "--images", "300"], "--images is an option of --method "
                                                                                 "universal"),
    (["detect", "--model", "{model}", "--split", "train", "--with-train"], "--with-train .* --split train"),
    (["evaluate", "--model", "{model}", "--seed", "3"], "unrecognized arguments: --seed"),
    (["data", "--out", "{tmp}/o"], "unrecognized arguments: --out"),
    (["erase", "--model", "{model}", "--setting", "clean-extra", "--schedule", "fast", "--out", "{tmp}/e"],
     "--schedule is PBE's"),
    (["defend", "--defense", "ss", "--model", "{model}", "--train-data", "digits", "--clean-fraction", "0.1",
      "--out", "{tmp}/d"], "--clean-fraction is for defences with a clean extra set"),
    (["defend", "--defense", "ft", "--model", "{model}", "--train-data", "digits", "--out", "{tmp}/d"],
     "--train-data is for defences without clean data"),
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


def test_cli_an_explicit_dataset_wins_over_the_recorded_one(tmp_path, cli_here):
    """Without --dataset the command takes the dataset recorded with the model (here mnist, whose files are
    not there); an explicit --dataset wins, and is checked to fit the model."""
    checkpoint.save(_tiny(), tmp_path / "m" / "model", {"dataset": "mnist"})
    rc, err = cli_here("evaluate", "--model", tmp_path / "m")
    assert rc == 2 and "'mnist' needs a root folder" in err, err
    rc, err = cli_here("evaluate", "--model", tmp_path / "m", "--dataset", "digits")
    assert rc == 0, err


def test_cli_prints_a_warning_on_one_line(files, cli_here):
    """An untrained model is near chance: `pbe evaluate` says so in one line, and still answers."""
    rc, err = cli_here("evaluate", "--model", files["model"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 0 and len(lines) == 1 and lines[0].startswith("pbe evaluate: warning: metrics.evaluate: the model is "
                                                                 "right on"), err


def test_scripts_start_the_toolkit_with_their_own_interpreter(monkeypatch, tmp_path):
    """`path/to/venv/bin/python experiments/reproduce.py` without the venv activated finds no `pbe` on PATH:
    every experiment cell runs `python -m pbe.cli` with the interpreter running the script, and no script or
    test starts the `pbe` command by name."""
    import re
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "experiments"))
    import common
    started = []
    monkeypatch.setattr(common.subprocess, "run", lambda cmd, **kw: started.append(cmd))
    (tmp_path / "metrics.json").write_text("{}")
    m = common.run_cell(["pbe", "train", "--out", str(tmp_path)], tmp_path)
    assert started == [[sys.executable, "-m", "pbe.cli", "train", "--out", str(tmp_path)]]
    assert m["command"] == f"pbe train --out {tmp_path}"
    by_name = re.compile(r"""(subprocess\.\w+|Popen|check_output|run)\(\s*\[\s*["']pbe["']""")
    offenders = [str(p.relative_to(root)) for folder in ("experiments", "tests", "pbe")
                 for p in (root / folder).rglob("*.py") if by_name.search(p.read_text())]
    assert offenders == [], offenders
