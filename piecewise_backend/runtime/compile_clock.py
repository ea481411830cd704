"""Seconds of compiling that callers waited for: ``process_stats()["request_path_compile_s"]``.

A server's first requests should compile nothing: whatever a new size compiles belongs in the
warm-up, in the capture thread, or in a saved artifact. This clock shows whether it did. It adds up,
in every thread but the package's own (the capture thread: ``piecewise-*``):

* Dynamo's compiles (a recompile for a new shape it guards on, the backend's work inside it), from
  Dynamo's compile callbacks (``_torch_internals.on_dynamo_compiles``);
* Triton's JIT compiles outside a Dynamo compile (a kernel of this package, or any ``@triton.jit``
  kernel, meeting an argument value it specialises on: a row count of 1, or one divisible by 16),
  from Triton's ``knobs.runtime.jit_cache_hook`` (before the compile, on a miss of its in-memory
  cache) and ``jit_post_compile_hook`` (after it): Triton 3.4 to 3.6. Hooks already set are kept
  and called first; a Triton without knobs leaves this part out.

Installed by the backend's first compile (:func:`install`), so its clock starts there.
"""

from __future__ import annotations

import threading
import time

from .. import _torch_internals

_SECONDS = [0.0]
_LOCK = threading.Lock()
_LOCAL = threading.local()  # per thread: depth of Dynamo compiles, their start, Triton compiles' starts
_INSTALLED: list = []


def request_path_compile_seconds() -> float:
    return _SECONDS[0]


def _counted() -> bool:
    return not threading.current_thread().name.startswith("piecewise-")


def _add(seconds: float) -> None:
    with _LOCK:
        _SECONDS[0] += seconds


def _dynamo_start() -> None:
    depth = getattr(_LOCAL, "depth", 0)
    _LOCAL.depth = depth + 1
    if depth == 0:
        _LOCAL.started = time.perf_counter()


def _dynamo_end() -> None:
    depth = getattr(_LOCAL, "depth", 0)
    if depth == 0:  # the compile that installed the clock began before it: not counted
        return
    _LOCAL.depth = depth - 1
    if depth == 1 and _counted():
        _add(time.perf_counter() - _LOCAL.started)


def _triton_hooks() -> None:
    try:
        from triton import knobs
    except ImportError:
        return
    before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook

    def cache_hook(*args, **kwargs):
        if not getattr(_LOCAL, "depth", 0) and _counted():
            _LOCAL.triton = time.perf_counter()
        return before(*args, **kwargs) if before is not None else None  # True would skip the compile

    def post_compile_hook(*args, **kwargs):
        started = getattr(_LOCAL, "triton", None)
        if started is not None:
            _LOCAL.triton = None
            _add(time.perf_counter() - started)
        return after(*args, **kwargs) if after is not None else None

    knobs.runtime.jit_cache_hook = cache_hook
    knobs.runtime.jit_post_compile_hook = post_compile_hook


def install(with_triton: bool) -> None:
    """Start the clock (once per process); ``with_triton``: Triton's compiles too (CUDA graphs)."""
    with _LOCK:
        if "dynamo" not in _INSTALLED:
            _INSTALLED.append("dynamo")
            _torch_internals.on_dynamo_compiles(_dynamo_start, _dynamo_end)
        if with_triton and "triton" not in _INSTALLED:
            _INSTALLED.append("triton")
            _triton_hooks()
