"""pbe: Progressive Backdoor Erasing and friends, a CPU-friendly backdoor-defence toolkit."""
__version__ = "0.1.0"

from pbe.detection import detect  # noqa: E402
from pbe.checkpoint import load, save  # noqa: E402
from pbe.defenses import Evaluation, aft, erase  # noqa: E402
from pbe.train import train  # noqa: E402

__all__ = ["Evaluation", "aft", "detect", "erase", "load", "save", "train", "__version__"]
