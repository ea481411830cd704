"""Whole calls as one CUDA graph each (``cudagraph_mode("full")``): capture, replay, fall back.

Piecewise graphs leave every splitting op eager between replays: a decode step of a 28-layer model
pays 28 attention calls' host time (launches and Python) that no piecewise capture removes. When
the caller says a call is graph-safe as a whole (a serving engine's decode step, whose attention
reads its metadata from persistent device buffers), the split graph runs inside one CUDA graph,
splitting ops included; vLLM's ``FULL_AND_PIECEWISE`` does the same for uniform decode batches.

How a full graph is made, on the first call at its (padded) shape key:

1. inputs used in place (weights, inputs some node writes: ``plan/full_graph.py``) are passed as
   they are; the others are copied into buffers this graph owns, padded to the key's batch size;
2. **the call runs once, eagerly, on those buffers**: that is the call's own work (its outputs are
   the ones returned) and the warm-up of every kernel at this shape;
3. the same code is captured into the device's one pool (``devices.py``); a capture executes no
   kernel, so whatever the call writes (a KV cache) is written exactly once.

A replay copies the inputs whose address changed into the owned buffers and replays; outputs are
weak aliases of pool memory, cloned out (``clone_outputs``) or sliced back to the caller's rows.

**Never wrong, never a crash.** A capture that fails (an op that syncs or reads host state) warns
once, naming the op, and that key runs piecewise from then on; the failing call returns what its
eager run computed. If the eager run itself raises (an op that is not graph-safe at the padded size),
the call runs piecewise instead. A replay whose in-place written input moved runs piecewise too. Every
fallback is counted by reason (``stats.full_fallbacks``).
"""

from __future__ import annotations

import time
import weakref

import torch

from .. import _torch_internals, op_names
from ..kinds import CaptureHow, GraphMode
from .buffers import InputArenas, narrowed, owned_copy, weak_alias
from .capture import Route, WholeCapture
from .devices import device_graphs
from .distributed import agreed_refusal
from .emulation import EmulatedGraph, as_tuple
from .symbolic import evaluate, symbol_values

FALLBACK = object()  # what :meth:`FullGraphs.call` returns when the call must run piecewise


class FullGraphs:
    """The full graphs of one :class:`~.compiled_graph.CompiledGraph` (held weakly, as ``capture/up_front.py``
    does): capture and replay; which calls they serve, and the graphs of each weight set, are
    ``capture/decisions.py``'s (``decisions.active.full``)."""

    def __init__(self, graph):
        self.graph = weakref.proxy(graph)
        plan = graph.plan
        self.plan = plan.full
        self.input_specs = plan.inputs.specs
        self.symbols, self.pad_position = plan.key.symbols, plan.key.pad_position
        weights = set(plan.inputs.weight_indices) | plan.inputs.python_scalars | plan.inputs.static_inputs
        self.written = frozenset(i for i in self.plan.in_place if i not in weights)
        self.clone = plan.settings.clone_outputs
        self.arenas = InputArenas()  # the copied inputs' buffers, shared by every key (buffers.py)

    def call(self, route: Route, args: tuple):
        """Serve the call from the full graph ``route`` names (``capture/decisions.py`` chose it),
        capturing it if the route says so, or return :data:`FALLBACK`: then the call runs piecewise."""
        if route.capture:
            return self._capture_whole(route, args)
        return self._replay(route, args)

    def _fall_back(self, reason: str):
        self.graph.stats.full_fallbacks[reason] += 1
        return FALLBACK

    # -- replay ------------------------------------------------------------------------------------

    def _replay(self, route: Route, args: tuple):
        captured = self.graph.decisions.active.full.graphs[route.key]
        for i, address in captured.written:
            if args[i].data_ptr() != address:
                return self._fall_back(f"an input it writes ({self.graph.plan.inputs.names[i]}) is at a new address")
        copies, outputs = (
            (captured.views.get(route.size) or self._slice(captured, route.size))
            if route.padded
            else (captured.copies, captured.outputs)
        )
        for i, buf, address in copies:
            if args[i].data_ptr() != address:
                buf.copy_(args[i])
        self.graph.step.inside_full_graph()  # (an emulated graph re-runs the pieces: as they are)
        captured.graph.replay()
        self.graph.stats.graph_calls[(GraphMode.FULL, self._size_of(route.key))] += 1
        return self._user_outputs(outputs)

    def _slice(self, captured: WholeCapture, size: int):
        """The owned buffers and outputs cut to the caller's ``size`` rows (cached per size)."""
        pad = self.plan.padding
        copies = [
            (i, buf.narrow(pad.arg_dims[i], 0, size) if i in pad.arg_dims else buf, address)
            for i, buf, address in captured.copies
        ]
        captured.views[size] = (copies, narrowed(captured.outputs, pad.out_dims, size))
        return captured.views[size]

    def _user_outputs(self, outputs: tuple) -> tuple:
        if not self.clone:
            return outputs
        keep = self.plan.returns_inputs
        return tuple(o.clone() if isinstance(o, torch.Tensor) and j not in keep else o for j, o in enumerate(outputs))

    def _size_of(self, key: tuple):
        return key[self.pad_position] if self.pad_position is not None else None

    # -- capture -----------------------------------------------------------------------------------

    def _capture_whole(self, route: Route, args: tuple):
        start = time.perf_counter()
        with self.graph.call_guard.capture_lock:  # not beside the capture thread's recording
            try:
                return self._capture_whole_now(route, args)
            finally:
                self.graph.stats.request_path_capture_seconds += time.perf_counter() - start

    def _capture_whole_now(self, route: Route, args: tuple):
        graph, key = self.graph, route.key
        values = {**symbol_values(self.input_specs, args), **dict(zip(self.symbols, key))}
        before, start = graph.memory_bytes(), time.perf_counter()
        capture_args, copies, written = self._inputs(args, route, values)
        graph.step.inside_full_graph()
        try:
            outputs = as_tuple(graph.forward_split(*capture_args))  # the call's own work, and the warm-up
        except Exception as exc:  # not graph-safe at this size (eager would not have padded it): piecewise
            self._failed(key, f"its run at the padded size raised {type(exc).__name__}: {exc}")
            return self._fall_back("its capture failed")
        watch = _torch_internals.OpsInFlight()  # which op a failing capture was running
        failure = None
        try:
            recorded, captured_outputs = self._record(capture_args, watch)
        except Exception as exc:  # capture is an optimisation: fall back loudly, never crash
            failure = f"{type(exc).__name__}: {exc}{op_names.while_running(watch.raised)}"
        if failure is not None and graph.device.type == "cuda":
            device_graphs(graph.device).recover()
        failure = agreed_refusal(graph.agreement, failure, "the full capture failed on another rank")
        if failure is not None:
            self._failed(key, failure)
        else:
            graph.decisions.active.full.graphs[key] = WholeCapture(recorded, copies, written, captured_outputs)
            graph.decisions.recorded(key, CaptureHow.LAZY, time.perf_counter() - start, before, GraphMode.FULL)
            graph.stats.graph_calls[(GraphMode.FULL, self._size_of(key))] += 1
        return narrowed(outputs, self.plan.padding.out_dims, route.size) if route.padded else outputs

    def _inputs(self, args: tuple, route: Route, values: dict) -> tuple[list, list, list]:
        """The args to capture with; (index, buffer, address) of each input copied in; (index,
        address) of each written input used in place."""
        pad = self.plan.padding if route.padded else None
        key_size = self._size_of(route.key)
        capture_args, copies, written = list(args), [], []
        for i, arg in enumerate(args):
            if pad is not None and i in pad.scalar_exprs:
                capture_args[i] = evaluate(pad.scalar_exprs[i], values)
            if not isinstance(arg, torch.Tensor):
                continue
            if i in self.plan.in_place:
                if i in self.written:
                    written.append((i, arg.data_ptr()))
                continue
            dim = pad.arg_dims.get(i) if pad is not None else None
            size = list(arg.shape)
            if dim is not None:
                size[dim] = key_size
            buf = capture_args[i] = owned_copy(arg, self.input_specs[i], values, size, dim, self.arenas, i)
            copies.append((i, buf, buf.data_ptr()))
        return capture_args, copies, written

    def _record(self, capture_args: list, watch):
        """Capture the split graph on ``capture_args`` (an emulated graph on CPU: it runs it again,
        under the capturing flag, so that ops which refuse capture refuse there too)."""
        graph = self.graph

        def watched(*_):
            with watch:
                return graph.forward_split(*capture_args)

        if graph.device.type == "cuda":
            recorded, outputs = device_graphs(graph.device).record(
                watched, 0, None, self.plan.draws_random, capture_args
            )
            outputs = as_tuple(outputs)
        else:
            recorded = EmulatedGraph(lambda: graph.forward_split(*capture_args), [], watched)
            outputs = recorded.outputs
        keep = self.plan.returns_inputs
        return recorded, tuple(
            weak_alias(o) if isinstance(o, torch.Tensor) and j not in keep else o for j, o in enumerate(outputs)
        )

    def _failed(self, key: tuple, reason: str) -> None:
        message = f"full capture at shape key {key} failed ({reason}); that size runs piecewise"
        self.graph.decisions.full_failed(key, message)
