"""TrojanNN and the label-consistent attack: behaviour beyond the generic checks of test_attacks.py."""
import pytest
import torch
import torch.nn as nn

import attacks
from conftest import one_thread
from pbe import data, metrics, models
from pbe.utils import PBEError


# ---------------------------------------------------------------- TrojanNN
def test_trojannn_trigger_is_optimised_inside_its_mask_to_excite_the_chosen_neurons(digits, clean_model, tmp_path):
    train, test = digits
    a = attacks.create("trojannn", size=4, corner="top-left", margin=1, seed=3)
    start = a.prepare(train.image_shape).patch.clone()
    assert not a.optimised
    with one_thread():
        a.fit_trigger(clean_model, train.images[:128])
    assert a.optimised and not torch.equal(a.patch, start)
    assert torch.equal(a.patch, (a.patch * 255).round() / 255)  # uint8 levels, in [0, 1]
    head = clean_model.linear.weight.abs().sum(0)
    assert set(a.neuron_idx.tolist()) == set(head.argsort(descending=True)[:2].tolist())

    x = test.floats()[:200]  # held-out images: the optimisation saw training images only
    out = a.apply(x)
    changed = (out != x).any(0).any(0)
    assert changed[1:5, 1:5].any() and not changed[5:].any() and not changed[:, 5:].any()
    assert not changed[0].any() and not changed[:, 0].any()
    with torch.no_grad():
        optimised = a.neuron_activation(clean_model, x).mean(0)
        initial = a.neuron_activation(clean_model, x, start).mean(0)
    assert optimised.sum() > 1.3 * initial.sum() and (optimised / initial).max() > 2  # 1.6x and 2.8x here

    a.save(tmp_path / "tnn")
    b = attacks.load(tmp_path / "tnn")
    assert torch.equal(b.patch, a.patch) and torch.equal(b.neuron_idx, a.neuron_idx) and b.optimised
    assert torch.equal(b.apply(x), out)
    with pytest.raises(PBEError, match="optimised for images of shape"):
        a.apply(torch.rand(1, 1, 16, 16))


def test_trojannn_layer_choice_is_checked_before_any_training(digits, clean_model):
    conv = attacks.create("trojannn", layer="block2.0", neurons=3)
    idx = conv.most_connected(clean_model)  # input channels of a convolution, ranked by their weights
    weight = clean_model.block2[0].weight.abs().flatten(2).sum(2).sum(0)
    assert torch.equal(idx, weight.argsort(descending=True)[:3])
    no_head = nn.Sequential(nn.Conv2d(1, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    with pytest.raises(PBEError, match="no nn.Linear|has none"):
        attacks.create("trojannn").plant(no_head, digits[0], rate=0.1, recipe="tiny", progress=False)
    with pytest.raises(PBEError, match="no module 'head'"):
        attacks.create("trojannn", layer="head").layer_name(clean_model)
    with pytest.raises(PBEError, match="BatchNorm2d"):
        attacks.create("trojannn", layer="block1.1").layer_name(clean_model)
    with pytest.raises(PBEError, match="neurons >= 1"):
        attacks.create("trojannn", neurons=0)


def test_trojannn_plants_end_to_end(digits):
    train, test = digits
    a = attacks.create("trojannn", target=0, size=3, steps=50, surrogate_epochs=2, seed=1)
    model = models.create("small_cnn", 10, 1, dataset="digits", width=8, seed=0)
    with one_thread():
        poisoned, history = a.plant(model, train.subset(torch.arange(800)), None, rate=0.1, recipe="tiny", seed=0,
                                    epochs=8, progress=False)
    assert a.optimised and len(history) == 8 and len(poisoned.poison_indices) == 80
    assert (poisoned.labels[poisoned.poison_indices] == 0).all()
    stamped = poisoned.images[poisoned.poison_indices][:, :, 5:, 5:].float() / 255
    assert torch.equal(stamped, a.patch.expand_as(stamped))  # the optimised trigger is the one planted
    r = metrics.evaluate(model, test, a)
    assert r["asr"] > 0.8 and r["acc"] > 0.7


# ---------------------------------------------------------------- label-consistent
def test_lc_poisons_target_images_adversarially_within_eps_and_keeps_labels(digits, clean_model):
    train, _ = digits
    # 32/255: a digits model shrugs off 16/255 (89 % still right after 10 PGD steps), not 32/255 (12 %)
    a = attacks.create("lc", target=2, eps=32 / 255, trigger="bottom-right")
    with pytest.raises(PBEError, match="surrogate"):
        a.poison(train, 0.05)
    with one_thread():
        p = a.poison(train, 0.05, seed=1, surrogate=clean_model)
    idx = p.poison_indices
    assert len(idx) == round(0.05 * len(train)) and (train.labels[idx] == 2).all()
    assert torch.equal(p.labels, train.labels)  # clean-label: no label changes
    assert torch.equal(p.images[~p.poison_mask], train.images[~p.poison_mask])

    plain = (a.apply(train.images[idx].float() / 255, train=True) * 255).round()  # clean + trigger
    diff = p.images[idx].float() - plain
    corners = a.pattern[0] != 0
    assert (diff[:, :, corners] == 0).all()  # full amplitude: the trigger pixels are black or white either way
    outside = diff[:, :, ~corners]
    assert outside.abs().max() <= 32 and (outside != 0).flatten(1).any(1).float().mean() > 0.9
    # the surrogate is fooled by the poisoned images, not by clean + trigger (39 % vs 100 % right here)
    still_right = (metrics.predict(clean_model, p.images[idx]) == 2).float().mean()
    assert still_right < (metrics.predict(clean_model, plain.to(torch.uint8)) == 2).float().mean() - 0.4


def test_lc_trigger_amplitudes_and_arguments():
    x = torch.full((2, 3, 32, 32), 0.5)
    a = attacks.create("lc", amplitude=32 / 255)
    test_time, train_time = a.apply(x), a.apply(x, train=True)
    corners = a.pattern[0] != 0
    assert corners.sum() == 36 and corners[:3, :3].all() and corners[-3:, -3:].all() and not corners[3:-3].any()
    assert set(test_time[:, :, corners].unique().tolist()) == {0.0, 1.0}  # full amplitude at test time
    assert torch.allclose((train_time - x)[:, :, corners].abs(), torch.tensor(32 / 255))
    assert torch.equal(a.pattern[0, :3, :3], a.pattern[0, :3, -3:].flip(1))  # mirrored: survives flips
    assert torch.equal(test_time[:, :, ~corners], x[:, :, ~corners])
    one = attacks.create("lc", trigger="bottom-right").prepare((1, 28, 28)).pattern[0] != 0
    assert one.sum() == 9 and one[-3:, -3:].all()
    toy = data.ImageDataset(torch.full((8, 3, 32, 32), 128, dtype=torch.uint8), torch.arange(8) % 2, ["a", "b"],
                            "toy")
    only_trigger = attacks.create("lc", eps=0).poison(toy, 0.5)  # no adversarial step: no surrogate needed
    assert (toy.labels[only_trigger.poison_indices] == 0).all()
    stamped = (a.apply(toy.images[:4].float() / 255) * 255).round().to(torch.uint8)
    assert torch.equal(only_trigger.images[only_trigger.poison_indices], stamped)
    for bad in ({"all_to_all": True}, {"amplitude": 0}, {"trigger": "center"}, {"eps": 2.0}):
        with pytest.raises(PBEError):
            attacks.create("lc", **bad)


def test_lc_plants_end_to_end(digits, tmp_path):
    train, test = digits
    a = attacks.create("lc", target=0, surrogate_epochs=3)
    model = models.create("small_cnn", 10, 1, dataset="digits", width=16, seed=0)
    with pytest.raises(PBEError, match="target-class"):
        a.plant(model, train, rate=0.5, recipe="tiny", progress=False)
    with one_thread():
        poisoned, history = a.plant(model, train, None, rate=0.09, recipe="tiny", seed=0, epochs=10, progress=False)
    assert len(history) == 10 and (train.labels[poisoned.poison_indices] == 0).all()
    assert torch.equal(poisoned.labels, train.labels)
    r = metrics.evaluate(model, test, a)
    assert r["acc"] > 0.85 and r["asr"] > 0.5
    # the saved attack carries the images its PGD made: a loaded one re-poisons exactly, with no surrogate
    a.save(tmp_path / "lc")
    again = attacks.load(tmp_path / "lc").poison(train, 0.09, 0)
    assert torch.equal(again.images, poisoned.images) and torch.equal(again.poison_indices, poisoned.poison_indices)
