"""Re-render every results table from its JSON: the Markdown table, the CSV beside it and the figure
(PNG) where the table draws one. Nothing is measured; run it after editing a renderer or a JSON.

    python experiments/render.py [--only pbe_cifar10 detect]
"""
from __future__ import annotations

import argparse

from grid import HERE, SCRIPTS, load_config, module, script_main


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="these tables only, by the name of their JSON (default: all)")
    args = ap.parse_args()
    for name, table in sorted(tables().items()):
        if args.only and name not in args.only:
            continue
        if not table.rows:
            print(f"{name}: no rows yet")
            continue
        table.write()
        made = [p.name for p in (table.json_path.with_suffix(s) for s in (".md", ".csv", ".png")) if p.exists()]
        print(f"{name}: {len(table.rows)} rows -> {', '.join(made)} in {table.json_path.parent}", flush=True)


if __name__ == "__main__":
    script_main(main)
