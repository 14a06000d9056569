"""AFT's default run for its full epochs without stopping, its check after every `check_every` epochs recorded with
the true ACC / ASR at that moment -> experiments/results/aft_checks.{json,md}.

What it answers: how many epochs AFT's targeted schedule needs on each dev model, what each check costs, and whether
the erasure tracker's "gone" at a check (AFT's stop rule: ``stop_after`` such readings in a row) comes only once the
ASR is at the goal's 2 %. The clean set is the one ``pbe erase --setting clean-extra`` draws (5 % of the clean
training set, seed 0); the test set and the attack measure every check (``Evaluation``), never the defence.

    python experiments/aft_checks.py [--only cifar10/badnets ...] [--variants default no_mask] [--epochs 20]

Variants, levers joined by "+": ``default`` (AFT's targeted schedule as it ships, run without a stop); ``no_mask``
(without the mask family: additive L2 and warp only); ``fresh`` (every epoch's perturbations from a fresh start,
``universal_refresh=None``). The rows of ``no_mask+fresh`` and ``fresh`` were made when those were the default.
"""
from __future__ import annotations

import contextlib
import functools
import importlib

from common import built_zoo_models, provenance, run_missing, zoo_parser

import pbe.zoo
from pbe.data import load as load_data
from pbe.cli.defend import CLEAN_FRACTION, clean_indices
from pbe.defenses import Evaluation
from pbe.utils import Cost

A = importlib.import_module("pbe.defenses.aft")  # the module (pbe.defenses.aft is also a function's name)
AFT_GOAL_ASR = 0.02  # AFT's goal ASR (PBE's is 3 %: it has no clean data)
NEVER = 10_000  # a stop_after no run reaches: the stop rule off
STOP_AFTER = 2  # the stop rule the table examines (AFT's stop_after, its default until these rows)
VARIANTS = ("default", "no_mask", "fresh", "no_mask+fresh")


@contextlib.contextmanager
def variant_schedule(variant: str):
    """AFT builds its Schedule inside ``_targeted``: the variant's settings given there for the run."""
    real, levers, changes = A.Schedule, set(variant.split("+")) - {"default"}, {}
    if "no_mask" in levers:
        changes["families"] = tuple(f for f in real().families if f.kind != "mask")
    if "fresh" in levers:
        changes["universal_refresh"] = None
    if changes:
        A.Schedule = functools.partial(real, **changes)
    try:
        yield
    finally:
        A.Schedule = real


def run(zoo: str, variant: str, epochs: int) -> dict:
    name = zoo
    entry, z = pbe.zoo.get(name), pbe.zoo.load(name)
    clean_train = load_data(entry.dataset, pbe.zoo.default_data_root(entry.dataset), "train")
    clean = clean_train.subset(clean_indices(len(clean_train), CLEAN_FRACTION, 0))  # as `pbe erase` draws it
    with variant_schedule(variant):
        result = A.AFT(epochs=epochs, stop_after=NEVER)(z.model, clean, seed=0, progress=False,
                                                       evaluation=Evaluation(z.test_set, z.attack, None),
                                                       train_size=len(clean_train))
    rep, n = result.report, len(clean_train)
    checks = [{"epochs": c["epochs"], "there": c["tracker"]["there"], "score": c["tracker"].get("score"),
               "reach": c["tracker"].get("reach"), "check_acc_drop": c["check_acc_drop"],
               "acc": c["metrics"]["acc"], "asr": c["metrics"]["asr"],
               "epoch_equivalents": round(Cost(**c["passes"]).epoch_equivalents(n), 4)} for c in rep["check"]]
    return {"zoo": name, "variant": variant, "target": z.attack.target, "named": rep["target"],
            "acc_before": rep["before"]["acc"], "asr_before": rep["before"]["asr"],
            "tracker_before": rep["tracker_before"], "checks": checks, "epoch_equivalents": rep["epoch_equivalents"],
            "wall_s": rep["wall_s"], "seed": 0,
            **provenance(f"python experiments/aft_checks.py --only {name} --variants {variant} --epochs {epochs}")}


def would_stop(checks: list[dict], stop_after: int) -> int | None:
    """The index of the check where AFT's stop rule (`stop_after` "gone" readings in a row) would stop."""
    gone = 0
    for i, c in enumerate(checks):
        gone = 0 if c["there"] else gone + 1
        if gone >= stop_after:
            return i
    return None


def markdown(rows: list[dict]) -> str:
    stop_after = STOP_AFTER
    lines = ["# AFT's checks against the true ASR, without stopping", "",
             "Regenerate: `python experiments/aft_checks.py` (seed 0, 5 % clean data; see its docstring). Per check: "
             "ACC / ASR in %, the tracker's reading (there / gone), the held-out clean images' ACC drop in points, and "
             f"the epoch-equivalents spent so far. **Bold**: where a stop rule of {stop_after} \"gone\" in a row "
             f"(`stop_after={stop_after}`) would stop. Goal: ASR <= {100 * AFT_GOAL_ASR:g} %, ACC drop <= 1 point, "
             "<= 2 epoch-equivalents.", ""]
    for r in rows:
        stop = would_stop(r["checks"], stop_after)
        lines += [f"## {r['zoo']} ({r['variant']})", "",
                  f"Target {r['target']}, named {r['named']}; before: ACC {100 * r['acc_before']:.2f}, ASR "
                  f"{100 * r['asr_before']:.2f}; tracker before: {'there' if r['tracker_before']['there'] else 'gone'}."
                  f" `{r['command']}` ({r['hardware']}).", "",
                  "| epochs | ACC | ASR | tracker | check ACC drop | epoch-eq. |", "|---|---|---|---|---|---|"]
        for i, c in enumerate(r["checks"]):
            cells = [str(c["epochs"]), f"{100 * c['acc']:.2f}", f"{100 * c['asr']:.2f}",
                     "there" if c["there"] else "gone", f"{100 * c['check_acc_drop']:.2f}",
                     f"{c['epoch_equivalents']:.2f}"]
            if i == stop:
                cells = [f"**{v}**" for v in cells]
            lines.append("| " + " | ".join(cells) + " |")
        wrong = [c for c in r["checks"] if not c["there"] and c["asr"] > AFT_GOAL_ASR]
        lines += ["", f"Wrong \"gone\" (ASR above {100 * AFT_GOAL_ASR:g} %): {len(wrong)} of "
                      f"{sum(not c['there'] for c in r['checks'])} \"gone\" readings.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = zoo_parser(__doc__, "zoo names (default: the CIFAR-10 dev set's infected models)")
    ap.add_argument("--variants", nargs="*", default=["default"], choices=VARIANTS)
    ap.add_argument("--epochs", type=int, default=A.AFT.defaults["epochs"])
    args = ap.parse_args()
    names = args.only or [e.name for e in built_zoo_models("dev", "cifar10", None)]
    run_missing("aft_checks", [{"zoo": n, "variant": v} for n in names for v in args.variants],
                functools.partial(run, epochs=args.epochs), markdown,
                lambda r: f"{r['zoo']} {r['variant']}: " + ", ".join(f"{c['epochs']}: {100 * c['asr']:.2f}"
                                                                    for c in r["checks"]))

if __name__ == "__main__":
    main()
