"""Command line: ``pbe train | evaluate | data | attack | erase | defend | detect | analyze | demo | zoo``.

One module per command group, each with ``register(sub)``; user mistakes print one line and exit 2, and
the toolkit's warnings (``PBEWarning``) one line each.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from pbe.cli import attack, defend, train, zoo
from pbe.utils import PBEError, PBEWarning


SIGPIPE_EXIT = 141  # what a shell reports for a command stopped by SIGPIPE (128 + 13)


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block): ``pbe CMD: error: ...``, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    from pbe import __version__
    ap = OneLineParser(prog="pbe", description="Backdoor defence toolkit (Progressive Backdoor Erasing).")
    ap.add_argument("--version", action="version", version=f"pbe {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    for group in (train, attack, defend, zoo):
        group.register(sub)
    return ap


def _warning_printer(command: str):
    """``warnings.showwarning`` for a command: a PBEWarning as one line ``pbe CMD: warning: ...``, others as usual."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, PBEWarning):
            print(f"pbe {command}: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)
    return show


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_printer(args.command)
            args.func(args)
        sys.stdout.flush()  # here, where a reader that went away is caught below, not at the interpreter's exit
    except PBEError as err:
        print(f"pbe {args.command}: error: {'; '.join(s.strip() for s in str(err).splitlines() if s.strip())}",
              file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (``pbe zoo list | head -1``): not an error of the command
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot raise again
        return SIGPIPE_EXIT
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:  # a file the user named: one line
        name = getattr(err, "filename", None)
        what = f"{err.strerror}: {name}" if getattr(err, "strerror", None) and name else str(err) or type(err).__name__
        print(f"pbe {args.command}: error: {what}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0

