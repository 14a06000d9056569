"""PBE's levers, one named variant at a time, on the CIFAR-10 dev-set zoo models (no clean data)
-> experiments/results/pbe_ablation_cifar10.{json,md} (GTSRB's with `--dataset gtsrb` / the config key
`dataset`: pbe_ablation_gtsrb.{json,md}). Every lever tried stays in the table, the
failures included. Resumable: (model, variant) cells with a row on the committed weights are skipped.

    python experiments/pbe_ablation_cifar10.py [--only badnets] [--variants fast uni_l2] [--seed 0]

Variants are changes to a registered schedule (``pbe.defenses.SCHEDULES``); the generalisation set is
never run here (tuning must not look at it).
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from common import RESULTS, built_zoo_models, zoo_cell
from grid import Cell, execute, median_cost, script_main

from pbe import zoo
from pbe.defenses import SCHEDULES, Evaluation, erase
from pbe.results import ResultsTable, fixed, pct
from pbe.utils import PBEError, hardware_string, toolkit_version

FAST = SCHEDULES["fast"]
DEFAULT = SCHEDULES["targeted"]
# the variant rows that run the default's code path on their model (each later lever acts only where the
# earlier ones found nothing): the per-round figure's curves
DEFAULT_PATH = ("targeted_relabel", "relabel_all_isolated", "whole_label_exclude")
ORACLE = "oracle"  # variants whose name ends so are given the true target (what the erasure could do if
#                    detection named it); they measure the erasure alone and are never a default

# name -> (what it changes, the schedule): the variants today's code can run. The table keeps the rows of every
# variant ever tried; a row whose variant is not here was made by the code of its toolkit_version (its `what`
# says what it changed) and is history: rerun it from that commit.
VARIANTS = {
    "fast": ("the paper's untargeted method, short (SCHEDULES['fast']): two rounds, PGD-4, early stop", FAST),
    "fast_lr1e-3": ("authors' lr 1e-3", replace(FAST, lr=1e-3)),
    "fast_keep_adv": ("adversarial batches in every round", replace(FAST, adv_batches=(None, None))),
    "ranked_mask_warm": ("the default (SCHEDULES['targeted']), found as readmit_auto + ranked readmission (round 2 "
                         "readmits the median label's count of the target's samples, those the purified model gives "
                         "the target the highest probability, with their label: lenet_overerasure's readmit_ranked) "
                         "+ a mask family beside L2 and warp (mask_family) + each epoch after a round's first "
                         "continuing the last perturbation for one pass (universal_refresh 1) + no monitor",
                         DEFAULT),
    "ranked_mask_warm_oracle": ("the default given the true target (oracle: the erasure alone)", DEFAULT),
    "no_mask": ("the default without the mask family (additive L2 and warp only)",
                replace(DEFAULT, families=tuple(f for f in DEFAULT.families if f.kind != "mask"))),
    "fresh_universal": ("the default re-optimising every epoch's perturbations from a fresh start (universal_refresh "
                        "None: 5 passes over 512 images per family and epoch)",
                        replace(DEFAULT, universal_refresh=None)),
    "paper": ("the authors' schedule (~21 epoch-equivalents)", SCHEDULES["paper"]),
}


# variants whose rows were made by code that no longer holds their levers (the library keeps what ships): their
# rows stay in the tables as the story of how the default was found; each row's toolkit_version names the commit
# to rerun it from
HISTORY = ("readmit_auto", "default_oracle", "scan_pass1", "no_augment", "no_calibration", "lr3e-4", "mask_family",
           "both_families", "cap_target", "cheap_scan", "fast_half_adv_lr1e-3", "isolate_named", "named_trigger",
           "no_readmit", "recal", "relabel_all_isolated", "t2", "t2_pgdt_oracle", "t3", "t3_warp_oracle", "t4",
           "t_cos_oracle", "targeted_isolate", "targeted_oracle", "targeted_relabel", "targeted_v1", "targeted_v2",
           "top", "uni_l2", "uni_l2_clean", "uni_l2_clean_refuse", "uni_patch", "uni_t_refuse", "uni_t_refuse_pgd",
           "uni_t_refuse_stop", "uni_t_refuse_stop_cos", "untargeted_mask", "verify_named", "whole_label_exclude",
           "whole_label_refuse", "whole_label_trigger", "whole_label_trigger_half")


class AblationTable(ResultsTable):
    note = (". ACC / ASR in %, no clean data (a clean model has no ASR). Ranking AUC: how well the final round's score "
            "separates poison (1 = perfect). What each variant changes is listed before the rows.")

    def columns(self):
        return [("zoo", lambda r: r["zoo"]), ("variant", lambda r: r["variant"]),
                ("ACC before", lambda r: pct(r["acc_before"])), ("ASR before", lambda r: pct(r["asr_before"])),
                ("ACC", lambda r: pct(r["acc"])), ("ASR", lambda r: pct(r["asr"])),
                ("ACC drop", lambda r: fixed(100 * (r["acc_before"] - r["acc"]))),
                ("DER", lambda r: pct(r.get("der"), 1)),
                ("ranking AUC", lambda r: fixed((r.get("detection") or {}).get("auc"), 3)),
                ("epoch-eq.", lambda r: fixed(r["epoch_equivalents"])), ("wall s", lambda r: fixed(r["wall_s"], 0))]

    def figure(self):
        """PBE's per-round curves: ASR and ACC before, after round 1 and after round 2 of the default's code
        path on each dev model (the variant rows that run it there, DEFAULT_PATH)."""
        from pbe.plots import _plt
        rows = [r for r in self.rows if r["variant"] in DEFAULT_PATH and r["asr"] is not None]
        if not rows:
            return None
        plt = _plt()
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for i, r in enumerate(rows):
            rounds = [0] + [p["round"] for p in r["per_round"]]
            for ax, key in zip(axes, ("asr", "acc")):
                ax.plot(rounds, [100 * r[f"{key}_before"]] + [100 * p["metrics"][key] for p in r["per_round"]],
                        marker="o", color=f"C{i}", label=f"{r['zoo'].split('/')[-1]} ({r['variant']})")
        axes[0].set(xlabel="round (0: the infected model)", ylabel="ASR %", title="attack success, per round")
        axes[1].set(xlabel="round (0: the infected model)", ylabel="ACC %", title="clean accuracy, per round")
        axes[0].legend(fontsize=7)
        for ax in axes:
            ax.set_xticks([0, 1, 2])
        fig.tight_layout()
        return fig

    def summary(self) -> str:
        what = {}  # the script's description where the variant is still defined, else the row's
        for r in self.rows:
            what.setdefault(r["variant"], VARIANTS[r["variant"]][0] if r["variant"] in VARIANTS else r["what"])
        history = [v for v in HISTORY if v in what]
        return ("Variants (the story of how the default was found: each row's text says what its variant changed, "
                "in the words of when it ran):\n\n" + "\n".join(f"- **{v}**: {w}" for v, w in what.items())
                + ("\n\nHistory: " + ", ".join(history) + " ran on code that no longer holds their levers (the "
                   "library keeps what ships); each row's toolkit_version names the commit to rerun it from."
                   if history else ""))


def _dataset_flag(dataset: str) -> str:
    """The command-line flag that selects `dataset` (none for the default, CIFAR-10)."""
    if dataset not in DATASET_NAMES:
        raise PBEError(f"pbe_ablation_cifar10: dataset must be one of {', '.join(DATASET_NAMES)}, got {dataset!r}")
    return "" if dataset == "cifar10" else f" --dataset {dataset}"


def results_table(cfg: dict | None = None) -> AblationTable:
    """This script's table (``experiments/render.py`` re-renders it); one per dataset (`dataset` key)."""
    dataset = (cfg or {}).get("dataset", "cifar10")
    flag = _dataset_flag(dataset)  # (checks the name first)
    return AblationTable(RESULTS / f"pbe_ablation_{dataset}", f"PBE ablation on the {DATASET_NAMES[dataset]} dev zoo",
                         "python experiments/pbe_ablation_cifar10.py" + flag)


# "pairs": only these "zoo-name variant" cells (the table's own list: the variants were tried where they
# mattered, not on every model); without it, every variant on every model `only` selects
CONFIG = {"only": None, "variants": [v for v in VARIANTS if v != "paper"], "seeds": [0], "pairs": None,
          "dataset": "cifar10"}
DATASET_NAMES = {"cifar10": "CIFAR-10", "gtsrb": "GTSRB"}
DEFAULT_ESTIMATE = 3.0  # epoch-equivalents of a variant without a row yet (PBE's cost goal)


def cells(cfg: dict) -> list[Cell]:
    table = results_table(cfg)
    history = set(HISTORY)  # their rows stay; today's code cannot rerun them
    unknown = set(cfg["variants"]) - set(VARIANTS) - history
    if unknown:
        raise PBEError(f"pbe_ablation_cifar10: unknown variants {sorted(unknown)}; see VARIANTS in the script")
    out = []
    # clean models too: what the defaults cost a model that has no backdoor (ACC only)
    pairs = None if cfg["pairs"] is None else {tuple(p.split()) for p in cfg["pairs"] if p.split()[1] not in history}
    unknown = set() if pairs is None else {v for _, v in pairs} - set(VARIANTS)
    if unknown:
        raise PBEError(f"pbe_ablation_cifar10: unknown variants in pairs: {sorted(unknown)}")
    for entry in built_zoo_models("dev", cfg["dataset"], cfg["only"], infected=False):
        for variant in [v for v in cfg["variants"] if v in VARIANTS] if pairs is None else \
                [v for n, v in sorted(pairs) if n == entry.name]:
            if variant.endswith(ORACLE) and (not entry.infected or entry.all_to_all or entry.target is None):
                continue  # no single target to give
            for seed in cfg["seeds"]:
                out.append(Cell("pbe_ablation_cifar10", f"{entry.name} {variant} seed {seed}",
                                zoo_cell(entry, "pbe", "no-clean", seed, schedule=f"ablation:{variant}"),
                                {"name": entry.name, "variant": variant, "seed": seed},
                                median_cost(table, DEFAULT_ESTIMATE, variant=variant), zoo=entry.name))
    return out


def run_cell(name: str, variant: str, seed: int) -> dict:
    """One row: PBE with one variant's schedule on a dev-set zoo model (oracle variants: given the target)."""
    entry = zoo.get(name)
    z = zoo.load(name)
    what, schedule = VARIANTS[variant]
    oracle = variant.endswith(ORACLE)
    _, report = erase(z.model, z.train_set, schedule, seed=seed, progress=False,
                      evaluation=Evaluation(z.test_set, z.attack, getattr(z.train_set, "poison_indices", None)),
                      target=z.attack.target if oracle else None)
    b, a = report["before"], report["after"]
    asr = "" if b["asr"] is None else f" asr {b['asr']:.4f}->{a['asr']:.4f}"
    print(f"{name} {variant}: acc {b['acc']:.4f}->{a['acc']:.4f}{asr} "
          f"ee {report['epoch_equivalents']:.2f} wall {report['wall_s']:.0f}s", flush=True)
    return {**zoo_cell(entry, "pbe", "no-clean", seed, schedule=f"ablation:{variant}"),
            "acc": a["acc"], "asr": a["asr"], "ra": a["ra"], "acc_before": b["acc"],
            "asr_before": b["asr"], "ra_before": b["ra"], "der": report.get("der"),
            "detection": report["rounds"][-1].get("detection"), "wall_s": report["wall_s"],
            "epoch_equivalents": report["epoch_equivalents"],
            "command": f"python experiments/pbe_ablation_cifar10.py --only {name} --variants {variant} --seed {seed}"
                       + _dataset_flag(entry.dataset),
            "hardware": hardware_string(), "toolkit_version": toolkit_version(),
            "zoo_sha256": z.row["sha256"], "variant": variant, "what": what,
            "schedule_fields": report["schedule"], "stopped_early": report["stopped_early"],
            "per_round": [{k: rd.get(k) for k in ("round", "subset_size", "metrics", "detection",
                                                   "epoch_equivalents", "relabelled", "relabelled_poison")}
                          for rd in report["rounds"]],
            "scan": report.get("scan"), "acc_drop_estimate": report.get("acc_drop_estimate"),
            "universal_calibration": report.get("universal_calibration"),
            "isolation": report.get("isolation"), "target_given": oracle, "target_used": report.get("target"),
            "trigger_reach": [rd.get("trigger_reach") for rd in report["rounds"]],
            "switched_to_isolation": any(rd.get("switched_to_isolation") for rd in report["rounds"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="dev-set zoo names or attacks")
    ap.add_argument("--variants", nargs="*", default=CONFIG["variants"], choices=list(VARIANTS))
    ap.add_argument("--seed", type=int, default=0, help="seed of the defence")
    ap.add_argument("--dataset", default="cifar10", choices=list(DATASET_NAMES), help="whose dev-set zoo models")
    args = ap.parse_args()
    execute({"script": "pbe_ablation_cifar10", "only": args.only, "variants": args.variants, "seeds": [args.seed],
             "dataset": args.dataset}, progress=False)


if __name__ == "__main__":
    script_main(main)
