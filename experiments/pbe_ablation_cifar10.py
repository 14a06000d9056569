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
from pbe.adversarial import PGDConfig, UniversalConfig
from pbe.defenses import SCHEDULES, Evaluation, erase
from pbe.results import ResultsTable, fixed, pct
from pbe.utils import PBEError, hardware_string, toolkit_version

FAST = SCHEDULES["fast"]
UNI_L2 = UniversalConfig(kind="l2", eps=4.0)
UNI_PATCH = UniversalConfig(kind="patch", size=5)
UNI_L2_T = UniversalConfig(kind="l2", eps=1.0)  # the detection scan's budget

# uni_t_refuse_stop_cos, the best so far on BadNets and Blend: the base of the later variants
T_COS = replace(FAST, adv_share=0.0, universal=UNI_L2_T, universal_share=1 / 3, lr=1e-3, lr_schedule="cosine",
                adv_batches=(None, None), early_stop=True, universal_target=True, refuse_suspected=True)
PGD_T = PGDConfig(eps=2 / 255, steps=5, step=0.5 / 255)  # targeted per-image: where WaNet's target stands out
T2 = replace(T_COS, balanced=True, universal_reach=0.8)
T2_PGDT = replace(T2, adv_share=1 / 3, pgd=PGD_T, pgd_targeted=True)
T3 = replace(T2, early_stop=False)
UNI_WARP = UniversalConfig(kind="warp", eps=0.5, size=4)  # a WaNet-shaped field: 4x4 control grid, 0.5 px
# Neural Cleanse's trigger, 1 % of the pixels
UNI_MASK = UniversalConfig(kind="mask", eps=0.01, epochs=4, batch_size=16)
TARGETED_V7 = replace(SCHEDULES["targeted"], readmit_target="predicted")  # before "auto" readmission joined it
TARGETED_V6 = replace(TARGETED_V7, verify_named=False)  # before the check of a named target's cluster
TARGETED_V5 = replace(TARGETED_V6, whole_label="off")  # before the whole-label test joined it
TARGETED_V4 = replace(TARGETED_V5, relabel_all_isolated=False)  # before every isolated sample was relabelled
TARGETED_V3 = replace(TARGETED_V4, isolate=False)  # the default before isolation joined it
TARGETED_V2 = replace(TARGETED_V3, relabel_suspected=False)  # the default before relabelling joined it
# the variant rows that run the default's code path on their model (each later lever acts only where the
# earlier ones found nothing): the per-round figure's curves
DEFAULT_PATH = ("targeted_relabel", "relabel_all_isolated", "whole_label_exclude")
ORACLE = "oracle"  # variants whose name ends so are given the true target (what the erasure could do if
#                    detection named it); they measure the erasure alone and are never a default

# name -> (what it changes, the schedule)
VARIANTS = {
    "fast": ("the default", FAST),
    "fast_lr1e-3": ("authors' lr 1e-3", replace(FAST, lr=1e-3)),
    "fast_keep_adv": ("adversarial batches in every round", replace(FAST, adv_batches=(None, None))),
    "fast_half_adv_lr1e-3": ("half of each adversarial batch stays clean, lr 1e-3",
                             replace(FAST, adv_share=0.5, lr=1e-3, adv_batches=(None, None))),
    "uni_l2": ("universal L2 4 on half of every batch + PGD on the other half, lr 1e-3, no early stop",
               replace(FAST, adv_share=0.5, universal=UNI_L2, universal_share=0.5, lr=1e-3,
                       adv_batches=(None, None), early_stop=False)),
    "uni_patch": ("universal 5x5 patch on half of every batch + PGD on the other half, lr 1e-3, no early stop",
                  replace(FAST, adv_share=0.5, universal=UNI_PATCH, universal_share=0.5, lr=1e-3,
                          adv_batches=(None, None), early_stop=False)),
    "uni_l2_clean": ("universal L2 4 on a third of every batch, the rest clean (no PGD), lr 1e-3",
                     replace(FAST, adv_share=0.0, universal=UNI_L2, universal_share=1 / 3, lr=1e-3,
                             adv_batches=(None, None), early_stop=False)),
    "uni_l2_clean_refuse": ("uni_l2_clean + refuse the suspected label's samples (round 1: all of them)",
                            replace(FAST, adv_share=0.0, universal=UNI_L2, universal_share=1 / 3, lr=1e-3,
                                    adv_batches=(None, None), early_stop=False, refuse_suspected=True)),
    "fast_refuse": ("the default + refuse the suspected label's samples (round 1: all of them)",
                    replace(FAST, refuse_suspected=True)),
    "uni_t_refuse": ("universal L2 1 targeted at the scan's suspected label on a third of every batch, the rest "
                     "clean, lr 1e-3, refuse the suspected label's samples",
                     replace(FAST, adv_share=0.0, universal=UNI_L2_T, universal_share=1 / 3, lr=1e-3,
                             adv_batches=(None, None), early_stop=False, universal_target=True,
                             refuse_suspected=True)),
    "uni_t_refuse_pgd": ("uni_t_refuse + PGD on another third of every batch",
                         replace(FAST, adv_share=1 / 3, universal=UNI_L2_T, universal_share=1 / 3, lr=1e-3,
                                 adv_batches=(None, None), early_stop=False, universal_target=True,
                                 refuse_suspected=True)),
    "uni_t_refuse_stop": ("uni_t_refuse + early stop when the scan no longer suspects the label",
                          replace(FAST, adv_share=0.0, universal=UNI_L2_T, universal_share=1 / 3, lr=1e-3,
                                  adv_batches=(None, None), early_stop=True, universal_target=True,
                                  refuse_suspected=True)),
    "uni_t_refuse_stop_cos": ("uni_t_refuse_stop + lr cosine-annealed to 0 within each round",
                              replace(FAST, adv_share=0.0, universal=UNI_L2_T, universal_share=1 / 3, lr=1e-3,
                                      lr_schedule="cosine", adv_batches=(None, None), early_stop=True,
                                      universal_target=True, refuse_suspected=True)),
    "t_cos_oracle": ("uni_t_refuse_stop_cos given the true target (oracle: the erasure alone)", T_COS),
    "t_cos_pgdt_oracle": ("t_cos_oracle + PGD targeted at the target (L-inf 2/255, 5 steps) on another third of "
                          "every batch", replace(T_COS, adv_share=1 / 3, pgd=PGD_T, pgd_targeted=True)),
    "t_cos_bal": ("uni_t_refuse_stop_cos + class-balanced selection in later rounds", replace(T_COS, balanced=True)),
    "t2": ("uni_t_refuse_stop_cos + class-balanced selection + the universal budget doubled until it reaches 80 % "
           "of held-out images (detection 3: + per-image probe, noise-floored MAD)",
           T2),
    "t2_pgdt": ("t2 + PGD targeted at the suspected label (L-inf 2/255, 5 steps) on another third of every batch",
                T2_PGDT),
    "t3": ("t2 without early stop (on Input-aware the re-scan stopped t2 after round 1 at ASR 6.5 %)", T3),
    "t3_warp_oracle": ("t3 with a universal warp (4x4 control grid, 0.5 px, doubled until it reaches 80 %) in "
                       "place of the L2 one, given the true target (oracle)", replace(T3, universal=UNI_WARP)),
    "t4": ("t3 + the suspected label's samples the purification moved to another label (softmax >= 0.8) join "
           "round 2 relabelled with that label", replace(T3, relabel_suspected=True)),
    "both_families": ("t3 with two universal families at once, additive L2 and warp (1/64 of the side), 256 "
                      "images each; detection 4 (universal L2 + universal warp)",
                      replace(TARGETED_V2, family_from_scan=False, universal_images=256)),
    "targeted_v1": ("the first 'targeted' default: t3, unlearning only the universal family (additive or warp) "
                    "whose detection scan named the target", replace(TARGETED_V2, target_top_label=False)),
    "targeted_v2": ("the second default (until 2026-12-04): targeted_v1 + a scan that misses the detection threshold "
                    "still names its top label if its robust z >= 2 (WEAK_EVIDENCE_Z); rows of badnets, blend and "
                    "wanet were run before that rule, which acts only on scans that miss the threshold (theirs did "
                    "not)", TARGETED_V2),
    "top": ("targeted_v1 + the targeted levers act on the scan's top label even when its p-value is not "
            "significant, at any z (the family: the scan's most significant statistic)",
            replace(TARGETED_V2, target_min_z=0.0)),
    "targeted_relabel": ("the third default (2026-12-04, until isolation joined it): targeted_v2 + relabelling (t4's "
                         "lever: the target's samples the purification moved to another label, softmax >= 0.8, join "
                         "round 2 with that label); where no label is named it is targeted_v2", TARGETED_V3),
    "targeted_isolate": ("the fourth default (evening of 2026-12-04, until relabel_all_isolated): targeted_relabel + "
                         "isolation where the scan names no target (pbe.isolation: a label's separate activation "
                         "cluster whose estimated trigger moves the model's predictions is refused, its estimated "
                         "trigger pasted on a third of every batch with the samples' own labels, and its samples "
                         "the purification moved join round 2 with their new label); where a label is named it is "
                         "targeted_relabel", TARGETED_V4),
    "isolate_named": ("targeted_isolate + the isolation also where the scan names a target: when it confirms a poison "
                      "cluster in that label, the cluster's estimated trigger replaces the optimised universal "
                      "perturbations and only the cluster is refused and relabelled",
                      replace(TARGETED_V4, isolate_named=True)),
    "relabel_all_isolated": ("the fifth default (end of 2026-12-04, until the whole-label test): targeted_isolate + "
                             "every isolated sample (not only those round 1 moved with softmax >= 0.8) joins "
                             "round 2 with the purified model's most likely label other than its own", TARGETED_V5),
    "whole_label_trigger": ("relabel_all_isolated + where no cluster is confirmed and no label named, the isolation "
                            "tests every label as a whole (clean-label poison: all of the target's samples carry the "
                            "trigger); a label whose all-sample trigger estimate moves >= 50 % of held-out images, "
                            "50 % more than the next label's, gives its estimated trigger to the universal share "
                            "(its samples stay in, with their labels)", replace(TARGETED_V5, whole_label="trigger")),
    "whole_label_refuse": ("whole_label_trigger + that label is named the target: its samples are out of round 1 and "
                           "back in round 2 where the purified model still assigns them to it (never relabelled)",
                           replace(TARGETED_V5, whole_label="refuse")),
    "whole_label_exclude": ("the sixth default (2026-12-04 late, until verify_named): whole_label_refuse, but that "
                            "label's samples stay out of round 2 as well (on clean-label "
                            "SIG, re-admitting them in round 2 raised ASR from 0.80 to 3.61 %: every one carries the "
                            "trigger with the target label)", replace(TARGETED_V5, whole_label="exclude")),
    "named_trigger": ("the default + where the scan names a target, the isolation runs too, and a poison cluster "
                      "it confirms in that label adds its estimated trigger to the universal share beside the "
                      "optimised perturbation (a third of every batch, split between them); refusal and "
                      "relabelling stay the named target's (isolate_named, which replaced the perturbation and "
                      "refused only the cluster, left Blend at 3.48 %)",
                      replace(TARGETED_V6, named_trigger=True)),
    "verify_named": ("the default (SCHEDULES['targeted']) since 2026-12-05: whole_label_exclude + where the scan "
                     "names a target, the isolation runs too, and a poison cluster "
                     "it confirms in that label is kept as evidence: after round 1 its estimated trigger is pasted on "
                     "256 held-out images of other labels, and if the purified model still sends >= 50 % of them to "
                     "the target (VERIFY_REACH), round 2 takes the isolation's path (that trigger in place of the "
                     "optimised perturbation, the cluster refused and every one of its samples relabelled)",
                     replace(TARGETED_V6, verify_named=True)),
    "whole_label_trigger_half": ("whole_label_trigger with the estimated trigger on half of every batch (a third: "
                                 "the target's samples, all carrying the trigger, still make it predict the target)",
                                 replace(TARGETED_V5, whole_label="trigger", universal_share=0.5)),
    "recal": ("targeted + the universal budget re-calibrated on the purified model before round 2 (on the "
              "generalisation model badnets_random4 round 2 raised ASR from 1.37 to 4.98 % with no poison in its "
              "subset)", replace(TARGETED_V2, recalibrate=True)),
    "targeted_oracle": ("targeted_v2 given the true target (oracle: the erasure alone, where the scan cannot name "
                        "it, e.g. clean-label SIG)", TARGETED_V2),
    "untargeted_mask": ("targeted with a universal mask (Neural Cleanse's (1 - m) x + m p, 1 % of the pixels) as its "
                        "only family: where the scan names no target, one untargeted mask per epoch (on the "
                        "all-to-all model a first one fooled 97.6 % of training images, 1.1 % on the clean one; "
                        "with other seeds 0.7-1.9 %: that was one lucky sample)",
                        TARGETED_V2.with_universals((UNI_MASK,))),
    "t2_pgdt_oracle": ("t2_pgdt given the true target (oracle: the erasure alone)", T2_PGDT),
    "cheap_scan": ("targeted_v7 (the default before readmit_auto) with its scan at pbe.detect's own cost "
                   "(detection method 10: 2 passes of 16-image steps, per-label counts scaled by 8 / C) instead of "
                   "method 9's every label at 4 x 128: on GTSRB's 43 labels the scan is ~2.4 of the default's ~5 "
                   "epoch-equivalents", replace(TARGETED_V7, cheap_scan=True)),
    "cap_target": ("targeted_v7 + round 2 takes of the suspected target's samples a typical label's share at most "
                   "(30 % of the median label's count: the target's poison inflates its count, on GTSRB 210 clean "
                   "samples against 3,921 poisoned, 1,239 of which balanced selection could readmit)",
                   replace(TARGETED_V7, readmit_target="capped")),
    "no_readmit": ("targeted_v7 + round 2 readmits none of the suspected target's samples (those round 1 moved "
                   "join relabelled, as in targeted_v7)", replace(TARGETED_V7, readmit_target="none")),
    "readmit_auto": ("targeted_v7 + round 2 readmits none of the suspected target's samples where that label holds "
                     "more than READMIT_INFLATION (4) times the median label's samples (GTSRB at 10 %: 7.6, as "
                     "no_readmit), and those the purified model still assigns to it elsewhere (CIFAR-10 at 10 %: "
                     "2.25, as targeted_v7): the default (targeted) since 2026-12-07",
                     replace(TARGETED_V7, readmit_target="auto")),
    "scan_pass1": ("the default (targeted) with its target scan at one pass of 16-image steps over the same 256 "
                   "fitting images per label instead of 4 passes of 128 (scan_budget.md: on the GTSRB dev zoo every "
                   "scan names what the full one names, at 0.74 instead of 2.38 epoch-equivalents); where it names "
                   "the same label by the same evidence, the run after the scan is the default's, bit for bit",
                   replace(SCHEDULES["targeted"], scan_epochs=1, scan_batch=16)),
    "paper": ("the authors' schedule (~21 epoch-equivalents)", SCHEDULES["paper"]),
}


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
        return "Variants:\n\n" + "\n".join(f"- **{v}**: {w}" for v, w in what.items())


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
    unknown = set(cfg["variants"]) - set(VARIANTS)
    if unknown:
        raise PBEError(f"pbe_ablation_cifar10: unknown variants {sorted(unknown)}; see VARIANTS in the script")
    table = results_table(cfg)
    out = []
    # clean models too: what the defaults cost a model that has no backdoor (ACC only)
    pairs = None if cfg["pairs"] is None else {tuple(p.split()) for p in cfg["pairs"]}
    unknown = set() if pairs is None else {v for _, v in pairs} - set(VARIANTS)
    if unknown:
        raise PBEError(f"pbe_ablation_cifar10: unknown variants in pairs: {sorted(unknown)}")
    for entry in built_zoo_models("dev", cfg["dataset"], cfg["only"], infected=False):
        for variant in cfg["variants"] if pairs is None else [v for n, v in sorted(pairs) if n == entry.name]:
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
