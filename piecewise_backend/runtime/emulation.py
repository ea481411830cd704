"""CUDA graphs emulated on CPU, so that CI (no GPU) tests capture, replay and padding against eager.

Inside ``with emulated_graphs():`` (``plan/emulation.py``: read when a graph is compiled),
graphs compiled from CPU inputs get runners as on CUDA, with :class:`EmulatedGraph` standing in
for ``torch.cuda.CUDAGraph``; graphs compiled outside the block stay un-graphed on CPU. For tests
and benchmarks of this package, not for users (emulation is slower than running the pieces plainly).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops.capturing import EMULATED_CAPTURE as _CAPTURING


def capturing() -> bool:
    """True while an emulated graph is being captured: on CPU, what
    ``torch.cuda.is_current_stream_capturing()`` says on CUDA (``piecewise_backend.ops.capturing``
    asks both)."""
    return _CAPTURING.get()


def as_tuple(outputs):
    """Compiled pieces return a *list* of outputs (AOTAutograd); treat it like split_module's tuple.

    (Treating the list as one opaque output kept every captured output alive and hid them from the
    next piece, which then copied its input at every replay.)
    """
    return tuple(outputs) if isinstance(outputs, list) else outputs


class EmulatedGraph:
    """A CPU stand-in for a CUDA graph: replay re-runs the piece on the captured input buffers and
    copies the results into the captured outputs, so addresses stay fixed exactly as a graph's do."""

    def __init__(self, fn: Callable, args: list, capture: Callable | None = None):
        """Capture ``fn(*args)`` (run through ``capture`` when given: a watched call of ``fn``)."""
        self.fn, self.args = fn, args
        token = _CAPTURING.set(True)
        try:
            self.outputs = as_tuple((capture or fn)(*args))
        finally:
            _CAPTURING.reset(token)

    def replay(self) -> None:
        flat = self.outputs if isinstance(self.outputs, tuple) else (self.outputs,)
        fresh = as_tuple(self.fn(*self.args))
        for old, new in zip(flat, fresh if isinstance(fresh, tuple) else (fresh,)):
            if isinstance(old, torch.Tensor):
                # an expanded output (stride 0) holds each value once: copy that once
                once = tuple(slice(0, 1) if stride == 0 else slice(None) for stride in old.stride())
                old[once].copy_(new[once])
