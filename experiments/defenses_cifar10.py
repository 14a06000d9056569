"""Every defence side by side on the infected CIFAR-10 zoo models (dev set by default)
-> experiments/results/defenses_cifar10.{json,md}. Resumable: cells with a row measured on the
committed zoo model (its sha256) are skipped; a zoo model not built yet is reported and skipped; a cell
killed mid-way takes up its staged state when rerun by the same code (``pbe defend``'s resumable stages),
so a published-budget cell longer than a session finishes over several.
Rows made before the zoo existed (4-epoch `quick` models, no "zoo" key) stay in the table.

    python experiments/defenses_cifar10.py [--set dev] [--only badnets blend] [--defenses ft nad]

CPU budget. The defaults of each defence are its paper's / BackdoorBench's (100 fine-tuning epochs,
2,000 ANP iterations, 100 STRIP overlays), sized for GPUs. On 2 CPU cores this script gives the
fine-tuning defences AFT's budget instead (20 epochs on the 5% clean set = 1 epoch-equivalent; SAU
20 epochs too), ANP 400 iterations, STRIP 10 overlays, retrains the filtering defences with the infected
model's own recipe and gives ABL's isolation and fine-tuning 20 % and 60 % of that recipe's epochs (its
unlearning costs next to nothing and keeps its default); every row records its parameters.
`--paper-budget` runs the defaults instead.
PBE and AFT run here through `pbe defend` like every other defence (no row is copied from another table).
"""
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from statistics import mean

from common import (
    HERE, RESULTS, ROOT, RUNS, DefenceTable, built_zoo_models, data_args, defence_name, defence_row, is_pbe,
    zoo_cell)
from common import run_cell as run_command
from grid import Cell, execute, median_cost, script_main

from pbe import defenses, zoo
from pbe.cli.defend import DEFENSE_STATE
from pbe.rundir import staging
from pbe.train import get_recipe
from pbe.utils import PBEError, json_safe

MODELS = ["badnets", "badnets_a2a", "blend", "sig", "sig_poison_label", "wanet", "input_aware"]  # summary columns
BACKDOORBENCH_ATTACKS = {"badnets", "blend", "sig", "wanet", "input_aware"}  # the zoo models it has rows for

ORDER = ["ft", "fp", "nad", "anp", "ibau", "aft", "aft_paper", "sau", "ftsam", "pbe", "pbe_lr1e-3", "abl", "ac",
         "ss", "strip"]
# labelled variants: a row name -> (registered defence, parameters). PBE's `fast` schedule fine-tunes at
# lr 0.01; the authors' code uses 0.001.
VARIANTS = {"pbe_lr1e-3": ("pbe", {"lr": 0.001}), "aft_paper": ("aft", {"schedule": "paper"})}


def registered(defense: str) -> tuple[str, dict]:
    """The registered defence behind a row name, and the parameters the name fixes."""
    return VARIANTS.get(defense, (defense, {}))


def setting_of(defense: str) -> str:
    return defenses.REGISTRY[registered(defense)[0]].setting


def cpu_budget(defense: str, recipe: str) -> dict:
    """The CPU budget of a defence on models trained with `recipe`: 20 passes over the clean set for the
    fine-tuning ones (SAU's passes cost about 13 epoch-equivalents in all, its shared PGD included); ABL's
    isolation and fine-tuning, BackdoorBench's 20 + 60 of its 100 epochs, become 20 % and 60 % of the
    recipe's epochs, and its unlearning keeps the published 5 epochs: they pass over the 1 % it isolates
    (0.05 epoch-equivalents), so cutting them saves nothing."""
    epochs = get_recipe(recipe).epochs
    abl = {"tuning_epochs": round(0.2 * epochs), "finetuning_epochs": round(0.6 * epochs)}
    return {"ft": {"epochs": 20}, "fp": {"epochs": 20}, "nad": {"epochs": 20}, "anp": {"iterations": 400},
            "sau": {"epochs": 20}, "ftsam": {"epochs": 20}, "abl": abl, "ac": {"retrain": recipe},
            "ss": {"retrain": recipe}, "strip": {"n": 10, "retrain": recipe}}.get(defense, {})


def stale(row: dict) -> bool:
    """A CPU-budget row made with other parameters than its cell would run with now (a budget or a default
    changed since, or a parameter added: the row lacks it) is redone; the row stays until the new one
    replaces it. Published-budget rows are not checked: their table is rerun by deleting rows."""
    if row.get("budget") != "cpu" or not row.get("recipe"):
        return False
    name, variant = registered(row["defense"])
    now = json_safe({**defenses.create(name).params, **cpu_budget(name, row["recipe"]), **variant})
    return any(row["params"].get(k) != v for k, v in now.items())


@functools.lru_cache(maxsize=1)
def backdoorbench() -> dict:
    """BackdoorBench's published rows (read once: every summary row looks them up)."""
    return json.loads((HERE / "reference" / "backdoorbench_cifar10_preact_pratio0.1.json").read_text())


def reference_markdown() -> str:
    ref = backdoorbench()
    columns = [d for d in ["none"] + ORDER if any(r["defense"] == d for r in ref["rows"])]
    lines = ["## For reference only: BackdoorBench's published numbers (not comparable column by column)", "",
             f"Source: {ref['source']}. Setting: {ref['setting']}. {ref['missing']}. ACC / ASR / RA in %.", "",
             "| attack | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for attack in dict.fromkeys(r["attack"] for r in ref["rows"]):
        cells = {r["defense"]: f"{r['acc']:.1f} / {r['asr']:.1f} / {r['ra']:.1f}"
                 for r in ref["rows"] if r["attack"] == attack}
        lines.append(f"| {attack} | " + " | ".join(cells.get(d, "–") for d in columns) + " |")
    return "\n".join(lines)


def model_of(r: dict) -> str:
    """A row's infected model as the summaries name it: the zoo name without its dataset (two SIG models
    and BadNets all-to-all are columns of their own), or the attack for rows made before the zoo."""
    return r["zoo"].split("/", 1)[1] if r.get("zoo") else r["attack"]


def models_in(rows: list[dict]) -> list[str]:
    found = list(dict.fromkeys(model_of(r) for r in rows))
    return [m for m in MODELS if m in found] + [m for m in found if m not in MODELS]


def matrix_markdown(rows: list[dict]) -> str:
    """ACC / ASR after each defence (rows) on each infected model (columns): the at-a-glance view."""
    models = models_in(rows)
    lines = ["## ACC / ASR (%) after each defence, per infected model", "",
             "| defense | setting | " + " | ".join(models) + " |", "|---|---|" + "---|" * len(models)]
    last = {m: [r for r in rows if model_of(r) == m][-1] for m in models}  # the newest build of the model
    lines.append("| none (infected) | – | " + " | ".join(
        f"{100 * last[m]['acc_before']:.1f} / {100 * last[m]['asr_before']:.1f}" for m in models) + " |")
    for d in ORDER:
        cells = {model_of(r): r for r in rows if r["defense"] == d}
        if cells:
            lines.append(f"| {d} | {setting_of(d)} | " + " | ".join(
                f"{100 * cells[m]['acc']:.1f} / {100 * cells[m]['asr']:.1f}" if m in cells else "–"
                for m in models) + " |")
    return "\n".join(lines)


def common_models(rows: list[dict]) -> tuple[list[str], list[str]]:
    """The infected models every defence in the rows has run (labelled variants do not hold the others back),
    and the defences that ran on all of them: the means compare like with like."""
    measured = {(model_of(r), r["defense"]) for r in rows}
    present = [d for d in ORDER if any(m[1] == d for m in measured)]
    common = [m for m in models_in(rows) if all((m, d) in measured for d in present if d not in VARIANTS)]
    return common, [d for d in present if all((m, d) in measured for m in common)]


def means(rows: list[dict], defense: str, models: list[str]) -> dict:
    """A defence's mean ACC, ASR, RA, DER, wall time and epoch-equivalents over `models` (None where unmeasured)."""
    rs = [r for r in rows if r["defense"] == defense and model_of(r) in models]
    out = {}
    for key in ("acc", "asr", "ra", "der", "wall_s", "epoch_equivalents", "acc_before"):
        vals = [r[key] for r in rs if r.get(key) is not None]
        out[key] = mean(vals) if vals else None
    for key in ("precision", "recall"):
        vals = [r["detection"][key] for r in rs if r.get("detection") and r["detection"].get(key) is not None]
        out[key] = mean(vals) if vals and defense in ("ac", "ss", "strip") else None
    return out


def backdoorbench_means(defense: str, models: list[str]) -> str:
    """BackdoorBench's mean ACC / ASR for a defence over those of `models` it has published, with their count."""
    rows = [r for r in backdoorbench()["rows"]
            if r["defense"] == defense and r["attack"] in BACKDOORBENCH_ATTACKS.intersection(models)]
    if not rows:
        return "–"
    return f"{mean(r['acc'] for r in rows):.1f} / {mean(r['asr'] for r in rows):.1f} ({len(rows)})"


def head_to_head_markdown(rows: list[dict], reference: str = "pbe") -> str:
    """`reference` against each other defence on the models both have run (the common-model means below
    wait for the slowest defence; this uses every row): both means and on how many models `reference`
    has the lower ASR after and the higher ACC after."""
    ref = {model_of(r): r for r in rows if r["defense"] == reference}
    if not ref:
        return ""
    lines = [f"## {reference.upper()} against each defence on the models both have run", "",
             f"ACC / ASR after in %, the defence's mean first, {reference.upper()}'s over the same models second.", "",
             f"| defense | setting | models | ACC % | ASR % | epoch-eq. | {reference.upper()} lower ASR | "
             f"{reference.upper()} higher ACC |", "|---|---|---|---|---|---|---|---|"]
    for d in ORDER:
        other = {model_of(r): r for r in rows if r["defense"] == d}
        shared = [m for m in models_in(rows) if m in other and m in ref]
        if d == reference or not shared:
            continue
        mine, theirs = means(rows, reference, shared), means(rows, d, shared)
        pairs = [f"{scale * theirs[k]:.2f} / {scale * mine[k]:.2f}"
                 for k, scale in (("acc", 100), ("asr", 100), ("epoch_equivalents", 1))]
        lower = sum(ref[m]["asr"] < other[m]["asr"] for m in shared)
        higher = sum(ref[m]["acc"] > other[m]["acc"] for m in shared)
        lines.append(f"| {d} | {setting_of(d)} | {len(shared)} | " + " | ".join(pairs)
                     + f" | {lower} of {len(shared)} | {higher} of {len(shared)} |")
    return "\n".join(lines)


def summary_markdown(rows: list[dict]) -> str:
    """Means per defence, split by setting, over the models that every defence in the table has run, with
    BackdoorBench's published means over the same attacks beside them; the matrix above shows the rest."""
    common, present = common_models(rows)
    fmt = {"acc": "{:.2f}", "asr": "{:.2f}", "ra": "{:.2f}", "der": "{:.3f}", "precision": "{:.1f}",
           "recall": "{:.1f}", "wall_s": "{:.0f}", "epoch_equivalents": "{:.2f}"}  # the header's order
    scale = {"acc": 100, "asr": 100, "ra": 100, "precision": 100, "recall": 100}
    head = head_to_head_markdown(rows)
    lines = [matrix_markdown(rows), "", *([head, ""] if head else []),
             f"## Mean over the models every defence has run ({', '.join(common) or 'none yet'})", "",
             "Split by setting: clean-extra defences get 5 % clean training data, no-clean ones only the "
             "(poisoned) training set. Each setting's defences are listed by their rank on mean DER among all the "
             "defences of both settings. BackdoorBench's column is its own published mean over the same attacks "
             "(its count in brackets; PreAct-ResNet-18 at width 64, 100-epoch budgets): a reference, not a "
             "measurement of this toolkit.", ""]
    mean_of = {d: means(rows, d, common) for d in present}
    der = {d: round(m["der"], 3) if m["der"] is not None else -1.0 for d, m in mean_of.items()}  # as printed
    rank = {d: 1 + sum(v > der[d] for v in der.values()) for d in present}  # ties share a rank
    for setting in ("clean-extra", "no-clean"):
        ds = sorted((d for d in present if setting_of(d) == setting), key=lambda d: rank[d])
        if not ds or not common:
            continue
        lines += [f"### {setting}", "",
                  "| defense | ACC % | ASR % | RA % | DER | det. precision % | det. recall % | wall s | epoch-eq. | "
                  f"DER rank of {len(present)} | BackdoorBench ACC / ASR % |", "|---" * 11 + "|"]
        for d in ds:
            m = mean_of[d]
            cells = ["–" if m[k] is None else fmt[k].format(scale.get(k, 1) * m[k]) for k in fmt]
            lines.append(f"| {d} | " + " | ".join(cells) + f" | {rank[d]} | {backdoorbench_means(d, common)} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n\n" + reference_markdown()


def summary_by_model(rows: list[dict]) -> str:
    """One summary for the zoo's models, one for the older rows without a zoo."""
    zoo_rows = [r for r in rows if r.get("zoo")]
    old = [r for r in rows if not r.get("zoo") and not r["all_to_all"]]
    parts = []
    if zoo_rows:
        redo = [f"`{r['zoo']}` {r['defense']}" for r in zoo_rows if stale(r)]
        resumed = [f"`{r['zoo']}` {r['defense']}" for r in zoo_rows if r.get("resumed")]
        parts.append("# Zoo models (`" + "`, `".join(sorted({r["zoo"] for r in zoo_rows})) + "`)\n\n"
                     + ("**Being redone:** " + ", ".join(redo) + " (made with other parameters than their cells' "
                        "now; counted below until their reruns replace them).\n\n" if redo else "")
                     + ("**Resumed after a kill:** " + ", ".join(resumed) + " (each row's `resumed` in the JSON "
                        "names where its loops took up, on what CPU and code).\n\n" if resumed else "")
                     + summary_markdown(zoo_rows))
    if old:
        parts.append("# Earlier rows: 4-epoch `quick` models trained before the zoo existed\n\n"
                     + summary_markdown(old))
    return "\n\n".join(parts)


class DefencesTable(DefenceTable):
    """The defences table: its figure shows the zoo's models (the older rows stay in the table), with each
    defence's means over the models every defence has run."""

    def figure(self):
        from pbe.plots import defence_bars
        rows = [r for r in self.rows if r.get("zoo")] or self.rows
        order = models_in(rows)
        rows = sorted(rows, key=lambda r: order.index(model_of(r)))  # the summaries' column order
        common, present = common_models(rows)
        summary = []
        for d in present if common else []:
            m = means(rows, d, common)
            series = defence_name(next(r for r in rows if r["defense"] == d))  # as the bars name it
            summary.append({"name": series, "group": setting_of(d), "asr": m["asr"],
                            "acc_drop": m["acc_before"] - m["acc"]})
        over = ", ".join(common) if len(common) < 3 else f"{len(common)} models"
        return defence_bars(rows, defence_name, model=model_of, means=summary, means_title=f"mean over {over}",
                            highlight=is_pbe)


def budget_effect_markdown(rows: list[dict], cpu_rows: list[dict] | None = None) -> str:
    """The cut's effect: each published-budget row (`rows`) beside the CPU-budget row of the same zoo model
    and defence (`cpu_rows`, default the CPU table's), with the parameters that differ and the change in
    ACC and ASR after."""
    cpu_rows = results_table().rows if cpu_rows is None else cpu_rows
    cpu = {(r["zoo"], r["defense"]): r for r in cpu_rows if r.get("zoo") and r.get("budget") == "cpu"}
    pairs = [(cpu[key], r) for r in rows if (key := (r.get("zoo"), r["defense"])) in cpu]
    if not pairs:
        return ""
    lines = ["## The cut's effect: each published-budget row beside its CPU-budget row", "",
             "Same zoo model, defence, seed and data; only the budget differs (the parameters listed, CPU -> "
             "published). ACC / ASR after in %; a negative change in ASR means the published budget removes more.",
             "", "| zoo | defense | budget (CPU -> published) | CPU ACC / ASR (epoch-eq.) | published ACC / ASR "
             "(epoch-eq.) | change ACC / ASR |", "|---|---|---|---|---|---|"]
    for c, p in pairs:
        budget = ", ".join(f"{k} {c['params'].get(k, '–')} -> {v}" for k, v in p["params"].items()
                           if c["params"].get(k) != v) or "same"  # '–': a parameter the CPU row predates
        after = [f"{100 * r['acc']:.2f} / {100 * r['asr']:.2f} ({r['epoch_equivalents']:.2f})" for r in (c, p)]
        lines.append(f"| {p['zoo']} | {p['defense']} | {budget} | {after[0]} | {after[1]} | "
                     f"{100 * (p['acc'] - c['acc']):+.2f} / {100 * (p['asr'] - c['asr']):+.2f} |")
    return "\n".join(lines)


def paper_summary(rows: list[dict]) -> str:
    """The published-budget table's summary: the cut's effect first, then the usual summaries."""
    return "\n\n".join(part for part in (budget_effect_markdown(rows), summary_by_model(rows)) if part)


def results_table(cfg: dict | None = None) -> DefencesTable:
    """This script's table (``experiments/render.py`` re-renders it); the published budgets' rows
    (``paper_budget``) have a table of their own, so that the CPU rows and they are two cells each."""
    if cfg and cfg.get("paper_budget"):
        return DefencesTable(RESULTS / "defenses_cifar10_paper", "Defences at their published budgets on infected "
                            "CIFAR-10 models", "python experiments/defenses_cifar10.py --paper-budget",
                            summarise=paper_summary)
    return DefencesTable(RESULTS / "defenses_cifar10", "Defences side by side on infected CIFAR-10 models",
                        "python experiments/defenses_cifar10.py", summarise=summary_by_model)


CONFIG = {"set": "dev", "only": None, "defenses": list(ORDER), "paper_budget": False, "seeds": [0]}
DEFAULT_ESTIMATE = 3.0  # epoch-equivalents of a defence without a row yet


EPOCH_KEYS = ("epochs", "iterations", "tuning_epochs", "finetuning_epochs", "unlearning_epochs")
OVERLAY_EE = 1 / 3  # epoch-equivalents of one STRIP overlay of the training set: a forward pass (base.Cost)


def published_estimate(cpu_cost: float, defense: str, recipe: str) -> float:
    """A published budget's cost from its CPU budget's (`cpu_cost`, models trained with `recipe`): the
    passes and iterations scale the cost by how many times the CPU budget's the class defaults are; STRIP's
    overlays add a forward pass over the training set each, its retraining being the same at both budgets."""
    name = registered(defense)[0]
    cut, published = cpu_budget(name, recipe), defenses.create(name).params
    if "n" in cut:
        return cpu_cost + (published["n"] - cut["n"]) * OVERLAY_EE
    epochs = [k for k in cut if k in EPOCH_KEYS]
    return cpu_cost * sum(published[k] for k in epochs) / sum(cut[k] for k in epochs) if epochs else cpu_cost


def estimate(table, defense: str, zoo_set: str, recipe: str | None = None) -> float:
    """A cell's cost: the median of the defence's rows on this zoo set, else of all its rows (the 4-epoch
    models' filtering rows retrained for 4 epochs, the zoo's for 15), else DEFAULT_ESTIMATE. A published
    budget's cell (`recipe` given: the model's) without such rows: ``published_estimate`` from the CPU
    table's estimate."""
    own = median_cost(table, median_cost(table, 0.0, defense=defense), defense=defense, zoo_set=zoo_set)
    if own:
        return own
    if recipe is None:
        return DEFAULT_ESTIMATE
    return published_estimate(estimate(results_table(), defense, zoo_set), defense, recipe)


def cells(cfg: dict) -> list[Cell]:
    unknown = set(cfg["defenses"]) - set(ORDER)
    if unknown:
        raise PBEError(f"defenses_cifar10: unknown defences {sorted(unknown)}; available: {', '.join(ORDER)}")
    table = results_table(cfg)
    return [Cell("defenses_cifar10", f"{e.name} {defense} seed {seed}", zoo_cell(e, defense, setting_of(defense), seed),
                 {"name": e.name, "defense": defense, "seed": seed, "paper_budget": cfg["paper_budget"]},
                 estimate(table, defense, cfg["set"], e.recipe if cfg["paper_budget"] else None), zoo=e.name)
            for e in built_zoo_models(cfg["set"], "cifar10", cfg["only"]) for defense in cfg["defenses"]
            for seed in cfg["seeds"]]


def defence_params(entry: zoo.Entry, defense: str, paper_budget: bool) -> tuple[str, dict]:
    """The registered defence a cell runs and the parameters its command sets (the budget's, the variant's)."""
    registered_name, variant = registered(defense)
    return registered_name, {**({} if paper_budget else cpu_budget(registered_name, entry.recipe)), **variant}


def cell_out(name: str, defense: str, seed: int, paper_budget: bool) -> Path:
    """A cell's run folder (its command's --out; one per cell)."""
    return RUNS / "defenses_cifar10" / name / f"{defense}_seed{seed}{'_paper' if paper_budget else ''}"


def staged(name: str, defense: str, seed: int, paper_budget: bool) -> float:
    """The epoch-equivalents done in the state a cell's interrupted command staged, which its rerun takes up
    (0 without one, or one of other code or parameters): the grid's estimates leave them out."""
    registered_name, params = defence_params(zoo.get(name), defense, paper_budget)
    state_dir = staging(ROOT / cell_out(name, defense, seed, paper_budget)) / DEFENSE_STATE
    progress = defenses.staged_progress(state_dir, defense=registered_name, seed=seed,
                                        params=defenses.create(registered_name, **params).params)
    return progress.epoch_equivalents if progress else 0.0


def run_cell(name: str, defense: str, seed: int, paper_budget: bool) -> dict:
    """One row: ``pbe defend`` on a zoo model."""
    entry = zoo.get(name)
    cell = zoo_cell(entry, defense, setting_of(defense), seed)
    src = entry.folder.resolve().relative_to(ROOT)
    registered_name, params = defence_params(entry, defense, paper_budget)
    out = cell_out(name, defense, seed, paper_budget)
    cmd = ["pbe", "defend", "--defense", registered_name, "--model", str(src), *data_args(entry),
           "--poison-from", str(src), "--seed", str(seed), "--out", str(out), "--no-progress",
           *(["--clean-fraction", "0.05"] if cell["setting"] == "clean-extra" else []),
           "--overwrite"]  # the folder caches this cell: other settings' run is replaced
    for k, v in params.items():
        cmd += ["--param", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    m = run_command(cmd, out)
    report = json.loads((ROOT / out / "report.json").read_text())
    row = defence_row(cell, m["command"], report, entry, params=report["params"],
                      budget="paper" if paper_budget else "cpu")
    print(f"{name} {defense}: acc {row['acc_before']:.4f}->{row['acc']:.4f} asr {row['asr_before']:.4f}->"
          f"{row['asr']:.4f} ee={row['epoch_equivalents']:.2f} wall={row['wall_s']:.0f}s", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="dev", choices=("dev", "generalisation"), dest="zoo_set")
    ap.add_argument("--only", nargs="*", help="zoo names or attacks to run")
    ap.add_argument("--defenses", nargs="*", default=ORDER, choices=ORDER)
    ap.add_argument("--paper-budget", action="store_true", help="the defences' own defaults (GPU-sized)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the defence")
    args = ap.parse_args()
    execute({"script": "defenses_cifar10", "set": args.zoo_set, "only": args.only, "defenses": args.defenses,
             "paper_budget": args.paper_budget, "seeds": [args.seed]}, progress=False)


if __name__ == "__main__":
    script_main(main)
