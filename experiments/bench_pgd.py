"""Benchmark: images/second of untargeted L-inf PGD with the native and foolbox backends on the same
model and data, and their ratio (the native backend must not be slower). Prints one JSON line.

    python experiments/bench_pgd.py [--model preact_resnet18 --width 16 --n 512 --steps 10]
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch
from grid import script_main

from pbe import models
from pbe.adversarial import PGDConfig, adversarial_examples, success_rate
from pbe.utils import hardware_string, use_all_cpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="preact_resnet18")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    use_all_cpus()
    torch.manual_seed(0)
    model = models.create(args.model, 10, 3, dataset="cifar10", width=args.width).eval()
    model = model.to(memory_format=torch.channels_last)  # as pbe.train leaves it
    x = torch.rand(args.n, 3, 32, 32)
    y = torch.randint(0, 10, (args.n,))
    cfg = PGDConfig(eps=8 / 255, steps=args.steps, step=2 / 255)
    result = {"model": models.describe(model), "images": args.n, "steps": args.steps, "hardware": hardware_string()}
    backends = ("native", "foolbox")
    best = {b: float("inf") for b in backends}
    for b in backends:  # warm-up at the measured batch size
        adversarial_examples(model, x[:128], y[:128], replace(cfg, backend=b), batch_size=128)
    for _ in range(args.repeats):  # interleaved, best of repeats: a noisy machine hits both alike
        for b in backends:
            t = time.perf_counter()
            adv = adversarial_examples(model, x, y, replace(cfg, backend=b), batch_size=128)
            best[b] = min(best[b], time.perf_counter() - t)
            result[f"{b}_success"] = success_rate(model, adv, y)
    for b in backends:
        result[f"{b}_images_per_s"] = round(args.n / best[b], 1)
    result["native_over_foolbox"] = round(result["native_images_per_s"] / result["foolbox_images_per_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    script_main(main)
