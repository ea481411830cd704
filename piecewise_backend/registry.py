"""The one registry of the graphs this backend compiled in this process, and what acts on all of them.

Graphs are held weakly: one that Dynamo drops (``torch._dynamo.reset()``, a model garbage
collected) leaves the registry with it. Serial numbers are given here, in compile order; messages,
stats and reports name a graph by its serial.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Iterable

import torch

from .runtime.capture import wait_for_captures as _captures_done
from .runtime.devices import device_index, pool_bytes, synchronize
from .runtime.memory_estimate import estimate

_GRAPHS: weakref.WeakSet = weakref.WeakSet()
_SERIALS = itertools.count(1)


def register(graph):
    """Number ``graph`` (a CompiledGraph) and keep it, weakly; returns it."""
    graph.serial = graph.stats.serial = next(_SERIALS)
    _GRAPHS.add(graph)
    return graph


def compiled_graphs() -> list:
    """Every live graph this backend compiled in this process, oldest first."""
    return sorted(_GRAPHS, key=lambda g: g.serial)


def capture(sizes: Iterable[int] | str = "all") -> dict[int, list[tuple]]:
    """Capture ``sizes`` now in every live compiled graph that can (servers: warm up when idle).

    A graph can once it has been called (its weights and other sizes come from that call) and has
    a dynamic batch size. Returns, per graph serial, the shape keys it captured. Warns, with each
    graph's reason, when no graph can (on CPU, before the first call, ...).
    """
    able, reasons = _able_to_capture()
    if not able:
        warnings.warn(
            f"piecewise: capture({sizes!r}) captured nothing: no compiled graph can capture up front ({reasons})",
            stacklevel=2,
        )
    return {g.serial: g.capture(sizes) for g in able}


def wait_for_captures(timeout: float | None = None) -> bool:
    """Wait until the captures made behind the calls are in: sizes calls met (``capture_behind``)
    and ``eager_capture_sizes``; True if none is left after ``timeout`` seconds (None: no limit).
    A server need not wait: calls meanwhile replay what is captured, ride a larger graph, or run
    un-graphed. Tests and benchmarks wait, to know what the next call will replay."""
    return _captures_done(None, timeout)


def _able_to_capture() -> tuple[list, str]:
    """The live graphs that can capture up front, and each other graph's reason it cannot."""
    graphs = compiled_graphs()
    able = [g for g in graphs if g.can_capture_up_front]
    reasons = "; ".join(g.up_front.refusal() for g in graphs if g not in able) or "nothing has been compiled yet"
    return able, reasons


def estimate_graph_memory(sizes: Iterable[int] | str = "all", graph=None):
    """The graph memory ``sizes`` need (pool and input buffers), from two captures
    (``runtime/memory_estimate.py``): size a KV cache with what is left. ``graph``: a compiled graph
    (default: the one called most that can capture up front). Captures the largest of ``sizes`` and the
    size next below it if they are not yet."""
    if graph is None:
        able, reasons = _able_to_capture()
        if not able:
            raise RuntimeError(f"piecewise: estimate_graph_memory: no compiled graph can capture up front ({reasons})")
        graph = max(able, key=lambda g: g.stats.calls)
    return estimate(graph, sizes)


def graph_memory_bytes(device: torch.device | str | int | None = None) -> int:
    """Graph memory on ``device`` (default: the current CUDA device): the graph pool every graph
    there shares (``pool_bytes``) and the buffers each live graph's captures copy their inputs into
    (user inputs, attention outputs: outside the pool, one buffer per input shared by all sizes)."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")

    def on_device(g) -> bool:
        if g.device.type != device.type:
            return False
        return device.type != "cuda" or device_index(g.device) == device_index(device)

    graphs = [g for g in compiled_graphs() if on_device(g)]
    pool = pool_bytes(device) if device.type == "cuda" else 0
    return pool + sum(g.input_buffer_bytes() for g in graphs)


def release_graphs() -> int:
    """Destroy every CUDA graph this backend captured in this process; returns how many shape keys
    were released. The compiled pieces stay, and later calls capture again, lazily, as at first.

    Why: NCCL counts each CUDA graph that captured one of its collectives and
    ``ncclCommDestroy`` waits until all of them are destroyed, so a tensor-parallel program whose
    graphs are still alive hangs in ``torch.distributed.destroy_process_group()`` (pytorch#115388;
    seen with torch 2.11 on two H200s). Call this before destroying the process group. The graph
    pool's memory stays reserved for later captures.
    """
    _captures_done(None)  # no capture being recorded behind the calls meanwhile (its graph would outlive this)
    graphs = compiled_graphs()
    devices = {g.device for g in graphs if g.captured and g.device.type == "cuda"}
    for device in devices:  # no graph is destroyed while a replay of it may still be running
        synchronize(device)
    return sum(g.release_graphs() for g in graphs)
