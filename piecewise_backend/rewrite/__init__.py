"""Stage 1, rewrite: per-step ints read from a device tensor, so a decode step can be graphed.

Takes Dynamo's graph and the names of its parameters/buffers; gives the rewritten graph with one
more input, the step scalars (a :class:`Rewrite`), or None where it finds no decode step.
:func:`rewrite_decode` (``decode_rewrite.py``) is the one entry point; each rewrite has its own
module (KV writes, attention over a growing prefix, RoPE reads, step ranges). The attention op it
inserts lives in ``ops/``.
"""

from .decode_rewrite import Rewrite, rewrite_decode
from .kv_writes import kv_written_inputs
from .step_scalars import PLACEHOLDER, example_tensor

__all__ = ["PLACEHOLDER", "Rewrite", "example_tensor", "kv_written_inputs", "rewrite_decode"]
