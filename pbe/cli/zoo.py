"""``pbe zoo list | build``: the committed model zoo from the command line."""
from __future__ import annotations

from pathlib import Path

from pbe.zoo import SETS, available, build, get, is_built, row
from pbe.utils import PBEError


def register(sub) -> None:
    """``pbe zoo list`` and ``pbe zoo build NAME... | --all [--set dev]``."""
    p = sub.add_parser("zoo", help="list, build or check the committed model zoo")
    zsub = p.add_subparsers(dest="zoo_command", required=True)
    q = zsub.add_parser("list", help="the zoo's entries and whether each is built")
    q.add_argument("--set", choices=SETS, dest="zoo_set")
    q.set_defaults(func=_cmd_list)
    q = zsub.add_parser("build", help="train missing entries (resumable) and copy them into the zoo")
    q.add_argument("names", nargs="*", help="entry names (see `pbe zoo list`)")
    q.add_argument("--all", action="store_true", help="every entry (of --set, if given)")
    q.add_argument("--set", choices=SETS, dest="zoo_set")
    q.add_argument("--data-root", type=Path, help="dataset folder (default: ../shared/data/<dataset>)")
    q.add_argument("--runs", type=Path, default=Path("runs/zoo"), help="work folder (default: runs/zoo)")
    q.add_argument("--force", action="store_true", help="retrain a built entry and compare its checksum")
    q.set_defaults(func=_cmd_build)


def _cmd_list(args) -> list[str]:
    names = available(args.zoo_set)
    for n in names:
        r = row(n) if is_built(n) else None
        state = "not built" if r is None else f"acc {100 * r['acc']:.2f}" + (
            "" if r["asr"] is None else f" asr {100 * r['asr']:.2f}")
        print(f"{n:40s} {get(n).set:15s} {state}")
    return names


def _cmd_build(args) -> list[dict]:
    names = args.names or []
    if args.all:
        names = available(args.zoo_set)
    elif args.zoo_set and not names:
        raise PBEError("pass entry names or --all (with --set to build one set)")
    if not names:
        raise PBEError("name the entries to build, or pass --all; see `pbe zoo list`")
    for n in names:
        get(n)  # every name checked before any training starts
    return [build(n, args.data_root, args.runs, args.force) for n in names]
