"""Captures that register no random-number generator: the CUDA runtime's own capture calls, torch's
allocator routed to the graph pool. The torch internals of capture without a generator, here and
nowhere else (the package's others: the rest of this folder; checked on torch 2.11 and 2.13):
``torch._C._cuda_beginAllocateCurrentThreadToPool``, ``_cuda_endAllocateToPool``,
``_cuda_releasePool``, ``_cuda_getCurrentRawStream``, and ``libcudart`` through ``ctypes``.

Why: on torch 2.11, ``CUDAGraph.capture_begin`` registers the state that the default CUDA
generator holds and marks it "capturing" until ``capture_end``; any other thread's random op on
the default generator meanwhile raises "Offset increment outside graph capture encountered
unexpectedly". Pointing the generator at a private state for the begin (``graphsafe_set_state``)
only narrows the window: ``capture_begin`` releases the GIL, and a draw on another thread inside
that window meets the private, marked state (``"threads"``, ``benchmarks/README.md``). torch 2.12
registers a generator on its first use inside a capture (pytorch#176753), so there a plain
``CUDAGraph`` marks nothing for a piece that draws nothing. Here, for torch < 2.12, a piece that
draws no random numbers is captured by ``cudaStreamBeginCapture``/``cudaStreamEndCapture``
directly: no generator is touched at all. What ``CUDAGraph.capture_begin``/``capture_end`` do
besides the generator, this does too: allocations of the capturing thread go to the graph pool,
whose use count the graph holds until it is destroyed (as ``CUDAGraph.reset`` releases it).
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading

import torch

_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal: other threads' syncs and mallocs stay legal
_INSTANTIATE_FLAGS = 1 | 8  # AutoFreeOnLaunch | UseNodePriority: what CUDAGraph::instantiate passes
_LOCK = threading.Lock()
_RUNTIME: list = []  # [the loaded libcudart, or the reason it could not be loaded]


def _load_cudart():
    """The CUDA runtime torch was built against (its pip package's library first, else the loader's)."""
    major = (torch.version.cuda or "12").split(".")[0]
    site = os.path.dirname(os.path.dirname(torch.__file__))
    found = sorted(glob.glob(os.path.join(site, "nvidia", "**", f"libcudart.so.{major}*"), recursive=True))
    for name in (*found, f"libcudart.so.{major}", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        for fn in (
            "cudaStreamBeginCapture",
            "cudaStreamEndCapture",
            "cudaGraphInstantiateWithFlags",
            "cudaGraphLaunch",
            "cudaGraphExecDestroy",
            "cudaGraphDestroy",
            "cudaGetErrorString",
            "cudaGetLastError",
        ):
            getattr(lib, fn).restype = ctypes.c_char_p if fn == "cudaGetErrorString" else ctypes.c_int
        return lib
    return f"no libcudart.so.{major} found (looked in {site}/nvidia and the loader's path)"


def cudart():
    """libcudart, loaded once (a str: why it could not be)."""
    with _LOCK:
        if not _RUNTIME:
            _RUNTIME.append(_load_cudart())
    return _RUNTIME[0]


def capture_marks_default_generator() -> bool:
    """Does ``CUDAGraph.capture_begin`` mark the default CUDA generator's state (torch < 2.12)?"""
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return (major, minor) < (2, 12)


class RawGraph:
    """One CUDA graph captured without torch's ``CUDAGraph``: ``replay()`` launches it on the
    current stream; destroying it releases its hold on the pool."""

    def __init__(self, device_index: int, pool):
        self.device_index, self.pool = device_index, tuple(pool)
        self._graph, self._exec = ctypes.c_void_p(), ctypes.c_void_p()
        self._holds_pool = False
        self._rt = cudart()

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed: {self._rt.cudaGetErrorString(code).decode()} (cudaError {code})")

    def _end(self, stream) -> int:
        """End the capture; on failure, take the error back from the runtime's last error, where torch's
        next launch check would otherwise find it and raise it from an unrelated op (as
        ``AT_CUDA_CHECK`` resets it in ``CUDAGraph.capture_end``)."""
        code = self._rt.cudaStreamEndCapture(stream, ctypes.byref(self._graph))
        if code != 0:
            self._rt.cudaGetLastError()
        return code

    def capture(self, fn):
        """``fn()`` captured on the current stream (a side stream: never the default one); its result."""
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device_index).cuda_stream)
        torch._C._cuda_beginAllocateCurrentThreadToPool(self.device_index, self.pool)
        self._holds_pool = True  # begin takes a use of the pool; released with the graph
        try:
            self._check(self._rt.cudaStreamBeginCapture(stream, _THREAD_LOCAL), "cudaStreamBeginCapture")
            try:
                result = fn()
            finally:
                ended = self._end(stream)
            self._check(ended, "cudaStreamEndCapture")
        finally:
            torch._C._cuda_endAllocateToPool(self.device_index, self.pool)
        try:
            self._check(
                self._rt.cudaGraphInstantiateWithFlags(
                    ctypes.byref(self._exec), self._graph, ctypes.c_ulonglong(_INSTANTIATE_FLAGS)
                ),
                "cudaGraphInstantiateWithFlags",
            )
        finally:  # the executable graph is all a replay needs (CUDAGraph drops its graph the same way)
            self._rt.cudaGraphDestroy(self._graph)
            self._graph = ctypes.c_void_p()
        return result

    def replay(self) -> None:
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        self._check(self._rt.cudaGraphLaunch(self._exec, ctypes.c_void_p(stream)), "cudaGraphLaunch")

    def __del__(self):
        try:
            if self._exec:
                self._rt.cudaGraphExecDestroy(self._exec)
            if self._graph:
                self._rt.cudaGraphDestroy(self._graph)
            if self._holds_pool:
                torch._C._cuda_releasePool(self.device_index, self.pool)
        except Exception:  # at interpreter exit the runtime or torch may be gone already
            pass
