"""Sparse and universal perturbations, and the premise measurement (adversarial labels vs target)."""
import pytest
import torch

from pbe.adversarial import UniversalConfig, _paste, apply_universal, patch_attack, universal_perturbation
from pbe.premise import Family, label_shares
from pbe.utils import PBEError


def test_paste_puts_the_patch_where_asked_and_nowhere_else():
    x = torch.rand(3, 3, 8, 8)
    patch = torch.full((3, 2, 2), 2.0)  # a value no image pixel has
    out = _paste(x, patch, torch.tensor([[0, 0], [6, 6], [3, 5]]))
    assert out[0, :, :2, :2].eq(2).all() and out[1, :, 6:, 6:].eq(2).all() and out[2, :, 3:5, 5:7].eq(2).all()
    assert out.eq(2).sum() == 3 * 3 * 4  # 3 images x 3 channels x 4 pixels, nothing else changed
    assert torch.equal(out[out != 2], x[out != 2])


def test_patch_attack_changes_only_a_patch_and_fools(badnets_model, digits):
    model, _, _ = badnets_model
    x, y = digits[1].images[:64].float() / 255, digits[1].labels[:64]
    x_adv = patch_attack(model, x, y, size=3, steps=10, generator=torch.Generator().manual_seed(0))
    changed = (x_adv != x).flatten(1).sum(1)
    assert (changed <= 9).all() and x_adv.min() >= 0 and x_adv.max() <= 1
    assert (model(x_adv).argmax(1) != y).float().mean() > (model(x).argmax(1) != y).float().mean()
    with pytest.raises(PBEError, match="patch size"):
        patch_attack(model, x, y, size=9)


@pytest.mark.parametrize("kind,eps", [("linf", 16 / 255), ("l2", 1.0), ("patch", 3)])
def test_universal_perturbation_respects_its_budget(badnets_model, digits, kind, eps):
    model, _, _ = badnets_model
    x, y = digits[1].images[:64], digits[1].labels[:64]
    cfg = UniversalConfig(kind=kind, eps=eps if kind != "patch" else 8 / 255, size=3, epochs=2, batch_size=32)
    delta = universal_perturbation(model, x, y, cfg, generator=torch.Generator().manual_seed(0))
    if kind == "linf":
        assert delta.shape == (1, 8, 8) and delta.abs().max() <= eps + 1e-6
    elif kind == "l2":
        assert delta.norm() <= eps + 1e-5
    else:
        assert delta.shape == (1, 3, 3) and 0 <= delta.min() and delta.max() <= 1
    out = apply_universal(x.float() / 255, delta, cfg, torch.Generator().manual_seed(1))
    assert out.shape == x.shape and 0 <= out.min() and out.max() <= 1
    with pytest.raises(PBEError, match="universal kind"):
        UniversalConfig(kind="l1")


def test_universal_perturbations_find_the_backdoor_target(badnets_model, clean_model, digits):
    """On the infected digits model a universal L2 perturbation lands on the target far above natural
    confusion; the clean model's adversarial labels show no such pull to label 0."""
    model, attack, _ = badnets_model
    test = digits[1]
    keep = (test.labels != attack.target) & (model(test.images.float() / 255).argmax(1) == test.labels)
    x, y = test.images[keep][:120], test.labels[keep][:120]
    fams = [Family("l2", 4.0, universal=True), Family("linf", 8 / 255)]
    rows, passes = label_shares(model, x, y, 10, target=attack.target, families=fams)
    uni = rows[0]
    assert uni["universal"] and uni["images"] == 60 and passes > 0
    assert uni["success"] > 0.5 and uni["target_share"] > 0.8 and uni["lift"] > 3
    keep_c = (test.labels != 0) & (clean_model(test.images.float() / 255).argmax(1) == test.labels)
    rows_c, _ = label_shares(clean_model, test.images[keep_c][:120], test.labels[keep_c][:120], 10, target=0,
                             families=fams[:1])
    assert rows_c[0]["target_share"] < uni["target_share"] - 0.3
    clean_rows, _ = label_shares(clean_model, x, y, 10, target=None, families=fams[:1])
    assert clean_rows[0]["target_share"] is None and clean_rows[0]["top_label"] is not None
