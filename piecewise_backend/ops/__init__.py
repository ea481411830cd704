"""The graph-safe attention ops and their kernels: what graphs call at run time, and what engines call.

Takes nothing from the pipeline; gives ``piecewise::prefix_attention`` (``prefix_attention.py``,
registered with ``torch.library`` on import) and its split-key Triton kernel (``kernel.py``), and
the paged decode attention a serving engine calls from its own attention op so that a decode step
can be captured whole (``paged_attention.py``, its kernels in ``paged_kernel.py``), and the question
an op that reads per-step state asks, "am I being captured?" (``capturing.py``). Both the
rewrite (which inserts the op) and run time (which calls it) import it; it imports neither. The
kernels it launches are noted (``kernel_bundle.py``) so that a saved artifact carries them.
"""

from .capturing import capturing
from .paged_attention import paged_cache_write, paged_decode_attention

__all__ = ["paged_decode_attention", "paged_cache_write", "capturing"]
