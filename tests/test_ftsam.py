"""FT-SAM on tiny digits models: its SAM step applies the gradient taken at the perturbed weights to the
unperturbed ones (and differs from a plain SGD step), it lowers a BadNets model's ASR at little accuracy
cost, counts two passes per step, resumes from its stage, and refuses bad arguments by name."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from pbe import defenses, models
from pbe.defenses import Evaluation
from pbe.defenses.base import cross_entropy
from pbe.defenses.ftsam import FTSAM, frozen_bn_stats, sam_step, smooth_cross_entropy
from pbe.utils import PBEError

TINY = dict(epochs=20, batch_size=64)  # 300 images: 5 batches an epoch, about a second on one thread


@pytest.fixture(scope="module")
def clean_extra(digits):
    """300 clean digits training images (the 5% of CIFAR-10 is 2,500)."""
    train = digits[0]
    return train.subset(torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:300].sort().values)


def _batch(digits, n=32):
    return digits[0].images[:n].float() / 255, digits[0].labels[:n]


def _grads(model, x, y):
    model.zero_grad(set_to_none=True)
    cross_entropy(model, x, y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("adaptive, rho, eta", [(True, 2.0, 0.0), (True, 0.5, 0.01), (False, 0.05, 0.0)])
def test_sam_step_applies_the_perturbed_gradient_at_the_restored_weights(digits, adaptive, rho, eta):
    """By hand: g at w, e = rho * T^2 g / |T g| (T = |w| + eta, or 1), g' at w + e; SAM with plain SGD must
    end at w - lr * g' (the perturbation undone), away from SGD's w - lr * g; BatchNorm's running
    statistics move once (the first pass), and the loss at w + e is the higher."""
    lr = 0.1
    model = models.create("small_cnn", 10, 1, dataset="digits", width=8, seed=0).train()
    x, y = _batch(digits)
    w = [p.detach().clone() for p in model.parameters()]

    ref = copy.deepcopy(model)
    g = _grads(ref, x, y)
    scale = [p.abs() + eta if adaptive else torch.ones_like(p) for p in w]
    norm = torch.stack([(s * gi).norm() for s, gi in zip(scale, g)]).norm()
    e = [rho * s * s * gi / norm for s, gi in zip(scale, g)]
    inside = [torch.where(s > 0, ei / s, 0.0).norm() for ei, s in zip(e, scale)]  # |w| = 0 (eta 0): no move there
    assert math.isclose(torch.stack(inside).norm().item(), rho, rel_tol=1e-4)  # e is on the neighbourhood's edge
    with torch.no_grad():
        for p, ei in zip(ref.parameters(), e):
            p.add_(ei)
    g_perturbed = _grads(ref, x, y)
    expected = [wi - lr * gi for wi, gi in zip(w, g_perturbed)]

    sam, plain = copy.deepcopy(model), copy.deepcopy(model)
    loss, perturbed = sam_step(sam, cross_entropy, x, y, torch.optim.SGD(sam.parameters(), lr=lr), rho, adaptive, eta)
    opt = torch.optim.SGD(plain.parameters(), lr=lr)
    cross_entropy(plain, x, y).backward()
    opt.step()

    for p, want in zip(sam.parameters(), expected):
        torch.testing.assert_close(p.detach(), want, rtol=1e-4, atol=1e-6)
    gap = max((a - b).abs().max().item() for a, b in zip(sam.parameters(), plain.parameters()))
    assert gap > 1e-3, "the SAM step moved the weights as plain SGD does"
    assert perturbed > loss and math.isclose(loss, F.cross_entropy(model(x), y).item(), rel_tol=1e-5)
    for name, buf in sam.named_buffers():  # plain SGD's one forward updated the statistics once, as SAM must
        torch.testing.assert_close(buf, dict(plain.named_buffers())[name], msg=name)


def test_frozen_bn_stats_and_smoothed_labels(digits):
    model = models.create("small_cnn", 10, 1, dataset="digits", width=8, seed=0).train()
    x, y = _batch(digits)
    before = {k: v.clone() for k, v in model.named_buffers()}
    with frozen_bn_stats(model):
        model(x)
    assert all(torch.equal(before[k], v) for k, v in model.named_buffers())
    assert all(m.momentum == 0.1 for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2, 3, 0])
    assert torch.allclose(smooth_cross_entropy(logits, labels, 0.0), F.cross_entropy(logits, labels))
    target = torch.full((5, 4), 0.1 / 3).scatter_(1, labels[:, None], 0.9)  # BackdoorBench's smoothing
    assert torch.allclose(smooth_cross_entropy(logits, labels, 0.1), -(target * logits.log_softmax(1)).sum(1).mean())


def test_ftsam_lowers_badnets_asr_and_counts_two_passes_a_step(badnets_model, clean_extra, digits):
    """Over 10 seeds this run left ASR 0.10-0.24 (from 1.0) and ACC 0.95-0.97 (from 0.99)."""
    model, attack, poisoned = badnets_model
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    ev = Evaluation(digits[1], attack, poisoned.poison_indices)
    result = defenses.create("ftsam", **TINY)(model, clean_extra, progress=False, evaluation=ev,
                                               train_size=len(digits[0]))
    rep = result.report
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items()), "input model was modified"
    assert rep["before"]["asr"] > 0.9 and rep["after"]["asr"] < rep["before"]["asr"] - 0.5, rep["after"]
    assert rep["after"]["acc"] > rep["before"]["acc"] - 0.10, rep["after"]
    assert rep["passes"] == {"forward_backward": 2 * TINY["epochs"] * len(clean_extra), "forward": 0}
    assert [e["epoch"] for e in rep["epochs"]] == list(range(1, TINY["epochs"] + 1))
    assert all(e["perturbed_loss"] > e["loss"] for e in rep["epochs"])
    assert rep["epochs"][0]["lr"] == 0.01 > rep["epochs"][-1]["lr"]  # cosine-annealed per epoch


def test_ftsam_resumes_from_its_stage(badnets_model, clean_extra, tmp_path):
    """A second call with the same state folder takes the finished loop's end state: same weights, no work."""
    defense = defenses.create("ftsam", epochs=3, batch_size=64)
    first = defense(badnets_model[0], clean_extra, progress=False, state_dir=tmp_path)
    again = defense(badnets_model[0], clean_extra, progress=False, state_dir=tmp_path)
    assert again.report["resumed"][0]["epochs_done"] == 3 and again.report["epochs"] == first.report["epochs"]
    assert all(torch.equal(a, b) for a, b in zip(first.model.state_dict().values(), again.model.state_dict().values()))


def test_ftsam_is_registered_and_refuses_bad_arguments():
    assert "ftsam" in defenses.available("clean-extra") and defenses.REGISTRY.get("ftsam") is FTSAM
    assert FTSAM.defaults == dict(epochs=100, lr=0.01, batch_size=256, momentum=0.9, weight_decay=5e-4, rho=2.0,
                                  adaptive=True, eta=0.0, label_smoothing=0.1)
    for bad, match in (({"rho": 0}, "rho .*must be in"), ({"rho": -1.0}, "rho"), ({"rho": float("nan")}, "rho"),
                       ({"rho": 1e3}, "rho"), ({"eta": -0.1}, "eta must be"),
                       ({"eta": 0.1, "adaptive": False}, "set adaptive=True or leave eta at 0"),
                       ({"label_smoothing": 1.0}, "label_smoothing"), ({"epochs": 0}, "epochs"), ({"lr": 0}, "lr"),
                       ({"momentum": 1.0}, "momentum"), ({"adaptive": "yes"}, "parameter adaptive must be bool"),
                       ({"rh": 2.0}, "unknown parameter")):
        with pytest.raises(PBEError, match=f"ftsam.*{match}"):
            defenses.create("ftsam", **bad)
