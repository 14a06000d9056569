"""Poison isolation (pbe.isolation) and PBE's `isolate` lever.

Checked on a hand-built backdoored model, so that the backdoor is known exactly and the test does not
depend on how a tiny network happens to train: synthetic 8x8 "texture" classes (label c: a fixed
random +-1 pattern with a random sign per image, so every class has the same mean image, as natural
images nearly do), a model whose features are the patterns' absolute correlations plus one "trigger
detector" (the top-left 2x2 corner lit) wired to label 0, and 15 % poison: corner-lit images of other
labels relabelled 0. (On the 8x8 digits a class's mean image alone flips a tiny model's predictions,
so the model-confirmation step refuses to flag anything there: safe, but nothing to test.)
"""
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from pbe.data import ImageDataset
from pbe.detection import ScanBudget
from pbe.isolation import EstimatedTrigger, isolate
from pbe.metrics import predict

TARGET = 0
RATE = 0.15
CLASSES = 10
PER_CLASS = 150


class Backdoored(nn.Module):
    """[0, 1] 1x8x8 images -> logits from |correlation with each class pattern| and a corner detector
    (weight `strength` toward TARGET; 0: a clean model)."""

    def __init__(self, patterns: torch.Tensor, strength: float, checker: bool = False):
        super().__init__()
        self.checker = checker  # the detector fires on a 2x2 checkerboard of either phase (no mean image)
        self.register_buffer("patterns", patterns.flatten(1))
        self.head = nn.Linear(CLASSES + 1, CLASSES)
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.weight[:, :CLASSES] = torch.eye(CLASSES) * 20
            self.head.bias.zero_()
            self.head.weight[TARGET, CLASSES] = strength

    def forward(self, x):
        corr = ((x.flatten(1) - 0.5) @ self.patterns.T).abs() / self.patterns.shape[1]
        c = x[:, 0, :2, :2]
        if self.checker:
            corner = ((c[:, 0, 0] + c[:, 1, 1] - c[:, 0, 1] - c[:, 1, 0]).abs() / 2 - 0.8).clamp_min(0) * 10
        else:
            corner = (x[:, :, :2, :2].mean((1, 2, 3)) - 0.9).clamp_min(0) * 10
        return self.head(torch.cat([corr, corner[:, None]], 1))


def _corner(images: torch.Tensor) -> torch.Tensor:
    out = images.clone()
    out[:, :, :2, :2] = 255
    return out


def _textures(patterns: torch.Tensor, gen: torch.Generator, prototype: bool = False,
              every_class: bool = False) -> ImageDataset:
    """`prototype`: TARGET's images all take the + sign, so its mean image is its pattern (like a
    traffic sign's, and unlike a natural image class's); `every_class`: every label's do."""
    labels = torch.arange(CLASSES).repeat_interleave(PER_CLASS)
    sign = torch.randint(0, 2, (len(labels), 1, 1, 1), generator=gen).float() * 2 - 1
    if every_class:
        sign[:] = 1.0
    elif prototype:
        sign[labels == TARGET] = 1.0
    noise = torch.randn(len(labels), 1, 8, 8, generator=gen) * 10
    images = (128 + 50 * sign * patterns[labels] + noise).round().clamp(0, 255).to(torch.uint8)
    return ImageDataset(images, labels, [str(c) for c in range(CLASSES)], "textures", False)


def _toy(prototype: bool = False):
    gen = torch.Generator().manual_seed(0)
    patterns = torch.randint(0, 2, (CLASSES, 1, 8, 8), generator=gen).float() * 2 - 1
    train = _textures(patterns, gen, prototype)
    images, labels = train.images.clone(), train.labels.clone()
    pool = (labels != TARGET).nonzero().flatten()
    poison = pool[torch.randperm(len(pool), generator=gen)[:round(RATE * len(labels))]].sort().values
    images[poison] = _corner(images[poison])
    labels[poison] = TARGET
    poisoned = ImageDataset(images, labels, train.classes, train.name, False)
    poisoned.poison_indices = poison
    return Backdoored(patterns, 10.0).eval(), Backdoored(patterns, 0.0).eval(), poisoned, _textures(patterns, gen)


@pytest.fixture(scope="module")
def toy():
    """(backdoored model, clean model, poisoned training set with poison_indices, clean test set)."""
    return _toy()


@pytest.mark.parametrize("kind", ["additive", "patch", "blend"])
def test_estimated_trigger_reproduces_additive_patch_and_blend_triggers(kind):
    """From images with the trigger and others without, the estimate re-applies the trigger to new
    images; dropping its mask (a plain mean shift) does not, for the patch and the blend."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(40, 216, (3000, 3, 8, 8), generator=gen, dtype=torch.uint8)
    key = torch.randint(0, 256, (3, 8, 8), generator=gen).float()
    delta = (torch.rand(3, 8, 8, generator=gen) * 2 - 1) * 30

    def plant(x):
        x = x.float()
        if kind == "additive":
            x = x + delta
        elif kind == "patch":
            x = x.clone()
            x[:, :, :3, :3] = key[:, :3, :3]
        else:
            x = 0.8 * x + 0.2 * key
        return x.round().clamp(0, 255).to(torch.uint8)
    trig = EstimatedTrigger.estimate(plant(images[:1000]), images[1000:2000])
    fresh = images[2000:]
    want = plant(fresh).float() / 255
    error = (trig.apply(fresh.float() / 255) - want).abs().mean()
    assert error < 0.01
    if kind != "additive":
        shift_only = EstimatedTrigger(torch.zeros_like(trig.mask), trig.pattern, trig.shift)
        assert (shift_only.apply(fresh.float() / 255) - want).abs().mean() > 3 * error


def test_isolate_finds_the_poison_cluster_and_spares_a_clean_model(toy):
    from pbe.models import penultimate
    model, clean, poisoned, _ = toy
    feats = penultimate(model, poisoned.images)
    iso, passes = isolate(model, poisoned.images, poisoned.labels, feats, torch.Generator().manual_seed(0))
    poison = torch.zeros(len(poisoned), dtype=torch.bool)
    poison[poisoned.poison_indices] = True
    assert iso.flagged == [TARGET] and passes > 0
    assert iso.silhouettes[TARGET] == max(iso.silhouettes)
    assert (iso.suspected == poison).float().mean() > 0.99
    best, other = sorted(iso.fooling[TARGET], reverse=True)
    assert best > 0.9 and best - other > 0.5
    assert iso.trigger_fooling > 0.9
    corner = iso.trigger.apply(torch.zeros(1, 1, 8, 8))[0, 0, :2, :2]
    assert corner.min() > 0.9  # the estimated trigger lights the corner
    clean_feats = penultimate(clean, poisoned.images)
    spared, _ = isolate(clean, poisoned.images, poisoned.labels, clean_feats, torch.Generator().manual_seed(0))
    assert spared.flagged == [] and not spared.suspected.any() and spared.trigger is None


def test_isolate_tells_a_class_prototype_from_a_trigger(monkeypatch):
    """Where the target's clean images share a recognisable mean image (GTSRB's signs), that cluster's
    estimate moves the model too, so the margin rule alone confirms neither cluster; the poison's
    estimate does it at a much smaller change per pixel and is confirmed by the change rule."""
    from pbe import isolation
    from pbe.models import penultimate
    model, _, poisoned, _ = _toy(prototype=True)
    poison = torch.zeros(len(poisoned), dtype=torch.bool)
    poison[poisoned.poison_indices] = True
    feats = penultimate(model, poisoned.images)
    iso, _ = isolate(model, poisoned.images, poisoned.labels, feats, torch.Generator().manual_seed(0))
    assert iso.flagged == [TARGET] and (iso.suspected == poison).float().mean() > 0.99
    rates, changes = iso.fooling[TARGET], iso.change[TARGET]
    best = max(range(2), key=rates.__getitem__)
    assert min(rates) >= isolation.MIN_FOOLING  # the prototype moves the model as well
    assert changes[1 - best] >= isolation.MIN_CHANGE_RATIO * changes[best]
    monkeypatch.setattr(isolation, "MIN_CHANGE_RATIO", float("inf"))  # the margin rule alone
    alone, _ = isolate(model, poisoned.images, poisoned.labels, feats, torch.Generator().manual_seed(0))
    assert alone.flagged == [] and not alone.suspected.any()


def test_isolate_flags_a_label_whose_moving_cluster_is_its_own_prototype_but_suspects_no_sample():
    """A trigger with no mean image (a 2x2 checkerboard of random phase, like a warp) on a model whose class
    means move it (every class has a recognisable mean image, like GTSRB's signs): only the target's clean
    cluster's estimate moves the model, at a far larger change. The label is flagged, as a prototype, and
    no sample is suspected (without the rule, the clean cluster would be taken for the poison). The toy
    whose classes have no mean image keeps its large-change poison cluster (a trigger there)."""
    from pbe import isolation
    from pbe.models import penultimate
    gen = torch.Generator().manual_seed(0)
    patterns = torch.randint(0, 2, (CLASSES, 1, 8, 8), generator=gen).float() * 2 - 1
    train = _textures(patterns, gen, every_class=True)
    images, labels = train.images.clone(), train.labels.clone()
    pool = (labels != TARGET).nonzero().flatten()
    poison = pool[torch.randperm(len(pool), generator=gen)[:round(RATE * len(labels))]].sort().values
    phase = torch.randint(0, 2, (len(poison),), generator=gen).bool()
    board = torch.tensor([[255, 0], [0, 255]], dtype=torch.uint8)
    images[poison, 0, :2, :2] = torch.where(phase[:, None, None], board, 255 - board)
    labels[poison] = TARGET
    model = Backdoored(patterns, 10.0, checker=True).eval()
    assert (predict(model, images[poison].float() / 255) == TARGET).all()  # the backdoor works
    feats = penultimate(model, images)
    iso, _ = isolate(model, images, labels, feats, torch.Generator().manual_seed(0))
    rates = iso.fooling[TARGET]
    moving = max(range(2), key=rates.__getitem__)
    assert rates[moving] >= isolation.MIN_FOOLING and rates[1 - moving] < isolation.MIN_FOOLING
    assert isolation._larger_change(iso.change[TARGET], moving)
    assert iso.flagged == [TARGET] and iso.prototypes == [TARGET] and not iso.suspected.any() and iso.trigger is None
    assert iso.class_mean_fooling >= isolation.PROTOTYPE_FOOLING
    with pytest.MonkeyPatch.context() as mp:  # without the rule: the clean prototype cluster is "the poison"
        mp.setattr(isolation, "PROTOTYPE_FOOLING", float("inf"))
        wrong, _ = isolate(model, images, labels, feats, torch.Generator().manual_seed(0))
    is_poison = torch.zeros(len(labels), dtype=torch.bool)
    is_poison[poison] = True
    assert wrong.suspected.any() and (wrong.suspected & is_poison).sum() < 0.1 * wrong.suspected.sum()
    model, _, poisoned, _ = _toy()  # classes without a mean image: the large-change cluster is the trigger
    toy_iso, _ = isolate(model, poisoned.images, poisoned.labels, penultimate(model, poisoned.images),
                         torch.Generator().manual_seed(0))
    assert isolation._larger_change(toy_iso.change[TARGET], max(range(2), key=toy_iso.fooling[TARGET].__getitem__))
    assert toy_iso.class_mean_fooling < isolation.PROTOTYPE_FOOLING and toy_iso.prototypes == []
    assert toy_iso.suspected[poisoned.poison_indices].all()


def _toy_schedule(**kw):
    """The default schedule at the toy's scale: one small additive family, no calibration, a constant lr."""
    from pbe.adversarial import UniversalConfig
    from pbe.defenses import Schedule
    from pbe.demo import DIGITS_PGD
    return Schedule(crop_padding=0, probe_size=100, batch_size=64, monitor_pgd=DIGITS_PGD, lr_schedule="constant",
                    families=(UniversalConfig(kind="l2", eps=0.5, epochs=1),), universal_images=64,
                    universal_reach=0.0, adv_batches=(None,) * len(kw["fractions"]), **kw)


def _spy_finetune(mp, seen):
    """Record the estimated trigger (or None) every round of PBE fine-tunes with."""
    import pbe.defenses.pbe as defense
    real = defense.adversarial_finetune

    def spy(m, d, s, ctx, **kw):
        seen.append(kw.get("trigger"))
        return real(m, d, s, ctx, **kw)
    mp.setattr(defense, "adversarial_finetune", spy)


def _nothing_found(mp):
    """make_plan as if the scan and the isolation found nothing (rule 6): the run without their plan."""
    import pbe.defenses.pbe as defense
    mp.setattr(defense, "make_plan", lambda **kw: defense.Plan())


def test_pbe_isolate_refuses_unlearns_and_relabels_the_isolated_poison(toy):
    """Where the scan names no label and the isolation confirms a cluster (the plan's rule 3), round 1 never
    trains on a suspected sample, every batch carries the estimated trigger with the samples' own labels, the
    backdoor goes, and the isolation is in the report; without that plan the same run leaves the backdoor."""
    import pbe.defenses.pbe as defense
    from pbe.defenses import Evaluation, erase
    model, _, poisoned, _ = toy
    s = _toy_schedule(fractions=(0.3, 0.5), epochs=(4, 2), lr=0.1)
    seen = []

    def run(schedule, plain=False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(defense, "detect", lambda *a, **k: _no_target(poisoned.num_classes))
            _spy_finetune(mp, seen)
            if plain:
                _nothing_found(mp)
            return erase(model, poisoned, schedule, seed=0, progress=False,
                         evaluation=Evaluation(poison_indices=poisoned.poison_indices))
    purified, report = run(s)
    assert report["isolation"]["flagged"] == [TARGET] and report["target"] is None
    assert report["plan"]["distrust"] == "cluster" and report["plan"]["trigger"] == "estimated"
    round1 = set(report["rounds"][0]["subset_indices"])
    assert not round1 & set(poisoned.poison_indices.tolist())
    assert len(seen) == 2 and all(trig is not None for trig in seen)
    assert report["rounds"][0]["relabelled"] > 0
    # the erasure tracker follows the estimated trigger (no target: the share whose prediction it changes)
    before, after = report["tracker_before"], report["tracker_after"]
    assert (before["evidence"], before["label"], before["there"]) == ("trigger", None, True)
    assert after["evidence"] == "trigger" and after["reach"] < before["reach"]
    lit = _corner(poisoned.images[(poisoned.labels != TARGET).nonzero().flatten()]).float() / 255
    before = (predict(model, lit) == TARGET).float().mean()
    after = (predict(purified, lit) == TARGET).float().mean()
    seen.clear()
    plain, plain_report = run(s, plain=True)
    assert plain_report["plan"]["distrust"] == "none" and seen == [None, None]
    assert before > 0.9 and after < 0.3 < (predict(plain, lit) == TARGET).float().mean()


def _no_target(k: int):
    from pbe.detection import Detection
    return Detection(suspected=False, label=None, top_label=1, score=0.0, p_value=1.0, alpha=0.01, rates=[0.0] * k,
                     label_map=None, gap=None, gap_score=None, images=2 * k, forward_backward=0, forward=0,
                     scores={"universal": 0.0}, tests={"universal": [1, 0.0, 1.0]})


def test_detect_with_training_data_names_the_target_from_its_poison_cluster(toy):
    """The corner trigger is beyond the scan's small universal budget and leaves no train-test gap,
    so only the activation clusters of the labelled training set find it; the clean model is spared."""
    from pbe.detection import detect
    model, clean, poisoned, test = toy
    found = detect(model, test, train_data=poisoned, budget=ScanBudget(images=100))
    assert found.suspected and found.label == TARGET and found.evidence == "cluster"
    assert found.cluster_labels == [TARGET] and found.isolation["suspected"] > 0
    alone = detect(model, test, budget=ScanBudget(images=100))  # without the training set: not seen
    assert not alone.suspected and alone.cluster_labels is None
    # no cluster: only the data's tell is left
    spared = detect(clean, test, train_data=poisoned, budget=ScanBudget(images=100))
    assert spared.cluster_labels == [] and spared.evidence == "label_share"
    with pytest.MonkeyPatch.context() as mp:  # a sample of each label: random, so the poison (stored after
        mp.setattr("pbe.detection.ISOLATION_PER_LABEL", 100)  # label 0's clean images) is in it
        sampled = detect(model, test, train_data=poisoned, budget=ScanBudget(images=100))
    assert sampled.cluster_labels == [TARGET]


def test_label_share_names_the_relabelled_target_only_where_the_model_statistics_say_nothing(toy):
    """Poison relabelled to TARGET raises its share of the training labels (here 2.5 times its test share):
    on the clean model, where no statistic of the model and no cluster finds anything, that tell decides
    (evidence "label_share"); poison that keeps every label's count (100 images each, TARGET's all poison)
    leaves the shares as they were, and nothing is suspected; on the backdoored model the cluster decides,
    the share is reported."""
    from pbe.detection import detect, label_share
    model, clean, poisoned, test = toy
    told = detect(clean, test, train_data=poisoned, budget=ScanBudget(images=100))
    assert told.suspected and told.label == TARGET and told.evidence == "label_share" and told.p_value > 0.01
    assert told.share[TARGET] == max(told.share) > 2 and told.share_score > 3
    clean_idx = torch.isin(torch.arange(len(poisoned)), poisoned.poison_indices, invert=True).nonzero().flatten()
    order = torch.cat([poisoned.poison_indices, clean_idx])  # the poison first
    keep = torch.cat([order[poisoned.labels[order] == c][:100] for c in range(CLASSES)])  # 100 a label
    replaced = ImageDataset(poisoned.images[keep], poisoned.labels[keep], poisoned.classes, poisoned.name, False)
    assert torch.isin(poisoned.poison_indices, keep).sum() == 100  # TARGET's 100: all poison
    assert label_share(replaced.labels, test.labels, CLASSES)[0].abs().max() < 0.05
    quiet = detect(clean, test, train_data=replaced, budget=ScanBudget(images=100))
    assert not quiet.suspected and quiet.share_score < 3
    found = detect(model, test, train_data=poisoned, budget=ScanBudget(images=100))
    assert found.evidence == "cluster" and found.share_score == told.share_score


def test_a_named_target_is_distrusted_whole_and_its_cluster_held_back(toy):
    """With a target named (here: given), round 1 has none of its samples (the plan's rule 1) and a poison
    cluster confirmed in that label is held back as evidence; naming another label finds no cluster there."""
    from pbe.defenses import erase
    model, _, poisoned, _ = toy
    s = _toy_schedule(fractions=(0.3,), epochs=(1,), lr=0.1)
    for target, cluster in ((TARGET, True), (TARGET + 1, False)):
        _, report = erase(model, poisoned, s, seed=0, progress=False, target=target)
        round1 = torch.tensor(report["rounds"][0]["subset_indices"])
        assert report["plan"]["named_by"] == "given" and report["plan"]["check_cluster"] == cluster
        assert not (poisoned.labels[round1] == target).any()


def test_relabel_all_gives_every_isolated_sample_another_label(toy):
    """Rule 2's relabelling: after round 1 every isolated sample joins round 2, none with its own label."""
    import pbe.defenses.pbe as defense
    from pbe.defenses import erase
    model, _, poisoned, _ = toy
    seen = []
    real = defense.adversarial_finetune

    def spy(m, data, s, ctx, **kw):
        seen.append(data)
        return real(m, data, s, ctx, **kw)
    s = _toy_schedule(fractions=(0.3, 0.3), epochs=(1, 1), lr=0.01)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(defense, "detect", lambda *a, **k: _no_target(poisoned.num_classes))
        mp.setattr(defense, "adversarial_finetune", spy)
        _, report = erase(model, poisoned, s, seed=0, progress=False)
    suspected = report["isolation"]["suspected"]
    assert report["plan"]["relabel"] == "all" and report["rounds"][0]["relabelled"] == suspected > 0
    second = seen[1]
    target_left, target_before = int((second.labels == TARGET).sum()), int((poisoned.labels == TARGET).sum())
    assert len(second) >= suspected and target_left < target_before - suspected // 2


@pytest.fixture(scope="module")
def clean_label_toy(toy):
    """Clean-label poison: every image of TARGET carries the corner, all labels true (SIG at 10 % on
    CIFAR-10 poisons the whole target label): (backdoored model, clean model, training set)."""
    model, clean, poisoned, _ = toy
    gen = torch.Generator().manual_seed(1)
    train = _textures(model.patterns.view(CLASSES, 1, 8, 8), gen)
    images = train.images.clone()
    images[train.labels == TARGET] = _corner(images[train.labels == TARGET])
    return model, clean, ImageDataset(images, train.labels, train.classes, train.name, False)


def test_isolate_names_a_whole_poisoned_label_and_its_trigger(clean_label_toy):
    """No cluster to split, so the whole-label test decides: TARGET's all-sample trigger lights the
    corner and moves the model; no sample is suspected (their labels are true); a clean model and
    `find_whole_label=False` name nothing."""
    from pbe.models import penultimate
    model, clean, data = clean_label_toy
    iso, _ = isolate(model, data.images, data.labels, penultimate(model, data.images), torch.Generator().manual_seed(0))
    assert iso.flagged == [] and not iso.suspected.any()
    assert iso.whole_label == TARGET and iso.trigger_fooling == iso.whole_fooling[TARGET] > 0.9
    assert sorted(iso.whole_fooling)[-2] < 0.4
    assert iso.trigger.apply(torch.zeros(1, 1, 8, 8))[0, 0, :2, :2].min() > 0.9
    off, _ = isolate(model, data.images, data.labels, penultimate(model, data.images),
                     torch.Generator().manual_seed(0), find_whole_label=False)
    assert off.whole_label is None and off.trigger is None and off.whole_fooling is None
    spared, _ = isolate(clean, data.images, data.labels, penultimate(clean, data.images),
                        torch.Generator().manual_seed(0))
    assert spared.whole_label is None and spared.trigger is None


def test_detect_counts_a_train_test_gap_only_where_the_whole_label_trigger_confirms_it(clean_label_toy, toy):
    """A model that learned the clean-label TARGET as the corner alone fails on its clean test images:
    the gap names it and the whole-label trigger confirms it (suspected, evidence "gap"). The same gap
    from a test set whose TARGET images show another class, on a clean model whose training images carry
    no trigger, is reported but not counted (a harder class is not a backdoor)."""
    import copy

    from pbe.detection import detect
    model, clean, data = clean_label_toy
    test = toy[3]
    learned = copy.deepcopy(model)
    with torch.no_grad():
        learned.head.weight[TARGET, TARGET] = 0  # the class is the corner, nothing of its own pattern
    found = detect(learned, test, train_data=data, budget=ScanBudget(images=100))
    assert found.gap[TARGET] == max(found.gap) > 0.9 and found.isolation["whole_label"] == TARGET
    assert found.suspected and found.label == TARGET and found.evidence == "gap"
    plain = _textures(clean.patterns.view(CLASSES, 1, 8, 8), torch.Generator().manual_seed(1))
    images = test.images.clone()
    mine, other = (test.labels == TARGET).nonzero().flatten(), (test.labels == 1).nonzero().flatten()
    images[mine] = test.images[other[:len(mine)]]
    shifted = ImageDataset(images, test.labels, test.classes, test.name, False)
    harder = detect(clean, shifted, train_data=plain, budget=ScanBudget(images=100))
    assert harder.gap[TARGET] == max(harder.gap) > 0.9 and harder.scores["gap"] > 10
    assert harder.isolation["whole_label"] is None and not harder.suspected and harder.evidence != "gap"


def test_pbe_whole_label_unlearns_the_estimated_trigger_and_never_relabels(clean_label_toy):
    """Rule 3: a whole label carrying a trigger is the target, every batch carries its estimated trigger, its
    samples stay out of both rounds and none is relabelled (their labels are true); the backdoor goes, and
    without that plan the same run keeps it."""
    import pbe.defenses.pbe as defense
    from pbe.defenses import erase
    model, _, data = clean_label_toy
    seen = []
    s = _toy_schedule(fractions=(0.3, 0.5), epochs=(4, 2), lr=0.1)

    def run(plain=False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(defense, "detect", lambda *a, **k: _no_target(data.num_classes))
            _spy_finetune(mp, seen)
            if plain:
                _nothing_found(mp)
            return erase(model, data, s, seed=0, progress=False)
    purified, report = run()
    assert report["isolation"]["whole_label"] == TARGET and report["plan"]["named_by"] == "whole label"
    assert len(seen) == 2 and all(trig is not None for trig in seen)
    assert "relabelled" not in report["rounds"][0] and report["target"] == TARGET
    for r in report["rounds"]:
        assert not (data.labels[r["subset_indices"]] == TARGET).any()
    lit = _corner(data.images[(data.labels != TARGET).nonzero().flatten()]).float() / 255
    seen.clear()
    plain, _ = run(plain=True)
    assert seen == [None, None]
    assert (predict(purified, lit) == TARGET).float().mean() < 0.3 < (predict(plain, lit) == TARGET).float().mean()


def test_a_held_back_cluster_switches_the_plan_only_when_a_round_missed_its_trigger(toy):
    """Rule 1 with a confirmed cluster in the named target: round 1 runs the optimised perturbations alone;
    after it the cluster's estimated trigger is tried on the purified model, and where it still sends
    VERIFY_REACH of held-out images to the target, round 2 takes the isolation's path (the trigger in place of
    the perturbations, the cluster refused and relabelled). Where the check does not fire, the run is the one
    without the check, bit for bit."""
    import pbe.defenses.pbe as defense
    from pbe.defenses import erase
    model, _, poisoned, _ = toy
    seen = []
    # lr so small that round 1 leaves the hand-wired backdoor in place: the check must fire
    s = _toy_schedule(fractions=(0.3, 0.3), epochs=(1, 1), lr=1e-5)

    def run(unchecked=False):
        seen.clear()
        with pytest.MonkeyPatch.context() as mp:
            _spy_finetune(mp, seen)
            if unchecked:
                real = defense.make_plan
                mp.setattr(defense, "make_plan", lambda **kw: replace(real(**kw), check_cluster=False))
            out = erase(model, poisoned, s, seed=0, progress=False, target=TARGET)
        return out, [t is not None for t in seen]
    (_, report), calls = run()
    first = report["rounds"][0]
    assert report["isolation"]["flagged"] == [TARGET] and first["trigger_reach"] >= defense.VERIFY_REACH
    assert first["switched_to_isolation"] and calls == [False, True]
    assert first["relabelled"] == report["isolation"]["suspected"] > 0  # the cluster, relabelled
    poison = torch.zeros(len(poisoned), dtype=torch.bool)
    poison[poisoned.poison_indices] = True
    round2 = torch.tensor(report["rounds"][1]["subset_indices"])
    assert (poisoned.labels[round2] == TARGET).any() and poison[round2].any()  # clean target back, poison relabelled
    with pytest.MonkeyPatch.context() as mp:  # a check that never fires: the run without the check
        mp.setattr(defense, "VERIFY_REACH", 1.01)
        (kept, report), calls = run()
    assert "trigger_reach" in report["rounds"][0] and "switched_to_isolation" not in report["rounds"][0]
    assert calls == [False, False]
    (plain, _), _ = run(unchecked=True)
    assert all(torch.equal(a, b) for a, b in zip(kept.state_dict().values(), plain.state_dict().values()))
