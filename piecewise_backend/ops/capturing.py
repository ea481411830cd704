"""Is this call being captured into a CUDA graph? The question an op that reads per-step state asks.

An op that reads metadata from outside its arguments (a serving engine's forward context) is wrong
inside a graph: a replay would read the capture step's values. It can say so, or take its
graph-safe path, when :func:`capturing` is True. On CUDA that is torch's own answer for the current
stream; on CPU, where this package's tests emulate graphs (``runtime/emulation.py`` sets the flag
here), the emulated capture's. An emulated capture runs the code it captures, where a CUDA capture
only records it: the package's own ops write nothing while one is under way, as they would not on
a GPU.
"""

from __future__ import annotations

import contextvars

import torch

EMULATED_CAPTURE = contextvars.ContextVar("piecewise_emulated_capture", default=False)


def capturing(t: torch.Tensor | None = None) -> bool:
    """True inside a CUDA capture of the current stream (``t`` on CUDA), or an emulated one (on CPU)."""
    if t is not None and t.is_cuda:
        return torch.cuda.is_current_stream_capturing()
    return EMULATED_CAPTURE.get()
