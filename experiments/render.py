"""Re-render every results table from its JSON: the Markdown table, the CSV beside it and the figure
(PNG) where the table draws one, then the overview figures that read several tables (OVERVIEWS: the
README's first figure). Nothing is measured; run it after editing a renderer
or a JSON.

    python experiments/render.py [--only pbe_cifar10 detect pbe_default_cifar10] [--figures-only]
"""
from __future__ import annotations

import argparse

from grid import HERE, SCRIPTS, load_config, module, script_main

from pbe.plots import _save, before_after


def tables() -> dict:
    """Every table, by the stem of its JSON file."""
    found = {}
    for name in SCRIPTS:
        table = module(name).results_table()
        found[table.json_path.stem] = table
    for path in sorted((HERE / "configs").glob("*.yaml")):
        cfg = load_config(path)
        table = module(cfg["script"]).results_table(cfg)
        found.setdefault(table.json_path.stem, table)
    return found


def default_rows(rows: list[dict], zoo_set: str) -> list[dict]:
    """The rows of PBE's default schedule on one zoo set's models (target not given), the latest per model."""
    from common import row_schedule

    from pbe.defenses.pbe import DEFAULT_SCHEDULE
    latest = {}
    for r in rows:
        if (r["defense"] == "pbe" and row_schedule(r) == DEFAULT_SCHEDULE and r.get("zoo_set") == zoo_set
                and not r.get("given_target") and r.get("asr") is not None):
            latest[r["zoo"]] = r  # a later row of the same model replaces it
    return list(latest.values())


def default_figure(found: dict):
    """PBE's default on the CIFAR-10 zoo: the dev models (its rows in the defences table, where every
    defence ran on the first seven, and in pbe_cifar10, whose later row of a model replaces it) and the
    generalisation set (its rows in pbe_cifar10), ACC and ASR before / after."""
    meets_goal = module("pbe_cifar10").meets_goal
    dev = default_rows(found["defenses_cifar10"].rows + found["pbe_cifar10"].rows, "dev")
    general = default_rows(found["pbe_cifar10"].rows, "generalisation")
    return before_after([("dev-set", dev), ("generalisation-set", general)], meets=meets_goal,
                        titles={"dev-set": f"dev set: the {len(dev)} infected models the defaults are tuned on",
                                "generalisation-set": f"generalisation set: {len(general)} infected models "
                                                      "nobody tuned on"},
                        title="PBE's default on the CIFAR-10 zoo, no clean data, no trigger, no target given "
                              "(green: ASR <= 3 %, ACC drop <= 3 points, <= 3 epoch-equivalents)")


# figures that read several tables (or draw one table another way): file stem -> function of the tables
OVERVIEWS = {"pbe_default_cifar10": default_figure}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="these tables or overview figures only, by the name of their file "
                                              "without suffix (default: all)")
    ap.add_argument("--figures-only", action="store_true", help="write the PNGs only (no .md / .csv)")
    args = ap.parse_args()
    found = tables()
    for name, table in sorted(found.items()):
        if args.only and name not in args.only:
            continue
        if not table.rows:
            print(f"{name}: no rows yet")
            continue
        if args.figures_only:
            fig = table.figure()
            if fig is not None:
                _save(fig, table.json_path.with_suffix(".png"))
                print(f"{name}: {len(table.rows)} rows -> {table.json_path.with_suffix('.png')}", flush=True)
            continue
        table.write()
        made = [p.name for p in (table.json_path.with_suffix(s) for s in (".md", ".csv", ".png")) if p.exists()]
        print(f"{name}: {len(table.rows)} rows -> {', '.join(made)} in {table.json_path.parent}", flush=True)
    results = next(iter(found.values())).json_path.parent
    for name, draw in OVERVIEWS.items():
        if args.only and name not in args.only:
            continue
        fig = draw(found)
        if fig is None:
            print(f"{name}: no rows yet")
            continue
        _save(fig, results / f"{name}.png")
        print(f"{name} -> {results / (name + '.png')}", flush=True)


if __name__ == "__main__":
    script_main(main)
