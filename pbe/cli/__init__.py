"""Command line: ``pbe train | evaluate | data | attack | erase | defend | detect | analyze | demo | zoo``.

One module per command group, each with ``register(sub)``; user mistakes print one line and exit 2.
"""
from __future__ import annotations

import argparse
import sys

from pbe.cli import attack, defend, train, zoo
from pbe.utils import PBEError


def parser() -> argparse.ArgumentParser:
    from pbe import __version__
    ap = argparse.ArgumentParser(prog="pbe", description="Backdoor defence toolkit (Progressive Backdoor Erasing).")
    ap.add_argument("--version", action="version", version=f"pbe {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    for group in (train, attack, defend, zoo):
        group.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        args.func(args)
    except PBEError as err:
        print(f"pbe {args.command}: error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"pbe {args.command}: error: {err.strerror}: {err.filename}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0

