"""The cold path of a compute piece: capturing its graph at a new shape key (``piece_runner.py`` replays it).

A capture copies the piece's inputs into buffers it owns (or reads an earlier captured piece's
output in place, or a buffer another piece of this step staged), runs the warm-up, records the
graph on the device's stream into the shared pool (``devices.py``), and replays it once for this
call's outputs (a capture runs no kernel). Written args whose writes are not idempotent are put
back after the warm-up (``buffers.written_snapshot``), so the capturing call changes them once.

A capture that fails warns with the reason and the op it was running; the piece runs un-graphed at
that key, and every rank of a collective group gives the key up together (``distributed.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import TYPE_CHECKING, Any

import torch

from .. import _torch_internals, op_names
from .buffers import fits_in_storage, owned_copy, weak_alias, written_snapshot
from .devices import device_graphs
from .distributed import agreed_refusal
from .emulation import EmulatedGraph, as_tuple
from .messages import user_stacklevel
from .symbolic import evaluate

if TYPE_CHECKING:
    from .piece_runner import PieceRunner

log = logging.getLogger(__name__)  # under the "piecewise_backend" logger


@dataclasses.dataclass
class Captured:
    """One piece's graph at one shape key, and what a replay checks."""

    graph: Any  # a torch.cuda.CUDAGraph, a RawGraph (devices.py), or an EmulatedGraph on CPU: replay()
    checks: list  # (arg index, captured buffer, captured data_ptr, stage key or None) per tensor input
    #               that is not a parameter/buffer
    outputs: Any  # the piece's output structure, tensors as non-owning aliases
    views: dict = dataclasses.field(default_factory=dict)  # caller size -> (checks, outputs) sliced to it


def capture_piece(runner: PieceRunner, key: tuple, args: tuple):
    """Capture ``runner``'s piece at ``key`` on this call's ``args``; the call's outputs."""
    start = time.perf_counter()
    failure = None
    watch = _torch_internals.OpsInFlight()  # which op a failing capture was running
    device = _device(runner, args)
    try:
        capture_args, checks = _capture_inputs(runner, args)
        captured, outputs = _record_graph(runner, capture_args, checks, watch, device)
    except Exception as exc:  # capture is an optimisation: fall back loudly, never crash
        failure = (
            f"capture at shape key {key} failed ({type(exc).__name__}: {exc}){op_names.while_running(watch.raised)}"
        )
    if failure is not None and device.type == "cuda":
        device_graphs(device).recover()  # after the except: the failed graph is freed by now
    failure = agreed_refusal(
        runner.agreement,
        failure,
        f"capture at shape key {key} failed on another rank of this graph's process groups "
        f"(all give it up, so their collectives keep pairing up)",
    )
    if failure is not None:
        reason = f"{failure}; running un-graphed"
        runner.failed_keys.add(key)
        runner.stats.failures.append(reason)
        warnings.warn(f"piecewise: {runner.name}: {reason}", stacklevel=user_stacklevel())
        return runner.run_ungraphed(args)
    if device.type == "cuda":
        captured.graph.replay()  # capture does not run kernels; this call's outputs come from a replay
    runner.captures[key] = captured
    elapsed = time.perf_counter() - start
    stats = runner.stats
    stats.captures += 1
    stats.capture_seconds += elapsed
    stats.keys.append(key)
    log.debug("piecewise: captured %s at shape key %s in %.1f ms", runner.name, key, elapsed * 1e3)
    if runner.step.padded:
        outputs = runner.narrow_outputs(outputs, runner.step.size)
    return runner.user_outputs(outputs)


def _capture_inputs(runner: PieceRunner, args: tuple) -> tuple[list, list]:
    """The args to capture with, and (index, buffer, address, stage) of every tensor input to check
    one by one (all but the parameters/buffers: the compiled graph replays only while they stay)."""
    step, piece = runner.step, runner.piece
    pad = piece.padding if step.padded else None
    capture_args, checks = list(args), []
    for i, arg in enumerate(args):
        if pad is not None and i in pad.scalar_exprs:
            capture_args[i] = evaluate(pad.scalar_exprs[i], step.sym_values)
        if not isinstance(arg, torch.Tensor) or i in piece.static_args:
            continue  # parameters keep their address: captured in place (weight_sets.py)
        dim = pad.arg_dims.get(i) if pad is not None else None
        size = list(arg.shape)
        if dim is not None:
            size[dim] = step.key_size
        stage = piece.stage_keys.get(i)
        staged = step.staged.get(stage)
        if arg.data_ptr() in step.pool_ptrs and fits_in_storage(arg, size):
            # an earlier piece's captured output (the first rows of it, when padded)
            buf = weak_alias(arg, size)
            capture_args[i] = buf if dim is not None else arg
        elif staged is not None and list(staged.shape) == size and staged.stride() == arg.stride():
            buf = staged  # an earlier piece of this call copied the same source into it
            capture_args[i] = buf
        else:
            buf = owned_copy(arg, piece.arg_specs[i], step.sym_values, size, dim, runner.arenas, i)
            capture_args[i] = buf
            if stage is not None:
                step.staged[stage] = buf
        checks.append((i, buf, buf.data_ptr(), stage if stage in step.staged else None))
    return capture_args, checks


def _device(runner: PieceRunner, args) -> torch.device:
    """The graph's device (a Python float passed as a CPU scalar may come first among the args)."""
    return runner.device or next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cuda"))


def _record_graph(runner: PieceRunner, capture_args: list, checks: list, watch, device: torch.device):
    fn, warmup_runs = runner.fn, runner.warmup_runs
    restore = written_snapshot(capture_args, runner.piece.restore_after_warmup) if warmup_runs else None

    def watched(*call_args):
        with watch:
            return fn(*call_args)

    if device.type == "cuda":
        graph, outputs = device_graphs(device).record(
            lambda: watched(*capture_args), warmup_runs, restore, runner.piece.draws_random, capture_args
        )
        outputs = as_tuple(outputs)
    else:
        for _ in range(warmup_runs):
            fn(*capture_args)
        if restore is not None:
            restore()
        graph = EmulatedGraph(fn, capture_args, watched)
        outputs = graph.outputs
    flat = outputs if isinstance(outputs, tuple) else (outputs,)
    aliases = []
    for o in flat:
        if isinstance(o, torch.Tensor):
            runner.step.pool_ptrs.add(o.data_ptr())
            aliases.append(weak_alias(o))
        else:
            aliases.append(o)
    stored = tuple(aliases) if isinstance(outputs, tuple) else aliases[0]
    return Captured(graph, checks, stored), outputs
