"""Lazy per-shape CUDA graphs for compiled compute pieces.

Design (the reasons are the hard-won ones from vLLM, SGLang and torch's cudagraph_trees):

* **One key per step, not per piece.** The stitched graph computes a shape key once per call (the
  values of the batch symbols, never the per-step KV position) and every runner uses it. Either
  every piece has seen the key (all replay) or none has (all capture, in execution order). That
  makes sharing one pool safe: a capture never allocates over memory that a replayed piece's output
  still occupies, because in a capturing step every earlier output is a real, owned tensor.
* **One pool for everything.** ``torch.cuda.graph_pool_handle()`` is shared by every piece, size
  and compiled graph in the process. Captured outputs are kept only as non-owning aliases, so once
  the step that captured them ends, their memory goes back to the pool for the next capture.
* **No gc.collect()/empty_cache() per capture.** ``torch.cuda.graph`` runs both on every capture
  (seconds per size in vLLM's measurements); we drive ``CUDAGraph.capture_begin/end`` directly.
* **Inputs.** Parameters and buffers are captured in place. Outputs of earlier captured pieces are
  captured in place (same key → same address). Anything else (user inputs, attention outputs) is
  copied into a buffer the runner owns. On replay an input whose address differs from the
  captured one is copied into the captured buffer: never a replay on stale data, and no copy when
  the address is already right.
* **Outputs.** Outputs the user sees are cloned out of the pool unless ``clone_outputs=False``: the
  next replay would overwrite them (torch raises on that, vLLM silently aliases).
* **Loud fallback.** A capture that fails warns once with the reason and the piece runs compiled
  but un-graphed for that key.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Any, Callable

import torch

from . import _torch_internals
from .stats import PieceStats

log = logging.getLogger("piecewise_backend")

_POOLS: dict[int, Any] = {}


def shared_graph_pool(device: torch.device):
    """The process-wide graph memory pool of one device (created on first use).

    A pool lives only while some graph captured into it lives; once the last one dies (e.g. after
    ``torch._dynamo.reset()``) the allocators free it, and capturing into the stale handle trips
    their asserts (seen on torch 2.11: ``use_count > 0 INTERNAL ASSERT FAILED`` in the device and the
    pinned-host allocator; a ``torch.cuda.MemPool`` keeps only the device side alive). So the pool
    is opened with a one-kernel *keeper* graph that this module holds for the life of the process.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _POOLS:
        with torch.cuda.device(index):
            handle = torch.cuda.graph_pool_handle()
            keeper = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                keeper.capture_begin(pool=handle)
                torch.zeros(1, device=f"cuda:{index}").add_(1)
                keeper.capture_end()
            torch.cuda.current_stream().wait_stream(side)
            _POOLS[index] = (handle, keeper)
    return _POOLS[index][0]


@dataclasses.dataclass
class StepState:
    """What the stitched graph tells every runner about the current call."""

    graphing: bool = False
    key: tuple = ()
    pool_ptrs: set = dataclasses.field(default_factory=set)  # outputs captured during this call


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    checks: list  # (arg index, captured buffer, captured data_ptr) for every tensor input
    outputs: Any  # the piece's output structure, tensors as non-owning aliases
    moved_static: set = dataclasses.field(default_factory=set)


class PieceRunner:
    """Runs one compiled compute piece: replayed from a CUDA graph per shape key when it can be.

    Args:
        name: submodule name in the split graph.
        fn: the Inductor-compiled piece, called with positional args.
        static_args: indices of args that are parameters/buffers (fixed addresses).
        escaping_outputs: indices of outputs the user sees (cloned out of the pool).
        step: the state the stitched graph shares with its runners.
    """

    def __init__(self, name: str, fn: Callable, static_args: frozenset, escaping_outputs: frozenset,
                 step: StepState, stats: PieceStats, warmup_runs: int, clone_outputs: bool):
        self.name = name
        self.fn = fn
        self.static_args = static_args
        self.escaping_outputs = escaping_outputs
        self.step = step
        self.stats = stats
        self.warmup_runs = warmup_runs
        self.clone_outputs = clone_outputs
        self.captures: dict[tuple, _Captured] = {}
        self.failed_keys: set = set()

    def __call__(self, *args):
        step = self.step
        if not step.graphing or step.key in self.failed_keys:
            self.stats.ungraphed_runs += 1
            return self.fn(*args)
        captured = self.captures.get(step.key)
        if captured is None:
            return self._capture(step.key, args)
        for i, buf, ptr in captured.checks:
            arg = args[i]
            if arg.data_ptr() != ptr:
                self._copy_in(captured, i, buf, arg)
        captured.graph.replay()
        self.stats.replays += 1
        return self._user_outputs(captured.outputs)

    # -- replay helpers ---------------------------------------------------------------------------

    def _copy_in(self, captured: _Captured, i: int, buf: torch.Tensor, arg: torch.Tensor) -> None:
        if i in self.static_args and i not in captured.moved_static:
            captured.moved_static.add(i)
            warnings.warn(
                f"piecewise: {self.name}: parameter/buffer input {i} moved since its CUDA graph was "
                f"captured; copying it into the captured buffer every step. Recompile the model after "
                f"replacing or moving its weights (torch._dynamo.reset()).", stacklevel=3)
        buf.copy_(arg)
        self.stats.input_copies += 1

    def _user_outputs(self, outputs):
        if not (self.clone_outputs and self.escaping_outputs):
            return outputs
        if not isinstance(outputs, tuple):
            return outputs.clone()
        return tuple(o.clone() if i in self.escaping_outputs and isinstance(o, torch.Tensor) else o
                     for i, o in enumerate(outputs))

    # -- capture ----------------------------------------------------------------------------------

    def _capture(self, key: tuple, args: tuple):
        start = time.perf_counter()
        try:
            for _ in range(self.warmup_runs):
                self.fn(*args)
            captured, outputs = self._record(args)
        except Exception as exc:  # capture is an optimisation: fall back loudly, never crash
            reason = f"capture at shape key {key} failed ({type(exc).__name__}: {exc}); running un-graphed"
            self.failed_keys.add(key)
            self.stats.failures.append(reason)
            warnings.warn(f"piecewise: {self.name}: {reason}", stacklevel=3)
            torch.cuda.synchronize()
            self.stats.ungraphed_runs += 1
            return self.fn(*args)
        self.captures[key] = captured
        elapsed = time.perf_counter() - start
        self.stats.captures += 1
        self.stats.capture_seconds += elapsed
        self.stats.keys.append(key)
        log.info("piecewise: captured %s at shape key %s in %.1f ms", self.name, key, elapsed * 1e3)
        return self._user_outputs(outputs)

    def _record(self, args: tuple):
        step = self.step
        capture_args = list(args)
        checks = []
        device = None
        for i, arg in enumerate(args):
            if not isinstance(arg, torch.Tensor):
                continue
            device = device or arg.device
            if i in self.static_args:
                buf = arg  # parameters keep their address; held strongly like the model does
            elif arg.data_ptr() in step.pool_ptrs:
                buf = _torch_internals.non_owning_alias(arg)  # an earlier piece's captured output
            else:
                buf = arg.clone(memory_format=torch.preserve_format)  # a buffer this runner owns
                capture_args[i] = buf
            checks.append((i, buf, buf.data_ptr()))

        graph = torch.cuda.CUDAGraph()
        pool = shared_graph_pool(device or torch.device("cuda"))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.capture_begin(pool=pool)
            try:
                outputs = self.fn(*capture_args)
            finally:
                graph.capture_end()  # always: a capture left open poisons every later one
        torch.cuda.current_stream().wait_stream(side)
        graph.replay()  # capture does not run kernels; this call's outputs come from a replay

        flat = outputs if isinstance(outputs, tuple) else (outputs,)
        aliases = []
        for o in flat:
            if isinstance(o, torch.Tensor) and o.is_cuda:
                step.pool_ptrs.add(o.data_ptr())
                aliases.append(_torch_internals.non_owning_alias(o))
            else:
                aliases.append(o)
        stored = tuple(aliases) if isinstance(outputs, tuple) else aliases[0]
        return _Captured(graph, checks, stored), outputs
