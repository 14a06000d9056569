"""Every defence side by side on the infected CIFAR-10 models of experiments/attacks_cifar10.py
-> experiments/results/defenses_cifar10.{json,md}. Resumable: cells with a row measured on the
infected model now on disk are skipped (rows of an earlier build of that model are rerun); an
infected model that does not exist yet is reported and skipped.

    python experiments/defenses_cifar10.py [--recipe cpu] [--only badnets blend] [--defenses ft nad]

CPU budget. The defaults of each defence are its paper's / BackdoorBench's (100 fine-tuning epochs,
2,000 ANP iterations, 100 STRIP overlays), sized for GPUs. On 2 CPU cores this script gives the
fine-tuning defences AFT's budget instead (20 epochs on the 5% clean set = 1 epoch-equivalent),
ANP 400 iterations, STRIP 10 overlays, and retrains the filtering defences with the infected model's
own recipe; every row records its parameters. `--paper-budget` runs the defaults instead.
PBE and AFT rows are copied from experiments/results/pbe_cifar10.json when that table has them (same
infected model, same data), else run here through `pbe defend`.
"""
from __future__ import annotations

import argparse
import json
from statistics import mean

from attacks_cifar10 import CELLS
from common import HERE, ROOT, RUNS, run_cell

from pbe import defenses
from pbe.results import ResultsTable
from pbe.utils import toolkit_version

ORDER = ["ft", "fp", "nad", "anp", "ibau", "aft", "pbe", "pbe_lr1e-3", "ac", "ss", "strip"]
# labelled variants: a row name -> (registered defence, parameters). PBE's `fast` schedule fine-tunes at
# lr 0.01; the authors' code uses 0.001.
VARIANTS = {"pbe_lr1e-3": ("pbe", {"lr": 0.001})}


def registered(defense: str) -> tuple[str, dict]:
    """The registered defence behind a row name, and the parameters the name fixes."""
    return VARIANTS.get(defense, (defense, {}))


def setting_of(defense: str) -> str:
    return defenses.REGISTRY[registered(defense)[0]].setting


def cpu_budget(defense: str, recipe: str) -> dict:
    return {"ft": {"epochs": 20}, "fp": {"epochs": 20}, "nad": {"epochs": 20}, "anp": {"iterations": 400},
            "ac": {"retrain": recipe}, "ss": {"retrain": recipe}, "strip": {"n": 10, "retrain": recipe}}.get(defense, {})


def reference_markdown() -> str:
    ref = json.loads((HERE / "reference" / "backdoorbench_cifar10_preact_pratio0.1.json").read_text())
    columns = [d for d in ["none"] + ORDER if any(r["defense"] == d for r in ref["rows"])]
    lines = ["## For reference only: BackdoorBench's published numbers (not comparable column by column)", "",
             f"Source: {ref['source']}. Setting: {ref['setting']}. {ref['missing']}. ACC / ASR / RA in %.", "",
             "| attack | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for attack in dict.fromkeys(r["attack"] for r in ref["rows"]):
        cells = {r["defense"]: f"{r['acc']:.1f} / {r['asr']:.1f} / {r['ra']:.1f}"
                 for r in ref["rows"] if r["attack"] == attack}
        lines.append(f"| {attack} | " + " | ".join(cells.get(d, "–") for d in columns) + " |")
    return "\n".join(lines)


def matrix_markdown(rows: list[dict]) -> str:
    """ACC / ASR after each defence (rows) on each infected model (columns): the at-a-glance view."""
    attacks = [a for a, a2a, _ in CELLS if not a2a and any(r["attack"] == a for r in rows)]
    lines = ["## ACC / ASR (%) after each defence, per attack", "",
             "| defense | setting | " + " | ".join(attacks) + " |", "|---|---|" + "---|" * len(attacks)]
    last = {a: [r for r in rows if r["attack"] == a][-1] for a in attacks}  # the newest build of the model
    lines.append("| none (infected) | – | " + " | ".join(
        f"{100 * last[a]['acc_before']:.1f} / {100 * last[a]['asr_before']:.1f}" for a in attacks) + " |")
    for d in ORDER:
        cells = {r["attack"]: r for r in rows if r["defense"] == d}
        if cells:
            lines.append(f"| {d} | {setting_of(d)} | " + " | ".join(
                f"{100 * cells[a]['acc']:.1f} / {100 * cells[a]['asr']:.1f}" if a in cells else "–"
                for a in attacks) + " |")
    return "\n".join(lines)


def summary_markdown(rows: list[dict]) -> str:
    """Means per defence over the attacks that every defence in the table has run (labelled variants
    aside), so that the means compare like with like; the matrix above shows the rest."""
    measured = {(r["attack"], r["defense"]) for r in rows}
    present = [d for d in ORDER if any(m[1] == d for m in measured)]
    common = [a for a, a2a, _ in CELLS if not a2a  # variants (VARIANTS) do not hold the others back
              and all((a, d) in measured for d in present if d not in VARIANTS)]
    present = [d for d in present if all((a, d) in measured for a in common)]
    lines = [matrix_markdown(rows), "",
             f"## Mean over the attacks every defence has run ({', '.join(common) or 'none yet'})", "",
             "| defense | setting | ACC % | ASR % | RA % | DER | det. precision % | det. recall % | "
             "wall s | epoch-eq. |", "|---|---|---|---|---|---|---|---|---|---|"]
    for d in present if common else []:
        rs = [r for r in rows if r["defense"] == d and r["attack"] in common]

        def avg(key, rs=rs):
            vals = [r[key] for r in rs if r.get(key) is not None]
            return mean(vals) if vals else None

        def det(key, rs=rs):
            vals = [r["detection"][key] for r in rs if r.get("detection") and r["detection"].get(key) is not None]
            return f"{100 * mean(vals):.1f}" if vals and d in ("ac", "ss", "strip") else "–"

        pct = [("–" if avg(k) is None else f"{100 * avg(k):.2f}") for k in ("acc", "asr", "ra")]
        lines.append(f"| {d} | {rs[0]['setting']} | " + " | ".join(pct)
                     + f" | {avg('der'):.3f} | {det('precision')} | {det('recall')} | {avg('wall_s'):.0f} | "
                     f"{avg('epoch_equivalents'):.2f} |")
    return "\n".join(lines) + "\n\n" + reference_markdown()


def same_model(row: dict, infected: dict) -> bool:
    """Whether a stored row was measured on the infected model now on disk (its ACC / ASR before the
    defence match the model's own metrics); a model rebuilt by a newer toolkit invalidates old rows."""
    return all(abs(row[f"{k}_before"] - infected[k]) < 5e-5 for k in ("acc", "asr"))


def copy_pbe_row(cell: dict) -> dict | None:
    path = HERE / "results" / "pbe_cifar10.json"
    if not path.exists():
        return None
    key = {k: v for k, v in cell.items()}
    for row in json.loads(path.read_text()):
        if all(row.get(k) == v for k, v in key.items()):
            return {**row, "params": {"schedule": row.get("schedule")} if cell["defense"] == "pbe" else {},
                    "source": "experiments/results/pbe_cifar10.json"}
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-root", default="../shared/data/cifar10")
    ap.add_argument("--recipe", default="cpu", help="recipe of the infected models")
    ap.add_argument("--only", nargs="*", help="attack names to run")
    ap.add_argument("--defenses", nargs="*", default=ORDER, choices=ORDER)
    ap.add_argument("--paper-budget", action="store_true", help="the defences' own defaults (GPU-sized)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    table = ResultsTable(HERE / "results" / "defenses_cifar10", "Defences side by side on infected CIFAR-10 models",
                         "python experiments/defenses_cifar10.py", footer=summary_markdown)
    for attack, a2a, _ in CELLS:
        if a2a or (args.only and attack not in args.only):
            continue
        src = RUNS / "attacks_cifar10" / f"{attack}_{args.recipe}_seed{args.seed}"
        if not (ROOT / src / "model.safetensors").exists():
            print(f"skip {src.name}: infected model missing (run experiments/attacks_cifar10.py first)")
            continue
        infected = json.loads((ROOT / src / "metrics.json").read_text())
        for defense in args.defenses:
            setting = setting_of(defense)
            cell = dict(dataset="cifar10", model="preact_resnet18(width=16)", recipe=args.recipe, attack=attack,
                        rate=0.1, target=0, all_to_all=False, defense=defense, setting=setting, seed=args.seed)
            if (row := table.find(**cell)) and same_model(row, infected):
                print(f"skip {src.name} {defense}: already in the table")
                continue
            if row:
                print(f"{src.name} {defense}: the stored row is of an earlier build of this infected model; rerun")
            if defense in ("pbe", "aft") and (row := copy_pbe_row(cell)) and same_model(row, infected):
                table.add(row)
                print(f"{src.name} {defense}: copied from pbe_cifar10.json")
                continue
            name, variant = registered(defense)
            params = {**({} if args.paper_budget else cpu_budget(name, args.recipe)), **variant}
            out = RUNS / "defenses_cifar10" / f"{src.name}_{defense}"
            cmd = ["pbe", "defend", "--defense", name, "--model", str(src), "--dataset", "cifar10",
                   "--data-root", args.data_root, "--poison-from", str(src), "--seed", str(args.seed),
                   "--out", str(out), "--no-progress", "--clean-fraction", "0.05"]
            for k, v in params.items():
                cmd += ["--param", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
            m = run_cell(cmd, out)
            report = json.loads((ROOT / out / "report.json").read_text())
            b, a = report["before"], report["after"]
            table.add({**cell, "acc": a["acc"], "asr": a["asr"], "ra": a["ra"], "acc_before": b["acc"],
                       "asr_before": b["asr"], "ra_before": b["ra"], "der": report.get("der"),
                       "detection": report.get("detection"), "wall_s": report["wall_s"],
                       "epoch_equivalents": report["epoch_equivalents"], "command": m["command"],
                       "hardware": report["hardware"], "toolkit_version": toolkit_version(),
                       "params": report["params"], "budget": "paper" if args.paper_budget else "cpu"})
            print(f"{src.name} {defense}: acc {b['acc']:.4f}->{a['acc']:.4f} asr {b['asr']:.4f}->{a['asr']:.4f} "
                  f"ee={report['epoch_equivalents']:.2f} wall={report['wall_s']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
