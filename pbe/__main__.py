"""`python -m pbe`: the command line (``pbe.cli``), started by the interpreter that runs it."""
import sys

from pbe.cli import main

if __name__ == "__main__":
    sys.exit(main())
