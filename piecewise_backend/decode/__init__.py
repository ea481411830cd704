"""Decode-step rewrites: per-step ints read from a device tensor, so a decode step can be graphed.

:func:`rewrite_decode` (``rewrite.py``) is the one entry point; each rewrite has its own module.
"""

from .kv_writes import kv_written_inputs
from .rewrite import Rewrite, rewrite_decode
from .step_scalars import PLACEHOLDER, StepScalars

__all__ = ["PLACEHOLDER", "Rewrite", "StepScalars", "kv_written_inputs", "rewrite_decode"]
