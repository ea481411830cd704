"""One object per CUDA device for everything capture shares there: the graph pool and the stream.

Lifecycle of a :class:`DeviceGraphs` (modelled on cudagraph_trees' per-device manager):

1. created on the first capture on its device (:func:`device_graphs`), and kept for the process;
2. its pool is opened on first use, with a one-kernel *keeper* graph that keeps it alive;
3. every capture of every piece, size and compiled graph on the device runs on its one capture
   stream, into that pool (:meth:`DeviceGraphs.record`);
4. a capture that raised retires the pool (graphs already captured in it keep working) and opens a
   fresh one (:meth:`DeviceGraphs.recover`);
5. :meth:`DeviceGraphs.pool_bytes` measures what the live and retired pools hold.

Why captures leave the rest of the process alone (a server captures lazily while other threads
copy results out, sample, allocate):

* every capture runs in ``"thread_local"`` capture error mode: another thread's sync or
  ``cudaMalloc`` neither fails nor invalidates our capture (in torch's default ``"global"`` mode
  both fail: measured on the H200, 50 errors in a background thread over 200 lazily capturing calls);
* a piece that draws no random numbers is captured without the default CUDA generator: torch
  2.11 marks the state that the default generator holds when a capture begins as "capturing"
  until it ends, and any other thread's random op on it then raises "Offset increment outside
  graph capture encountered unexpectedly". There, such pieces are captured by the CUDA runtime's
  own calls (``_torch_internals/cuda_capture.py``), which touch no generator; elsewhere the
  generator's state is set aside for ``capture_begin`` (:class:`GeneratorAside`). Pieces that
  draw random numbers are captured by torch with the default generator registered, so their
  replays advance it, and pieces that read host tensors by torch with it set aside (torch's
  capture keeps the pinned memory of a copy to the device for the graph); beside those
  captures, another thread's draw can still fail on torch 2.11.

Why one pool: captured outputs are kept only as non-owning aliases, so memory freed by one step's
capture is reused by the next capture, of any piece or size. Why one stream: cuBLAS keeps a
workspace per stream, and the first matmul on a new stream allocates it inside the capture, so from
the pool and for good (about 1 GB for one size of a 16-layer model on the H200 with
``torch.cuda.graph``'s fresh stream per capture).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _torch_internals
from .._torch_internals.cuda_capture import RawGraph, capture_marks_default_generator, cudart
from .call_guard import call_guard


def synchronize(device: torch.device | str) -> None:
    """Wait for the GPU (a no-op for CPU devices); never while the capture thread records on it: a
    device-wide synchronize fails while any stream of the device is capturing, whatever the capture
    mode (NVIDIA/TensorRT#2888), and breaks that capture."""
    device = torch.device(device)
    if device.type == "cuda":
        with call_guard(device).capture_lock:
            torch.cuda.synchronize(device)


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class DeviceGraphs:
    """The graph pool (with its keeper), the retired pools and the capture stream of one device."""

    def __init__(self, index: int):
        self.index = index
        self.stream = torch.cuda.Stream(device=index)
        self.generator = GeneratorAside(index)
        self._pool: tuple | None = None  # (handle, keeper graph)
        self._retired: list[tuple] = []  # (handle, keeper) of pools given up after a failed capture
        self._graphs_in_pool = 0  # captures that succeeded into the live pool

    @property
    def pool(self):
        """The live pool's handle, opened on first use.

        A pool lives only while some graph captured into it lives; once the last one dies (e.g.
        after ``torch._dynamo.reset()``) the allocators free it, and capturing into the stale
        handle trips their asserts (seen on torch 2.11: ``use_count > 0 INTERNAL ASSERT FAILED`` in
        the device and the pinned-host allocator; a ``torch.cuda.MemPool`` keeps only the device
        side alive). So the pool is opened with a one-kernel keeper graph held here.
        """
        if self._pool is None:
            with torch.cuda.device(self.index):
                handle = torch.cuda.graph_pool_handle()
                keeper = torch.cuda.CUDAGraph()
                try:
                    self._record(keeper, handle, lambda: torch.zeros(1, device=f"cuda:{self.index}").add_(1))
                except Exception:
                    _torch_internals.stop_pool_recording(self.index, handle)  # the next capture opens another
                    raise
                self._pool = (handle, keeper)
        return self._pool[0]

    def record(
        self,
        fn: Callable[[], Any],
        warmup_runs: int = 0,
        after_warmup: Callable[[], None] | None = None,
        draws_random: bool = False,
        args: tuple = (),
    ) -> tuple[Any, Any]:
        """Run ``fn()`` ``warmup_runs`` times, then capture it in this device's pool; return (the graph,
        the captured call's result). The graph has ``replay()``.

        ``draws_random``: ``fn`` uses the default CUDA generator (its captured kernels must advance
        it on replay, so it is registered with the graph). ``args``: what ``fn`` reads; one on the
        host (a copy to the device inside the capture takes pinned memory, which torch's capture
        keeps for the graph) keeps torch's capture too. Otherwise the capture leaves the generator
        alone (:func:`_begin_route`).
        """
        pool = self.pool
        on_host = any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args)
        route = "torch" if draws_random else "aside" if on_host else _begin_route()
        graph = RawGraph(self.index, pool) if route == "raw" else torch.cuda.CUDAGraph()
        result = self._record(graph, pool, fn, warmup_runs, after_warmup, route)
        self._graphs_in_pool += 1
        return graph, result

    def _record(self, graph, pool, fn, warmup_runs: int = 0, after_warmup=None, route: str = "aside"):
        """What ``torch.cuda.graph`` does minus its ``gc.collect()`` and ``empty_cache()`` per capture
        (seconds per size in vLLM's measurements) and its new stream per capture.

        ``capture_end`` always runs: a capture left open poisons every later one. cuBLAS's
        workspaces are freed just before the capture begins, so the captured matmuls use a workspace
        from the pool, never one that someone else can free under the graph
        (:func:`_torch_internals.free_cublas_workspaces`).
        """
        side = self.stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup_runs):
                fn()
            if after_warmup is not None:
                after_warmup()
            _torch_internals.free_cublas_workspaces()
            if route == "raw":
                result = graph.capture(fn)
            else:
                result = self._torch_capture(graph, pool, fn, route)
        torch.cuda.current_stream().wait_stream(side)
        return result

    def _torch_capture(self, graph: torch.cuda.CUDAGraph, pool, fn, route: str):
        if route == "aside":
            self.generator.capture_begin(graph, pool)
        else:
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            result = fn()
        except BaseException:
            try:
                graph.capture_end()
            except Exception:  # the capture is broken either way: fn's error says why, not this one
                pass
            raise
        graph.capture_end()
        return result

    def recover(self) -> None:
        """Leave no trace of a capture that raised, so later captures work.

        A failed capture can leave the allocator recording into the pool and the CUDA RNG in capture
        mode (then any random op raises "Offset increment outside graph capture encountered
        unexpectedly"; seen on torch 2.11). We stop the recording, retire the pool and open a fresh
        one right away: its keeper capture is a capture that succeeds, which puts the RNG back. A
        pool that no capture succeeded in is not kept: its keeper goes with it, and what the
        failed captures allocated is handed back (``empty_cache``), not held for the process (an
        attention op nobody declared made every capture fail and kept 630 MiB, seen on the H200).
        """
        if self._pool is None:
            return
        _torch_internals.stop_pool_recording(self.index, self._pool[0])
        failed_only = self._graphs_in_pool == 0
        if not failed_only:
            self._retired.append(self._pool)  # its graphs keep replaying from it
        self._pool, self._graphs_in_pool = None, 0
        try:
            torch.cuda.synchronize(self.index)
            if failed_only:  # nothing but the failed captures' memory: hand it back
                torch.cuda.empty_cache()
            self.pool  # noqa: B018 - opens the fresh pool now
        except Exception:  # called while falling back: never raise there; the next capture opens one
            pass

    def pool_bytes(self) -> int:
        """Bytes the CUDA allocator holds for this device's pools, live and retired (measured: the
        sum of their segments in ``torch.cuda.memory_snapshot()``; segments stay with a pool once
        allocated, so this is its high-water mark)."""
        handles = {tuple(h) for h, _ in self._retired}
        if self._pool is not None:
            handles.add(tuple(self._pool[0]))
        if not handles:
            return 0
        return sum(
            seg["total_size"]
            for seg in torch.cuda.memory_snapshot()
            if seg.get("device") == self.index and tuple(seg.get("segment_pool_id", ())) in handles
        )


class GeneratorAside:
    """Begins captures with the default CUDA generator pointing at a private state.

    ``CUDAGraph.capture_begin`` registers whatever state the device's default generator holds with
    the graph and marks it capturing until ``capture_end`` (torch 2.11; 2.13 keeps capture state
    per capture and has no such mark). Pointed at a private state for the begin and back at once
    (``graphsafe_set_state`` shares a state, it copies nothing), the default generator that other
    threads draw from is marked only for the few microseconds of ``capture_begin`` itself, not for
    the whole capture. Only for pieces that draw no random numbers: their graphs never read a
    generator, so which state is registered with them does not matter.
    """

    def __init__(self, index: int):
        self.default = torch.cuda.default_generators[index]
        self.private = torch.Generator(device=f"cuda:{index}")

    def capture_begin(self, graph: torch.cuda.CUDAGraph, pool) -> None:
        own = self.default.graphsafe_get_state()
        self.default.graphsafe_set_state(self.private)
        try:
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        finally:
            self.default.graphsafe_set_state(own)


def _begin_route() -> str:
    """How a piece that draws no random numbers is captured: ``"raw"`` where ``capture_begin``
    marks the default generator (torch < 2.12) and libcudart loads: the CUDA runtime's own capture
    (``_torch_internals/cuda_capture.py``), which touches no generator; else ``"aside"``, a ``CUDAGraph`` begun
    with :class:`GeneratorAside` (on torch < 2.12 that leaves a window of microseconds per capture
    in which another thread's draw fails; 2.12+ marks no generator a capture does not use)."""
    return "raw" if capture_marks_default_generator() and not isinstance(cudart(), str) else "aside"


_DEVICES: dict[int, DeviceGraphs] = {}


def device_graphs(device: torch.device) -> DeviceGraphs:
    """The :class:`DeviceGraphs` of a CUDA device (created on first use, kept for the process)."""
    index = device_index(device)
    if index not in _DEVICES:
        _DEVICES[index] = DeviceGraphs(index)
    return _DEVICES[index]


def pool_bytes(device: torch.device | int | None = None) -> int:
    """Bytes the CUDA allocator holds for this package's graph pools on ``device`` (0 if none yet)."""
    if not torch.cuda.is_available():
        return 0
    index = device if isinstance(device, int) else device_index(device or torch.device("cuda"))
    return _DEVICES[index].pool_bytes() if index in _DEVICES else 0
