"""Is poison rare among a target label's hardest samples? For every built infected zoo model (all-to-one), the
target label's training samples ranked by their loss under the infected model, and the poison among the k hardest,
k a share of the median label count -> experiments/results/hardest_target_samples.{json,md}.

The question behind it: trusting the hardest target samples (poison is fitted tightest, Li et al., NeurIPS 2021)
gives PBE clean target images to fine-tune on and keeps the target's recall on the LeNets
(``lenet_overerasure.md``: ``trust_hardest_*``); it is safe only where the hardest samples are clean on every
model. Forward passes only; seed-free.

    python experiments/hardest_target_samples.py [--only cifar10/badnets ...]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import RESULTS, provenance

from pbe import zoo
from pbe.defenses.pbe import typical_count
from pbe.metrics import predict
from pbe.utils import write_json

SHARES = (0.1, 0.25, 0.5, 1.0)  # k as a share of the median label count


def measure(name: str) -> dict | None:
    entry = zoo.get(name)
    if not entry.infected or entry.all_to_all:
        return None
    z = zoo.load(name)
    data, target = z.train_set, z.attack.target
    idx = (data.labels == target).nonzero().flatten()
    logits = predict(z.model, data.images[idx], return_logits=True)
    loss = F.cross_entropy(logits, data.labels[idx], reduction="none")
    poison = torch.zeros(len(data), dtype=torch.bool)
    poison[data.poison_indices] = True
    ranked = poison[idx][loss.argsort(descending=True)]
    typical = typical_count(data.labels, target)
    hardest = {str(q): {"k": min(len(idx), round(q * typical)),
                        "poison": int(ranked[:min(len(idx), round(q * typical))].sum())} for q in SHARES}
    return {"zoo": name, "zoo_set": entry.set, "attack": entry.attack, "target": target,
            "label_samples": len(idx), "label_poison": int(poison[idx].sum()), "typical": typical,
            "hardest": hardest, **provenance(f"python experiments/hardest_target_samples.py --only {name}")}


def markdown(rows: list[dict]) -> str:
    head = " | ".join(f"poison among the {q:g} x median hardest" for q in SHARES)
    lines = ["# Poison among a target label's hardest samples", "",
             "Regenerate: `python experiments/hardest_target_samples.py`. The target label's training samples ranked "
             "by the infected model's loss; *k x median*: the k hardest, k a share of the median label count. "
             "Trusting them is safe only where the count is near 0 on every model.", "",
             f"| zoo | set | attack | target samples (poison) | median label | {head} |",
             "|---|---|---|---|---|" + "---|" * len(SHARES)]
    for r in rows:
        cells = " | ".join(f"{h['poison']} of {h['k']} ({100 * h['poison'] / max(1, h['k']):.0f} %)"
                           for h in r["hardest"].values())
        lines.append(f"| {r['zoo']} | {r['zoo_set']} | {r['attack']} | {r['label_samples']} ({r['label_poison']}) | "
                     f"{r['typical']:.0f} | {cells} |")
    hardware = sorted({r["hardware"] for r in rows})
    return "\n".join(lines + ["", f"Hardware: {'; '.join(hardware)}."])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="zoo names (default: every built infected dev model)")
    names = parser.parse_args().only or [n for n, e in zoo.entries().items() if e.set == "dev" and zoo.is_built(n)]
    rows = [r for r in map(measure, names) if r is not None]
    write_json(RESULTS / "hardest_target_samples.json", rows)
    (RESULTS / "hardest_target_samples.md").write_text(markdown(rows) + "\n")
    for r in rows:
        print(r["zoo"], {q: f"{h['poison']}/{h['k']}" for q, h in r["hardest"].items()}, flush=True)


if __name__ == "__main__":
    main()
