"""``python -m pbe.cli ...`` (what `pbe zoo build` runs)."""
import sys

from pbe.cli import main

sys.exit(main())
