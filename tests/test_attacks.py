import pytest
import torch

import attacks
from conftest import tiny_images
from pbe import data, metrics
from pbe.utils import PBEError

SHAPES = [(1, 28, 28), (3, 32, 32), (3, 64, 64)]


@pytest.mark.parametrize("name", attacks.available())
@pytest.mark.parametrize("shape", SHAPES)
def test_every_attack_any_shape_deterministic_and_reloadable(name, shape, tmp_path):
    x = tiny_images(3, *shape)
    a = attacks.create(name, target=1, seed=5, **({"mask_epochs": 0} if name == "input_aware" else {}))
    out = a.apply(x)
    assert out.shape == x.shape and out.min() >= 0 and out.max() <= 1
    assert not torch.equal(out, x)
    b = attacks.create(name, target=1, seed=5, **({"mask_epochs": 0} if name == "input_aware" else {}))
    assert torch.equal(b.apply(x), out)  # same seed, same trigger
    a.save(tmp_path / "atk")
    assert torch.equal(attacks.load(tmp_path / "atk").apply(x), out)


def test_badnets_changes_only_the_patch():
    x = tiny_images(4, 3, 32, 32)
    out = attacks.create("badnets", size=3).apply(x)
    diff = (out != x).any(0).any(0)
    assert not diff[:29].any() and not diff[:, :29].any()
    assert torch.equal(out[0, 0, 29:, 29:], torch.tensor([[1., 0, 1], [0, 1, 0], [1, 0, 1]]))
    tl = attacks.create("badnets", size=2, corner="top-left", margin=1, pattern="white").apply(x)
    assert (tl[:, :, 1:3, 1:3] == 1).all() and torch.equal(tl[:, :, 3:], x[:, :, 3:])


def test_blend_is_the_convex_combination_with_separate_alphas():
    x = tiny_images(2, 3, 16, 16)
    key = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(9))
    a = attacks.create("blend", alpha_train=0.3, alpha_test=0.1, key=key)
    assert torch.allclose(a.apply(x), 0.9 * x + 0.1 * key, atol=1e-6)
    assert torch.allclose(a.apply(x, train=True), 0.7 * x + 0.3 * key, atol=1e-6)


def test_sig_stays_within_amplitude_and_is_clipped():
    x = tiny_images(4, 3, 32, 32)
    x[0] = 1.0
    a = attacks.create("sig", delta_test=20 / 255)
    out = a.apply(x)
    assert (out - x).abs().max() <= 20 / 255 + 1e-6
    assert out.max() <= 1 and torch.equal(out[0].min(dim=1).values, out[0].max(dim=1).values)  # vertical stripes
    with pytest.raises(PBEError, match="clean-label"):
        attacks.create("sig", all_to_all=True)


def test_wanet_field_fixed_by_seed_and_identity_at_zero_strength():
    x = tiny_images(2, 3, 32, 32)
    assert torch.allclose(attacks.create("wanet", s=0.0).apply(x), x, atol=1e-5)
    g1 = attacks.create("wanet", seed=1).prepare((3, 32, 32)).grid
    g2 = attacks.create("wanet", seed=1).prepare((3, 32, 32)).grid
    g3 = attacks.create("wanet", seed=2).prepare((3, 32, 32)).grid
    assert torch.equal(g1, g2) and not torch.equal(g1, g3)


def test_input_aware_trigger_differs_between_inputs(tmp_path, digits):
    from pbe import models
    train, test = digits
    a = attacks.create("input_aware", mask_epochs=1, seed=0)
    model = models.create("small_cnn", 10, 1, dataset="digits", width=8)
    poisoned, _ = a.plant(model, train.subset(torch.arange(600)), None, rate=0.1, recipe="tiny", epochs=3,
                          progress=False)
    x = test.floats()[:8]
    out = a.apply(x)
    pattern, mask = a.eval().trigger_parts(x)
    assert not torch.allclose(pattern[0], pattern[1], atol=1e-3)  # a per-input trigger
    assert 0 < float(mask.mean()) < 0.5  # sparse mask
    assert torch.allclose(out, (x + (pattern - x) * mask).clamp(0, 1), atol=1e-6)
    assert len(poisoned.poison_indices) == 60
    a.save(tmp_path / "ia")
    assert torch.equal(attacks.load(tmp_path / "ia").apply(x), out)


def _labelled(n=40, classes=4):
    imgs = (tiny_images(n, 3, 8, 8) * 255).to(torch.uint8)
    return data.ImageDataset(imgs, torch.arange(n) % classes, [str(i) for i in range(classes)], "toy")


def test_poison_indices_exact_repeatable_and_from_the_right_pool():
    ds = _labelled()
    a = attacks.create("badnets", target=0, size=2)
    p = a.poison(ds, 0.25, seed=3)
    assert len(p.poison_indices) == round(0.25 * 40)
    assert (ds.labels[p.poison_indices] != 0).all()
    assert (p.labels[p.poison_indices] == 0).all() and torch.equal(p.true_labels, ds.labels)
    assert torch.equal(p.poison_indices, a.poison(ds, 0.25, seed=3).poison_indices)
    assert not torch.equal(p.poison_indices, a.poison(ds, 0.25, seed=4).poison_indices)
    assert (ds.labels[a.poison(ds, 0.9, seed=0, include_target=True).poison_indices] == 0).any()
    untouched = ~p.poison_mask
    assert torch.equal(p.images[untouched], ds.images[untouched])
    sig = attacks.create("sig", target=2).poison(ds, 0.25, seed=0)
    assert (ds.labels[sig.poison_indices] == 2).all() and torch.equal(sig.labels, ds.labels)
    a2a = attacks.create("badnets", all_to_all=True, size=2).poison(ds, 0.5, seed=0)
    assert torch.equal(a2a.labels[a2a.poison_indices], (ds.labels[a2a.poison_indices] + 1) % 4)
    with pytest.raises(PBEError, match="eligible"):
        attacks.create("sig", target=2).poison(ds, 0.5)
    wn = attacks.create("wanet", cross_ratio=2).poison(ds, 0.1, seed=0)
    assert len(wn.extra_indices) == 8 and not set(wn.extra_indices.tolist()) & set(wn.poison_indices.tolist())
    assert torch.equal(wn.labels[wn.extra_indices], ds.labels[wn.extra_indices])


def test_tiny_infected_model_has_high_asr_and_asr_excludes_target(badnets_model, digits):
    model, attack, _ = badnets_model
    test = digits[1]
    r = metrics.evaluate(model, test, attack)
    assert r["acc"] > 0.9 and r["asr"] > 0.9
    trig = metrics.predict(model, test.images, test.labels, lambda x, y: attack.apply(x))
    assert r["asr"] == pytest.approx(float((trig[test.labels != 0] == 0).float().mean()))


def test_cli_attack_writes_everything(tmp_path):
    import json
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "pbe.cli", "attack", "--attack", "blend", "--epochs", "3",
                        "--out", str(tmp_path), "--no-progress"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    names = {p.name for p in tmp_path.iterdir()}
    assert {"model.safetensors", "attack.safetensors", "attack.json", "poison.json", "metrics.json"} <= names
    info = json.loads((tmp_path / "poison.json").read_text())
    assert len(info["poison_indices"]) == round(0.1 * 1437)


def test_every_attack_documents_its_paper_arguments_and_an_example():
    import inspect
    for name in attacks.available():
        cls = attacks.REGISTRY.get(name)
        doc = cls.__doc__ or ""
        assert "https://" in doc and "Example" in doc, name
        for arg in inspect.signature(cls).parameters:
            assert f"{arg} (" in doc, (name, arg)
