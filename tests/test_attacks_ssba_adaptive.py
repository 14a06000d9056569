"""Adap-Blend, Adap-Patch (partial training triggers, cover samples) and SSBA (steganography residual)."""
import pytest
import torch

import attacks
from conftest import one_thread
from pbe import data
from pbe.utils import PBEError


def _toy(n=400, classes=4, shape=(3, 16, 16)):
    imgs = torch.randint(0, 256, (n, *shape), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    return data.ImageDataset(imgs, torch.arange(n) % classes, [str(i) for i in range(classes)], "toy")


def _pieces_present(attack, before, after):
    """For each changed image, which trigger pieces changed some pixel (N, K)."""
    changed = (after.float() - before.float()).abs().amax(1) > 0  # (N, H, W)
    return torch.einsum("nhw,khw->nk", changed.float(), attack.pieces.cpu()) > 0


@pytest.mark.parametrize("name,full,kept", [("adap_blend", 16, 8), ("adap_patch", 4, 1)])
def test_adaptive_poison_partial_triggers_and_cover_samples(name, full, kept):
    ds = _toy()
    a = attacks.create(name, target=0, seed=3, cover_rate=0.05)
    p = a.poison(ds, 0.05, seed=1)
    n = len(ds)
    assert len(p.poison_indices) == round(0.05 * n) and len(p.extra_indices) == round(0.05 * n)
    assert not set(p.poison_indices.tolist()) & set(p.extra_indices.tolist())
    assert (p.labels[p.poison_indices] == 0).all()
    assert torch.equal(p.labels[p.extra_indices], ds.labels[p.extra_indices])  # cover samples keep labels
    assert (ds.labels[p.extra_indices] != 0).all()  # drawn outside the target class
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[p.poison_indices] = False
    untouched[p.extra_indices] = False
    assert torch.equal(p.images[untouched], ds.images[untouched])
    for idx in (p.poison_indices, p.extra_indices):
        present = _pieces_present(a, ds.images[idx], p.images[idx]).sum(1)
        assert (present <= kept).all() and (present >= 1).all() and kept < full  # partial triggers only
    combos = {tuple(r) for r in _pieces_present(a, ds.images[p.poison_indices], p.images[p.poison_indices]).tolist()}
    assert len(combos) > 1  # drawn per sample
    full_trig = (a.apply(ds.images[p.poison_indices].float() / 255) * 255).round()
    assert (_pieces_present(a, ds.images[p.poison_indices], full_trig).sum(1) == full).all()
    assert ((full_trig - p.images[p.poison_indices].float()).abs().amax((1, 2, 3)) > 2).all()
    again = a.poison(ds, 0.05, seed=1)
    assert torch.equal(again.images, p.images) and torch.equal(again.extra_indices, p.extra_indices)
    assert not torch.equal(a.poison(ds, 0.05, seed=2).images, p.images)


def test_adaptive_opacities_and_arguments():
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    b = attacks.create("adap_blend", alpha_test=0.2)
    assert torch.allclose(b.apply(x), 0.8 * x + 0.2 * b.pattern, atol=1e-6)  # the full test trigger is a Blend
    patch = attacks.create("adap_patch", size=3).prepare((3, 16, 16))
    out = patch.apply(x)
    mask = patch.pieces.sum(0).bool()
    assert torch.equal(out[:, :, mask], patch.pattern[:, mask].expand(2, -1, -1))  # opaque patches at test
    assert torch.equal(out[:, :, ~mask], x[:, :, ~mask])
    assert patch.alpha_train == [0.5, 0.2, 0.5, 0.3]
    with pytest.raises(PBEError, match="square"):
        attacks.create("adap_blend", pieces=10)
    with pytest.raises(PBEError, match="per patch"):
        attacks.create("adap_patch", alpha_train=[0.5, 0.5])
    with pytest.raises(PBEError, match="overlap"):
        attacks.create("adap_patch", size=10).prepare((3, 16, 16))
    with pytest.raises(PBEError, match="cover"):
        attacks.create("adap_blend", cover_rate=0.9).poison(_toy(), 0.1)


def test_ssba_residual_sample_specific_bounded_and_decodable(digits, tmp_path):
    train, test = digits
    a = attacks.create("ssba", bits=8, eps=0.3, encoder_epochs=10, l2_weight=0.1, seed=0)
    x = test.floats()
    res = a.apply(x) - x
    assert res.abs().max() <= 0.3 + 1e-6
    with one_thread():
        history = a.fit_encoder(train, seed=0)
    out = a.apply(x)
    res = out - x
    assert res.abs().max() <= 0.3 + 1e-6 and not torch.allclose(res[0], res[1], atol=1e-3)  # sample-specific
    assert history[-1]["bit_acc"] > 0.8 and a.bit_accuracy(x) > 0.8  # chance: 0.5
    a.save(tmp_path / "ssba")
    b = attacks.load(tmp_path / "ssba")
    assert torch.equal(b.apply(x), out) and torch.equal(b.secret, a.secret)
    assert b.bit_accuracy(x) == a.bit_accuracy(x)
    p = a.poison(train, 0.1, seed=0)
    assert len(p.poison_indices) == round(0.1 * len(train)) and (p.labels[p.poison_indices] == 0).all()
    with pytest.raises(PBEError, match="eps"):
        attacks.create("ssba", eps=0)
