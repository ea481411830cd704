"""The switch that makes graphs compiled from CPU inputs emulate CUDA graphs (tests, CI without a GPU).

Read when a graph is planned (``making.py``): a graph compiled inside ``with emulated_graphs():``
gets runners as on CUDA, whose graphs ``runtime/emulation.py``'s :class:`EmulatedGraph` stands in
for. For tests, benchmarks and the notebooks of this package, not for users (emulation is slower
than running the pieces plainly; the README leaves it out). The choice is made when a graph is
compiled: a graph Dynamo compiles again after the block (a new shape it guards on) does not emulate.
"""

from __future__ import annotations

import contextlib
import contextvars

_EMULATING = contextvars.ContextVar("piecewise_emulated_graphs", default=False)


@contextlib.contextmanager
def emulated_graphs(on: bool = True):
    """Graphs compiled inside the block emulate CUDA graphs on CPU (see the module docstring)."""
    token = _EMULATING.set(on)
    try:
        yield
    finally:
        _EMULATING.reset(token)


def emulating() -> bool:
    return _EMULATING.get()
