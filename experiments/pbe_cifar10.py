"""PBE (no clean data, one row per schedule) and AFT (5% clean extra set) on the infected zoo models
of one dataset -> experiments/results/pbe_{dataset}.{json,md,csv,png} (CIFAR-10: pbe_cifar10, GTSRB:
pbe_gtsrb). Resumable: cells with a row measured on the committed zoo model are skipped; a zoo model
not built yet is reported and skipped. The same grid runs from ``experiments/configs/pbe_*.yaml``
through ``reproduce.py`` (locally or on Ray).

    python experiments/pbe_cifar10.py [--set dev] [--dataset cifar10] [--schedules fast paper] [--only badnets]

Rows carry "schedule" (the registered name; ``DEFAULT_SCHEDULE`` is pbe.erase's default) and the zoo keys.
"""
from __future__ import annotations

import argparse
import json

from common import (RESULTS, ROOT, RUNS, DefenceTable, built_zoo_models, data_args, defence_name, defence_row,
                    row_schedule, zoo_cell)
from common import run_cell as run_command
from grid import Cell, execute, median_cost, script_main

from pbe import zoo
from pbe.defenses.aft import AFT
from pbe.defenses.pbe import DEFAULT_SCHEDULE, PBE
from pbe.train import RECIPES
from pbe.utils import json_safe

CONFIG = {"set": "dev", "dataset": "cifar10", "only": None, "schedules": [DEFAULT_SCHEDULE], "aft": True, "seeds": [0],
          "given_target": False}  # given_target: PBE is told the zoo model's target (`pbe erase --target`), as
#                                   a defender is who ran `pbe detect` first; rows carry given_target: true
# the goal a row meets when PBE erases the backdoor: ASR after, ACC points lost, epoch-equivalents spent
GOAL_ASR, GOAL_ACC_DROP, GOAL_EE = 0.03, 0.03, 3.0
DEFAULT_ESTIMATE = GOAL_EE  # epoch-equivalents of a cell whose schedule has no row yet
AFT_CLEAN_FRACTION = 0.05
AFT_SCHEDULE = "targeted"  # AFT's default; its earlier rows (schedule "aft") ran the paper's recipe


def results_table(cfg: dict | None = None) -> DefenceTable:
    """This script's table for a config's dataset (``experiments/render.py`` re-renders it)."""
    dataset = (cfg or CONFIG)["dataset"]
    return DefenceTable(RESULTS / f"pbe_{dataset}", f"PBE and AFT on infected {dataset} zoo models",
                        f"python experiments/pbe_cifar10.py --dataset {dataset}",
                        summarise=lambda rows: summary_markdown(rows, dataset))


def meets_goal(r: dict) -> bool:
    return (r["asr"] <= GOAL_ASR and r["acc_before"] - r["acc"] <= GOAL_ACC_DROP
            and r["epoch_equivalents"] <= GOAL_EE)


def latest_by_model(rows: list[dict]) -> dict[tuple, dict]:
    """(zoo set, defence name, zoo model) -> the latest row (a rerun replaces), target not given."""
    latest = {}
    for r in rows:
        if r.get("zoo") and not r.get("given_target") and r.get("asr") is not None:
            latest[(r.get("zoo_set") or "–", defence_name(r), r["zoo"])] = r
    return latest


def defaults_elsewhere(dataset: str) -> list[dict]:
    """PBE's default rows of this dataset's defences table (the first dev models ran there, beside every other
    defence), so that the summary covers every zoo model the default ran on."""
    path = RESULTS / f"defenses_{dataset}.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    return [r for r in rows if r["defense"] == "pbe" and defence_name(r) == f"pbe ({DEFAULT_SCHEDULE})"]


def _family(r: dict) -> str:
    return r["model"].split("(")[0]


def _attack(r: dict) -> str:
    return r["attack"] + (" all-to-all" if r.get("all_to_all") else "")


def _rate(r: dict) -> str:
    return f"{100 * r['rate']:g} %"


def _means_line(label: str, rs: list[dict]) -> str:
    def mean(f):
        return sum(f(r) for r in rs) / len(rs)
    return (f"| {label} | {len(rs)} | {sum(map(meets_goal, rs))} of {len(rs)} | "
            f"{100 * mean(lambda r: r['acc_before'] - r['acc']):.2f} | {100 * mean(lambda r: r['asr']):.2f} | "
            f"{mean(lambda r: r['epoch_equivalents']):.2f} |")


def summary_markdown(rows: list[dict], dataset: str = "cifar10") -> str:
    """PBE's default per zoo set, with its means per attack, architecture family and poison rate (its rows here
    and in the defences table, the latest per model); then every schedule's means per zoo set, also without the
    model of the highest ASR after, so that one model's failure is seen apart from the rest."""
    latest = latest_by_model(defaults_elsewhere(dataset) + rows)
    if not latest:
        return ""
    goal = (f"Goal: ASR after <= {100 * GOAL_ASR:g} %, at most {100 * GOAL_ACC_DROP:g} ACC points lost and "
            f"<= {GOAL_EE:g} epoch-equivalents. ACC drop in points, ASR after in %.")
    head = ["| {} | models | goal met | ACC drop | ASR after | epoch-eq. |", "|---|---|---|---|---|---|"]
    lines = [f"## PBE's default ({DEFAULT_SCHEDULE}) per zoo set", "", goal,
             "Every infected model the current default ran on (no clean data, no trigger, no target given); a model "
             "whose row an earlier default made is listed apart until its row is redone.", ""]
    for zoo_set in ("dev", "generalisation"):
        found = [r for (s, name, _), r in latest.items() if s == zoo_set and name == f"pbe ({DEFAULT_SCHEDULE})"]
        rs, old = [r for r in found if not stale(r)], sorted(r["zoo"] for r in found if stale(r))
        if not found:
            continue
        lines += [f"### {zoo_set} set", ""]
        if old:
            lines += [f"Rows of an earlier default, left out: {', '.join(f'`{m}`' for m in old)}.", ""]
        if not rs:
            continue
        lines += [head[0].format("group"), head[1], _means_line("**all**", rs)]
        for title, key in (("attack", _attack), ("architecture", _family), ("poison rate", _rate)):
            for value in sorted({key(r) for r in rs}, key=lambda v: (len(v), v) if key is _rate else v):
                lines.append(_means_line(f"{title}: {value}", [r for r in rs if key(r) == value]))
        lines.append("")
    lines += ["## This table's rows: means per zoo set and schedule", "", goal + " The last column leaves out the "
              "model with the highest ASR after.", "",
              "| set | schedule | models | goal met | ACC drop | ASR after | epoch-eq. | ASR after without the worst |",
              "|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list] = {}
    for (zoo_set, name, _), r in latest_by_model(rows).items():
        groups.setdefault((zoo_set, name), []).append(r)
    for (zoo_set, name), rs in sorted(groups.items()):
        worst = max(rs, key=lambda r: r["asr"])
        rest = [r for r in rs if r is not worst]
        without = f"{100 * sum(r['asr'] for r in rest) / len(rest):.2f} (without `{worst['zoo']}`)" if rest else "–"
        lines.append(_means_line(f"{zoo_set} | {name}", rs)[:-1] + f"| {without} |")
    return "\n".join(lines)


def stale(row: dict) -> bool:
    """A row of PBE's default made by an earlier default is redone (it stays until the new row replaces it): one
    without the erasure tracker (before it and the one-verdict plan), or whose resolved schedule differs from the
    default's now (e.g. another scan budget), or made before the augmentation check on a model its zoo recipe trained
    without augmentation (the check changes what such a run fine-tunes on). A row of AFT's default is redone when
    its parameters differ from the default's now (e.g. its stop rule)."""
    if row["defense"] == "aft" and row_schedule(row) == AFT_SCHEDULE:
        return row.get("params") != json_safe(AFT().params)
    if row["defense"] != "pbe" or row_schedule(row) != DEFAULT_SCHEDULE or row.get("given_target"):
        return False
    now = json_safe(PBE().resolved()["schedule"])
    unaugmented = row.get("recipe") in RECIPES and RECIPES[row["recipe"]].crop_padding == 0
    return ("tracker" not in row or (row.get("params") or {}).get("schedule") != now
            or (unaugmented and "augmentation" not in row))


def cells(cfg: dict) -> list[Cell]:
    table = results_table(cfg)
    runs = [("pbe", "no-clean", s) for s in cfg["schedules"]] + (
        [("aft", "clean-extra", AFT_SCHEDULE)] if cfg["aft"] else [])
    out = []
    for entry in built_zoo_models(cfg["set"], cfg["dataset"], cfg["only"]):
        for seed in cfg["seeds"]:
            for defense, setting, schedule in runs:
                given = {"given_target": True} if cfg.get("given_target") and defense == "pbe" else {}
                out.append(Cell("pbe_cifar10", f"{entry.name} {defense} {schedule} seed {seed}",
                                zoo_cell(entry, defense, setting, seed, schedule=schedule, **given),
                                {"name": entry.name, "defense": defense, "schedule": schedule, "seed": seed, **given},
                                median_cost(table, DEFAULT_ESTIMATE, schedule=schedule), zoo=entry.name))
    return out


def run_cell(name: str, defense: str, schedule: str, seed: int, given_target: bool = False) -> dict:
    """One row: ``pbe erase`` on a zoo model (PBE with `schedule`, or AFT on 5 % clean data); with
    `given_target`, PBE is told the model's target."""
    entry = zoo.get(name)
    src = entry.folder.resolve().relative_to(ROOT)
    setting = "no-clean" if defense == "pbe" else "clean-extra"
    given = {"given_target": True} if given_target else {}
    out = RUNS / "pbe_cifar10" / entry.name / f"{defense}_{schedule}{'_given' if given_target else ''}_seed{seed}"
    cmd = ["pbe", "erase", "--model", str(src), *data_args(entry), "--setting", setting,
           "--poison-from", str(src), "--seed", str(seed), "--out", str(out), "--no-progress",
           "--overwrite",  # the folder caches this cell: a run of other settings (an older default) is replaced
           "--schedule", schedule, *([] if defense == "pbe" else ["--clean-fraction", str(AFT_CLEAN_FRACTION)]),
           *(["--target", str(entry.target)] if given_target else [])]
    m = run_command(cmd, out)
    report = json.loads((ROOT / out / "report.json").read_text())
    if "check" in report:  # AFT's targeted schedule: its checks on the held-out clean images, its stop
        extra = {"checks": len(report["check"]), "stopped": report["stopped"], "aft_target": report["target"],
                 "check_acc_drop": report["check_acc_drop"]}
    else:
        extra = {"rounds": len(report["rounds"]), "stopped_early": report.get("stopped_early"),
                 "monitor_before": (report.get("monitor_before") or {}).get("top_kappa"),
                 "monitor_after": (report.get("monitor_after") or {}).get("top_kappa"),
                 "detection": report["rounds"][-1].get("detection")}
    row = defence_row(zoo_cell(entry, defense, setting, seed, schedule=schedule, **given), m["command"], report, entry,
                      params=report["params"], **extra)
    print(f"{entry.name} {defense} {schedule}: acc {row['acc_before']:.4f}->{row['acc']:.4f} "
          f"asr {row['asr_before']:.4f}->{row['asr']:.4f} ee={row['epoch_equivalents']:.2f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="dev", choices=zoo.SETS, dest="zoo_set")
    ap.add_argument("--dataset", default="cifar10", help="zoo models of this dataset (default cifar10)")
    ap.add_argument("--schedules", nargs="*", default=[DEFAULT_SCHEDULE],
                    help=f"PBE schedules (default {DEFAULT_SCHEDULE}; paper: the authors')")
    ap.add_argument("--no-aft", action="store_true", help="only PBE rows")
    ap.add_argument("--only", nargs="*", help="zoo names or attacks to run")
    ap.add_argument("--seed", type=int, default=0, help="seed of the defence")
    args = ap.parse_args()
    execute({"script": "pbe_cifar10", "set": args.zoo_set, "dataset": args.dataset, "only": args.only,
             "schedules": args.schedules, "aft": not args.no_aft, "seeds": [args.seed]}, progress=False)


if __name__ == "__main__":
    script_main(main)
