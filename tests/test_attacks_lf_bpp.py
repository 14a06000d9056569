"""LF (low-frequency trigger) and BPP (colour squeezing with dithering): what each trigger must be, and that
both can be planted in a tiny digits model."""
import pytest
import torch

import attacks
from attacks.bpp import floyd_steinberg
from attacks.lf import dct_matrix
from conftest import one_thread, tiny_images
from pbe import metrics, models
from pbe.utils import PBEError


def _dct2(x):
    h, w = x.shape[-2:]
    return dct_matrix(h).float() @ x @ dct_matrix(w).float().T


@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 28, 28)])
def test_lf_trigger_is_low_frequency_and_spans_eps(shape):
    a = attacks.create("lf", seed=4, eps=0.1, window=3).prepare(shape)
    v = a.pattern
    assert float(v.min()) == pytest.approx(0, abs=1e-7) and float(v.max()) == pytest.approx(0.1, abs=1e-6)
    coefficients = _dct2(v)
    outside = coefficients.clone()
    outside[:, :3, :3] = 0
    assert outside.pow(2).sum() < 1e-9 * coefficients.pow(2).sum()  # no energy outside the 3 x 3 window
    assert coefficients[:, :3, :3].abs().amax(dim=(1, 2)).min() > 1e-3  # ... and something inside it
    x = tiny_images(4, *shape)
    out = a.apply(x)
    assert torch.allclose(out, (x + v).clamp(0, 1)) and ((out - x) <= 0.1 + 1e-6).all()
    b = attacks.create("lf", seed=5, eps=0.1, window=3).prepare(shape)
    assert not torch.allclose(a.pattern, b.pattern)  # the seed draws the trigger
    with pytest.raises(PBEError, match="window"):
        attacks.create("lf", window=9).prepare((1, 8, 8))
    with pytest.raises(PBEError, match="eps"):
        attacks.create("lf", eps=0)


def test_lf_search_stays_in_band_moves_toward_target_and_reloads(digits, tmp_path):
    from attacks.base import clean_surrogate
    train, test = digits
    a = attacks.create("lf", target=3, eps=0.2, window=4, search_epochs=5)
    seeded = a.prepare(train.image_shape).pattern.clone()
    with one_thread():
        surrogate = clean_surrogate(models.create("small_cnn", 10, 1, dataset="digits", width=8, seed=0),
                                    train, "tiny", 2, progress=False)
        x = test.floats()
        loss = [torch.nn.functional.cross_entropy(surrogate((x + a.pattern).clamp(0, 1)),
                                                  torch.full((len(x),), 3)).item()]
        a.search(surrogate, train, seed=0)
        loss.append(torch.nn.functional.cross_entropy(surrogate((x + a.pattern).clamp(0, 1)),
                                                      torch.full((len(x),), 3)).item())
    assert not torch.allclose(a.pattern, seeded) and loss[1] < loss[0] - 0.1  # nearer the target on held-out data
    outside = _dct2(a.pattern)
    outside[:, :4, :4] = 0
    assert outside.abs().max() < 1e-5
    assert float(a.pattern.min()) >= -1e-7 and float(a.pattern.max()) <= 0.2 + 1e-6
    a.save(tmp_path / "lf")
    assert torch.equal(attacks.load(tmp_path / "lf").pattern, a.pattern)  # the searched trigger, not the seeded one


def test_bpp_keeps_at_most_squeeze_num_levels_and_dithering_is_not_rounding():
    x = tiny_images(6, 3, 32, 32)
    for levels in (2, 8, 32):
        out = attacks.create("bpp", squeeze_num=levels).apply(x)
        k = out * (levels - 1)
        assert torch.allclose(k, k.round(), atol=1e-4)  # every value is a level k / (levels - 1)
        for ch in range(3):
            assert torch.unique(k[:, ch].round()).numel() <= levels
    dithered = attacks.create("bpp", squeeze_num=8).apply(x)
    rounded = attacks.create("bpp", squeeze_num=8, dithering=False).apply(x)
    assert torch.equal(rounded, torch.round(x * 7) / 7)
    assert (dithered != rounded).float().mean() > 0.05
    # dithering keeps local averages: the 4x4 means of the error are far smaller than rounding's
    pool = torch.nn.functional.avg_pool2d
    assert pool(dithered - x, 4).abs().mean() < 0.7 * pool(rounded - x, 4).abs().mean()
    flat = torch.full((1, 1, 8, 8), 0.5 / 7)  # half a level: rounding gives 0 everywhere, dithering a checkerboard
    assert floyd_steinberg(flat, 8).mean() * 7 == pytest.approx(0.5, abs=0.1)
    with pytest.raises(PBEError, match="squeeze_num"):
        attacks.create("bpp", squeeze_num=1)
    with pytest.raises(PBEError, match="dithering"):
        attacks.create("bpp", dithering="False")


def test_bpp_poisoned_set_records_negative_samples(digits):
    train = digits[0]
    a = attacks.create("bpp", target=0, squeeze_num=4, neg_ratio=0.1, seed=2)
    p = a.poison(train, 0.1, seed=2)
    neg, bad = p.extra_indices, p.poison_indices
    assert len(neg) == round(0.1 * len(train)) and not set(neg.tolist()) & set(bad.tolist())
    assert torch.equal(p.labels[neg], train.labels[neg])  # negatives keep their true labels
    changed = (p.images[neg] != train.images[neg]).flatten(1).any(1)
    assert changed.float().mean() > 0.9
    quantised = a.apply(p.images[neg].float() / 255)
    assert (quantised != p.images[neg].float() / 255).flatten(1).any(1).all()  # not the trigger itself
    untouched = torch.ones(len(train), dtype=torch.bool)
    untouched[neg], untouched[bad] = False, False
    assert torch.equal(p.images[untouched], train.images[untouched])
    assert torch.equal(a.poison(train, 0.1, seed=2).images, p.images)
    assert attacks.create("bpp", neg_ratio=0.0).poison(train, 0.1).extra_indices is None


@pytest.mark.parametrize("name, params", [("lf", {"surrogate_epochs": 2}), ("bpp", {"squeeze_num": 2})])
def test_lf_and_bpp_plant_a_working_backdoor_in_a_tiny_model(digits, name, params):
    # BPP squeezes to 2 levels here: the 8x8 digits have only 17 grey levels, mostly 0 and 16, so squeezing
    # them to 8 changes a pixel by 0.017 on average, too little for this model in a few epochs
    train, test = digits
    a = attacks.create(name, target=0, seed=0, **params)
    model = models.create("small_cnn", 10, 1, dataset="digits", width=16, seed=0)
    with one_thread():
        a.plant(model, train, None, rate=0.1, recipe="tiny", seed=0, epochs=8, progress=False)
    r = metrics.evaluate(model, test, a)
    assert r["acc"] > 0.85 and r["asr"] > 0.9, r
