"""What a capture records without a real call: a piecewise step's compute pieces, or a whole call.

To capture size 64 we must record every compute piece at 64 with inputs at the right addresses, but
there is no batch of 64 to run: the inputs are made up. Nothing here runs a kernel, so what the
made-up inputs hold never matters (on CPU, where graphs are emulated by running the code, the
emulated capture runs on private copies: ``piece.private_copies``).

* **Pieces** (:func:`record_pieces`): only the compute pieces are recorded, in order, fed by
  stand-ins for everything else: weights, buffers and the other tensors used in place are the real
  ones (remembered from a call: ``template``); other graph inputs and the eager pieces' outputs are
  zeros shaped as the plan describes them at the key's sizes; earlier compute pieces' outputs are
  their captured outputs, as in a real step, so each piece reads its predecessor's pool memory and a
  later real step replays with no copies. Eager pieces (attention) do not run at all.
* **A whole call** (:func:`record_whole`, ``cudagraph_mode("full")``): the split graph, eager
  pieces included, recorded as one graph on buffers the graph owns for the inputs it copies, and
  the real tensors it uses in place. Its ops read what they read at run time (a paged attention's
  metadata buffers, through the call's own context): the recording notes addresses, not values.

Both use a step state of their own, never the one the caller's calls read (``step_state.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from ... import _torch_internals
from ...plan.types import SymSpec, TensorSpec
from ..buffers import weak_alias
from ..devices import device_graphs
from ..emulation import EmulatedGraph, as_tuple
from ..step_state import StepState
from ..symbolic import evaluate, materialize, strides_at
from .captured import WholeCapture
from .piece import failure_message, piece_device, private_copies, record_piece


def _let_callers_in() -> None:
    """Hand the GIL to a caller's thread that waits for it (a recording is Python from end to end:
    without this, a caller's step could wait a whole switch interval, 5 ms, at each of its turns)."""
    time.sleep(0)


class ComputeOnlyRun(torch.fx.Interpreter):
    """Runs the split graph's compute pieces through ``run_piece(name, args)``; eager pieces are
    replaced by zero stand-ins of their outputs."""

    def __init__(self, split_gm, run_piece: Callable, pieces, output_specs: dict, values: dict, device):
        super().__init__(split_gm)
        self.run_piece, self.pieces = run_piece, pieces
        self.output_specs, self.values, self.device = output_specs, values, device

    def call_module(self, target, args, kwargs):
        if target in self.pieces:
            return self.run_piece(target, args)
        return materialize(self.output_specs[target], self.values, self.device)


def stand_in_inputs(plan, template: list, values: dict) -> list:
    """The graph's inputs for a run at the symbol ``values``: what ``template`` kept (weights, tensors
    used in place, Python scalars) as it is, zeros for the rest."""
    taken = plan.inputs.static_inputs | plan.inputs.python_scalars
    return [
        template[i]
        if i in taken or not isinstance(spec, (TensorSpec, SymSpec))
        else materialize(spec, values, plan.device)
        for i, spec in enumerate(plan.inputs.specs)
    ]


def record_pieces(graph, key: tuple, key_size: int | None, template: list, values: dict) -> dict:
    """Record every compute piece of ``graph`` at ``key``; piece name -> Captured, or the reason its
    recording failed (that piece then runs un-graphed at ``key``; the others replay)."""
    plan, runners = graph.plan, graph.runners
    step = StepState()
    step.replay(key, key_size, False)
    step.capturing(key_size, values)
    recorded: dict = {}

    def run_piece(name: str, args: tuple):
        _let_callers_in()
        runner = runners[name]
        watch = _torch_internals.OpsInFlight()
        device = piece_device(runner, args)
        try:
            captured, outputs = record_piece(runner, step, args, watch, device, behind=True)
        except Exception as exc:  # noqa: BLE001 - said at the caller's next call (decisions.publish)
            recorded[name] = failure_message(key, exc, watch)
            if device.type == "cuda":
                device_graphs(device).recover()
            return materialize(plan.output_specs[name], values, plan.device)
        recorded[name] = captured
        return outputs

    inputs = stand_in_inputs(plan, template, values)
    with torch.no_grad():
        ComputeOnlyRun(plan.program.module, run_piece, runners, plan.output_specs, values, plan.device).run(*inputs)
    return recorded


class RecordFailed(RuntimeError):
    """A whole call's recording raised; the message says where (the op it was running)."""


class _WholeCallRun(torch.fx.Interpreter):
    """Runs the split graph with each compute piece's compiled code as it is (no runner, no step
    state: what a full graph's capture records), the eager pieces as they are."""

    def __init__(self, split_gm, runners: dict):
        super().__init__(split_gm)
        self.runners = runners

    def call_module(self, target, args, kwargs):
        _let_callers_in()
        runner = self.runners.get(target)
        if runner is not None:
            return runner.run_compiled(args)
        return super().call_module(target, args, kwargs)


def whole_call_inputs(full, template: list, values: dict, device) -> tuple[list, list, list]:
    """The args a whole call is recorded on: in place, the tensors ``template`` kept; otherwise the
    graph's own buffers at the key's sizes, left as they are; SymInts at the key. Also (index, buffer,
    address) per buffer and (index, address) per written input used in place (``WholeCapture``)."""
    args, copies, written = list(template), [], []
    for i, spec in enumerate(full.input_specs):
        if i in full.plan.in_place:
            if i in full.written:
                written.append((i, template[i].data_ptr()))
        elif isinstance(spec, SymSpec):
            args[i] = evaluate(spec.expr, values)
        elif isinstance(spec, TensorSpec):
            size = [evaluate(s, values) for s in spec.shape]
            args[i] = full.arenas.take(i, size, strides_at(spec, values), spec.dtype, device)
            copies.append((i, args[i], args[i].data_ptr()))
    return args, copies, written


def record_whole(graph, key: tuple, template: list, values: dict) -> WholeCapture:
    """Record ``graph``'s whole call at ``key`` (the symbol ``values``); raises what the recording raised."""
    full, device = graph.full, graph.device
    args, copies, written = whole_call_inputs(full, template, values, device)
    watch = _torch_internals.OpsInFlight()
    run = _WholeCallRun(graph.split_module, graph.runners)

    def watched(*call_args) -> Any:
        with watch:
            return run.run(*call_args)

    try:
        if device.type == "cuda":
            recorded, outputs = device_graphs(device).record(
                lambda: watched(*args), 0, None, full.plan.draws_random, args
            )
            outputs = as_tuple(outputs)
        else:  # replays run the split graph as the caller's calls do; the emulated capture, on copies
            recorded = EmulatedGraph(lambda: graph.forward_split(*args), [], lambda: watched(*private_copies(args)))
            outputs = recorded.outputs
    except Exception as exc:
        raise RecordFailed(failure_message(key, exc, watch)) from exc
    keep = full.plan.returns_inputs
    outputs = tuple(
        weak_alias(o) if isinstance(o, torch.Tensor) and j not in keep else o for j, o in enumerate(outputs)
    )
    return WholeCapture(recorded, copies, written, outputs)
