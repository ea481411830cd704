"""``cudagraph_mode(...)``: the caller says, per call, how a call may be graphed.

The backend cannot know whether an opaque op (a serving engine's attention) is safe inside a graph
for *this* call: the same op reads per-step metadata from host structures in a mixed prefill step
and from persistent device buffers in a decode step. The caller knows. So, as vLLM's
``cudagraph_runtime_mode`` in its forward context, the caller says it around the call::

    with piecewise_backend.cudagraph_mode("full"):      # every op here may be captured
        hidden = compiled(input_ids, positions)

* ``"piecewise"`` (the default): compute pieces replay their graphs, splitting ops run eagerly;
* ``"full"``: the whole call, splitting ops included, is one CUDA graph per size, captured lazily
  on first sight and replayed after (``full_graph.py``); where it cannot be (an op tagged
  ``cudagraph_unsafe``, a capture that failed) the call runs piecewise, and the stats say why;
* ``"none"``: compiled, un-graphed (a profiling run).

A context variable: each thread (and each asyncio task) has its own mode, and calls of a compiled
graph read it once per call (what the capture policy decides with it: ``capture/policy.py``).
"""

from __future__ import annotations

import contextlib
import contextvars

from ..kinds import GraphMode

_MODE: contextvars.ContextVar = contextvars.ContextVar("piecewise_cudagraph_mode", default=GraphMode.PIECEWISE)

current_mode = _MODE.get  # per call: the mode of the calling thread or task


@contextlib.contextmanager
def cudagraph_mode(mode: str):
    """Graph the compiled calls inside the block as ``mode`` says: ``"full"``, ``"piecewise"`` or ``"none"``."""
    try:
        chosen = GraphMode(mode)
    except ValueError:
        raise ValueError(
            f"piecewise: cudagraph_mode({mode!r}): use one of {', '.join(repr(m.value) for m in GraphMode)}"
        ) from None
    token = _MODE.set(chosen)
    try:
        yield
    finally:
        _MODE.reset(token)
