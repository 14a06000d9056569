"""Diagnostic: ABL's unlearning stage alone, given the exact poison (oracle isolation), on an infected zoo
model. Which unlearning step removes the backdoor when isolation is perfect: the ABL authors' (5 epochs,
lr 5e-4, batch 64, no augmentation) or BackdoorBench's code's (20 epochs, lr 1e-4, batch 256, cropped and flipped),
each with BatchNorm on batch statistics (both codes) and frozen (running statistics)?

Gradient ascent of the cross-entropy on `--n` poison training images drawn with `--seed`, starting from the
infected model; ACC / ASR on `--test` test images (the same draw for every variant) after 0, 1, 2, 4, 8,
16 epochs and the last. Writes experiments/results/abl_oracle_unlearning.{json,md}.

    python experiments/abl_oracle_unlearning.py [--zoo cifar10/badnets] [--n 500] [--test 2000] [--seed 0]
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import torch
import torch.nn as nn

from common import RESULTS
from grid import script_main
from pbe import checkpoint, data, zoo
from pbe.cli.defend import _poisoned_from
from pbe.defenses.abl import ascent, traced_epoch
from pbe.defenses.base import Context, sgd_finetune
from pbe.metrics import evaluate
from pbe.utils import PBEError, atomic_path, hardware_string, seed_everything, toolkit_version, write_json

# name -> (epochs, lr, batch size, augmentation (crop padding 4 and flips, as BackdoorBench's CIFAR-10 training
# transform but its 10-degree rotation), BatchNorm frozen)
VARIANTS = {"authors": (5, 5e-4, 64, False, False), "authors_frozen_bn": (5, 5e-4, 64, False, True),
            "backdoorbench": (20, 1e-4, 256, True, False), "backdoorbench_frozen_bn": (20, 1e-4, 256, True, True)}
CROP_PADDING = 4
MOMENTUM, WEIGHT_DECAY = 0.9, 1e-4  # both codes' SGD (Nesterov)


def frozen_bn_ascent(model, x, y):
    """The ascent with every BatchNorm on its running statistics (sgd_finetune puts the model in training mode)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    return ascent(model, x, y)


def unlearn(model, suspects, test, attack, variant: str, seed: int) -> list[dict]:
    epochs, lr, batch, augmented, frozen = VARIANTS[variant]
    model, suspects = copy.deepcopy(model), dataclasses.replace(suspects, flip=augmented)
    trace = []

    def traced(done: int) -> None:
        if traced_epoch(done, epochs):
            r = evaluate(model, test, attack)
            trace.append({"epochs": done, "acc": r["acc"], "asr": r["asr"]})
    ctx = Context(torch.device("cpu"), seed_everything(seed), seed, False)
    sgd_finetune(model, suspects, ctx, epochs=epochs, lr=lr, batch_size=batch, momentum=MOMENTUM,
                 weight_decay=WEIGHT_DECAY, crop_padding=CROP_PADDING if augmented else 0, lr_schedule="constant",
                 nesterov=True, loss_fn=frozen_bn_ascent if frozen else ascent, on_epoch=traced)
    traced(epochs)
    return trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", default="cifar10/badnets")
    ap.add_argument("--n", type=int, default=500, help="poison images unlearned (ABL isolates 1 %%: 500)")
    ap.add_argument("--test", type=int, default=2000, help="test images measured")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    entry = zoo.get(args.zoo)
    root = zoo.default_data_root(entry.dataset)
    if root is None:
        raise PBEError(f"{entry.dataset} is not under ../shared/data; see that folder's README")
    model, _ = checkpoint.load(entry.folder)
    poisoned, attack = _poisoned_from(entry.folder, data.load(entry.dataset, root, "train"))
    gen = torch.Generator().manual_seed(args.seed)
    pick = torch.randperm(len(poisoned.poison_indices), generator=gen)[:args.n]
    suspects = poisoned.subset(poisoned.poison_indices[pick].sort().values)
    test = data.load(entry.dataset, root, "test")
    test = test.subset(torch.randperm(len(test), generator=gen)[:args.test].sort().values)
    rows = []
    for variant in VARIANTS:
        start = time.time()
        trace = unlearn(model, suspects, test, attack, variant, args.seed)
        rows.append({"zoo": args.zoo, "variant": variant, "params": dict(zip(
            ("epochs", "lr", "batch_size", "augmented", "frozen_bn"), VARIANTS[variant])), "trace": trace,
            "wall_s": round(time.time() - start, 1)})
        print(variant, [(t["epochs"], round(100 * t["acc"], 1), round(100 * t["asr"], 1)) for t in trace], flush=True)
    command = (f"python experiments/abl_oracle_unlearning.py --zoo {args.zoo} --n {args.n} --test {args.test} "
               f"--seed {args.seed}")
    meta = {"command": command, "seed": args.seed, "hardware": hardware_string(), "toolkit_version": toolkit_version()}
    write_json(RESULTS / "abl_oracle_unlearning.json", {**meta, "rows": rows})
    lines = ["# ABL's unlearning alone, given the exact poison", "",
             f"`{command}` ({meta['hardware']}, toolkit {meta['toolkit_version']}): gradient ascent on {args.n} "
             f"poison training images of `{args.zoo}`, from the infected model; ACC / ASR in % on {args.test} test "
             "images after each number of epochs.", "",
             "| variant | epochs | lr | batch | crop and flip | BatchNorm | ACC / ASR after n epochs | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["params"]
        steps = ", ".join(f"{t['epochs']}: {100 * t['acc']:.1f} / {100 * t['asr']:.1f}" for t in r["trace"])
        lines.append(f"| {r['variant']} | {p['epochs']} | {p['lr']:g} | {p['batch_size']} | "
                     f"{'yes' if p['augmented'] else 'no'} | {'running' if p['frozen_bn'] else 'batch'} statistics | "
                     f"{steps} | {r['wall_s']:.0f} |")
    with atomic_path(RESULTS / "abl_oracle_unlearning.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    script_main(main)
