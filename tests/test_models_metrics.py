import pytest
import torch

from pbe import metrics, models
from pbe.utils import PBEError


@pytest.mark.parametrize("name,c,size", [("preact_resnet18", 3, 32), ("preact_resnet18", 3, 64),
                                         ("small_cnn", 1, 28), ("small_cnn", 1, 8), ("small_vgg", 3, 32),
                                         ("lenet", 3, 32), ("lenet", 1, 28), ("convmixer", 3, 32),
                                         ("convmixer", 1, 28)])
def test_models_take_unit_range_inputs_of_any_size(name, c, size):
    m = models.create(name, 7, c, width=8).eval()
    out = m(torch.rand(2, c, size, size))
    assert out.shape == (2, 7)
    assert m.pbe_spec["name"] == name and m.pbe_spec["num_classes"] == 7
    assert models.has_linear_head(m) and m.features(torch.rand(2, c, size, size)).shape[0] == 2


def test_a_recipe_without_flips_never_flips(monkeypatch):
    import importlib
    train_mod = importlib.import_module("pbe.train")  # the module: `pbe.train` is also the function
    from pbe.data import ImageDataset
    seen = []
    monkeypatch.setattr(train_mod, "augment", lambda x, pad, flip, gen: seen.append((pad, flip)) or x)
    data = ImageDataset(torch.randint(0, 255, (8, 3, 32, 32), dtype=torch.uint8), torch.arange(8) % 2, ["a", "b"],
                        "t", flip=True)
    for recipe, expected in (("lenet", (0, False)), ("quick", (4, True))):
        seen.clear()
        train_mod.train(models.create("lenet", 2, 3, width=2), data, recipe=recipe, epochs=1, progress=False)
        assert seen and set(seen) == {expected}


def test_seeded_creation_is_reproducible_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = models.create("small_cnn", 10, 1, width=4, seed=7)
    assert torch.equal(torch.rand(1), before)
    b = models.create("small_cnn", 10, 1, width=4, seed=7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert "seed" not in a.pbe_spec


def test_normalisation_is_inside_the_model():
    m = models.create("small_cnn", 10, 3, dataset="cifar10", width=4)
    x = torch.full((1, 3, 1, 1), 0.4914)
    assert torch.allclose(m.normalize(x)[0, 0], torch.zeros(1, 1), atol=1e-6)


def test_activations_by_name_and_hooks_removed():
    m = models.create("preact_resnet18", 10, 3, width=4)
    acts = models.activations(m, torch.rand(5, 3, 32, 32), ["layer4", "linear"], batch_size=2)
    assert acts["layer4"].shape == (5, 32, 4, 4) and acts["linear"].shape == (5, 10)
    assert all(not mod._forward_hooks for mod in m.modules())
    with pytest.raises(PBEError, match="unknown layer"):
        models.activations(m, torch.rand(1, 3, 32, 32), ["nope"])
    with pytest.raises(PBEError, match="unknown model"):
        models.create("resnet9000", 10)


def test_capture_keeps_outputs_or_inputs_with_their_graph_and_removes_hooks():
    m = models.create("small_cnn", 10, 1, dataset="digits", width=8, seed=0)
    head = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)][-1]
    x = torch.rand(3, 1, 8, 8)
    with models.capture(m, [head], inputs=True) as feats, models.capture(m, [models.last_conv_name(m)]) as outs:
        logits = m(x)
        assert torch.allclose(head(feats[head]), logits)  # the head's input, as given
        assert outs[models.last_conv_name(m)].requires_grad
    assert all(not mod._forward_hooks for mod in m.modules())
    with pytest.raises(PBEError, match="unknown layer"):
        with models.capture(m, ["nope"]):
            pass


def test_accuracy_asr_ra_by_hand():
    labels = torch.tensor([0, 1, 2, 3, 1, 0])
    pred = torch.tensor([0, 0, 0, 3, 1, 0])  # triggered predictions, target 0
    # non-target images: indices 1..4 -> predictions 0,0,3,1 -> 2 of 4 hit the target
    assert metrics.attack_success_rate(pred, labels, target=0) == pytest.approx(0.5)
    assert metrics.robust_accuracy(pred, labels, target=0) == pytest.approx(0.5)  # 3->3, 1->1
    assert metrics.accuracy(pred, labels) == pytest.approx(4 / 6)
    # all-to-all: goal (y+1) % 4 = 1,2,3,0,2,1 -> hits at none... pred [0,0,0,3,1,0]
    a2a_pred = torch.tensor([1, 2, 0, 0, 2, 0])
    assert metrics.attack_success_rate(a2a_pred, labels, all_to_all=True, num_classes=4) == pytest.approx(4 / 6)


def test_der_sign_conventions():
    assert metrics.der(0.9, 1.0, 0.9, 0.0) == pytest.approx(1.0)  # full erasure, no cost
    assert metrics.der(0.9, 1.0, 0.9, 1.0) == pytest.approx(0.5)  # nothing happened
    assert metrics.der(0.9, 0.5, 0.7, 0.9) == pytest.approx(0.4)  # ASR rise is not rewarded or punished; ACC drop is
    assert metrics.der(0.8, 1.0, 0.85, 0.2) == pytest.approx(0.9)  # ACC gain is not rewarded


def test_evaluate_with_attack_and_accuracy_under(digits):
    from pbe.data import ImageDataset

    class Const(torch.nn.Module):  # predicts 0 on bright top-left pixel, else the "true" label oracle
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            out = torch.zeros(len(x), 3)
            out[:, 1] = 2.0  # logits: a row (0, 1, 0) would read as probabilities (pbe.checks refuses those)
            out[x[:, 0, 0, 0] > 0.99, 0] = 5.0
            return out

    ds = ImageDataset(torch.zeros(4, 1, 2, 2, dtype=torch.uint8), torch.tensor([1, 1, 0, 2]), ["a", "b", "c"])

    class Stamp:
        target, all_to_all = 0, False

        def apply(self, x):
            x = x.clone()
            x[:, 0, 0, 0] = 1.0
            return x

    r = metrics.evaluate(Const(), ds, Stamp())
    assert r["acc"] == pytest.approx(0.5) and r["asr"] == pytest.approx(1.0) and r["ra"] == 0.0
    assert metrics.accuracy_under(Const(), ds.images, ds.labels, lambda x, y: Stamp().apply(x)) == 0.25
