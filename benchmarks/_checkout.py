"""The benchmarks run from a checkout: its root goes on ``sys.path`` so that ``toys`` (the toy models,
which are not part of the installed package) imports. Import this before ``toys`` or ``timing``."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
