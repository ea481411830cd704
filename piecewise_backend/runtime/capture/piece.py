"""Recording one compute piece's graph at a shape key, inline (the call that needs it) or behind.

A capture copies the piece's inputs into buffers it owns (or reads an earlier captured piece's
output in place, or a buffer another piece of this step staged) and records the graph on the
device's stream into the shared pool (``devices.py``).

* **Inline** (:func:`capture_piece`, ``capture_behind=False`` or a graph with collectives): the
  call's own inputs are copied in, the warm-up runs, the graph is recorded and replayed once for
  this call's outputs (a capture runs no kernel). Written args whose writes are not idempotent are
  put back after the warm-up (``buffers.written_snapshot``), so the capturing call changes them
  once. A capture that fails warns with the reason and the op it was running; the piece runs
  un-graphed at that key, and every rank of a collective group gives the key up together.
* **Behind** (:func:`record_piece` with ``behind=True``, from ``behind_record.py``): the inputs are
  made-up stand-ins, so nothing is copied in, nothing warms up and nothing replays: the recording
  is all there is, and a recording executes no kernel. The buffers it reads may be the ones a
  replay of another key is reading at that moment: it writes none of them.

The runner is read through its attributes only (``piece``, ``fn``, ``arenas``, ``stats``, ...): this
module never imports the runner's, which calls it.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

import torch

from ... import _torch_internals, op_names
from ..buffers import fits_in_storage, owned_copy, weak_alias, written_snapshot
from ..devices import device_graphs
from ..distributed import agreed_refusal
from ..emulation import EmulatedGraph, as_tuple
from ..messages import user_stacklevel
from ..symbolic import evaluate
from .captured import Captured

log = logging.getLogger(__name__)  # under the "piecewise_backend" logger


def capture_piece(runner: Any, key: tuple, args: tuple):
    """Capture ``runner``'s piece at ``key`` on this call's ``args`` (inline); the call's outputs."""
    start = time.perf_counter()
    failure = None
    watch = _torch_internals.OpsInFlight()  # which op a failing capture was running
    device = piece_device(runner, args)
    try:
        captured, outputs = record_piece(runner, runner.step, args, watch, device)
    except Exception as exc:  # capture is an optimisation: fall back loudly, never crash
        failure = failure_message(key, exc, watch)
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
    counted(runner, key, time.perf_counter() - start)
    if runner.step.padded:
        outputs = runner.narrow_outputs(outputs, runner.step.size)
    return runner.user_outputs(outputs)


def failure_message(key: tuple, exc: Exception, watch) -> str:
    return f"capture at shape key {key} failed ({type(exc).__name__}: {exc}){op_names.while_running(watch.raised)}"


def counted(runner: Any, key: tuple, seconds: float) -> None:
    stats = runner.stats
    stats.captures += 1
    stats.capture_seconds += seconds
    stats.keys.append(key)
    log.debug("piecewise: captured %s at shape key %s in %.1f ms", runner.name, key, seconds * 1e3)


def record_piece(runner: Any, step, args: tuple, watch, device: torch.device, behind: bool = False):
    """Record ``runner``'s piece on ``args`` as ``step`` describes the capture; (Captured, outputs).
    Raises what the recording raised. ``behind``: ``args`` are made-up (see the module docstring)."""
    capture_args, checks = _capture_inputs(runner, step, args, fill=not behind)
    return _record_graph(runner, step, capture_args, checks, watch, device, behind)


def _capture_inputs(runner: Any, step, args: tuple, fill: bool) -> tuple[list, list]:
    """The args to capture with, and (index, buffer, address, stage) of every tensor input to check
    one by one (all but the parameters/buffers: the compiled graph replays only while they stay)."""
    piece = runner.piece
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
            buf = owned_copy(arg, piece.arg_specs[i], step.sym_values, size, dim, runner.arenas, i, fill)
            capture_args[i] = buf
            if stage is not None:
                step.staged[stage] = buf
        checks.append((i, buf, buf.data_ptr(), stage if stage in step.staged else None))
    return capture_args, checks


def piece_device(runner: Any, args) -> torch.device:
    """The graph's device (a Python float passed as a CPU scalar may come first among the args)."""
    return runner.device or next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cuda"))


def _record_graph(runner: Any, step, capture_args: list, checks: list, watch, device: torch.device, behind: bool):
    fn = runner.fn
    warmup_runs = 0 if behind else runner.warmup_runs
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
        # an emulated capture runs the piece: behind, on copies, so that it writes nothing real, as
        # a CUDA capture writes nothing
        graph = EmulatedGraph(fn, capture_args, (lambda *a: watched(*private_copies(a))) if behind else watched)
        outputs = graph.outputs
    flat = outputs if isinstance(outputs, tuple) else (outputs,)
    aliases = []
    for o in flat:
        if isinstance(o, torch.Tensor):
            step.pool_ptrs.add(o.data_ptr())
            aliases.append(weak_alias(o))
        else:
            aliases.append(o)
    stored = tuple(aliases) if isinstance(outputs, tuple) else aliases[0]
    return Captured(graph, checks, stored), outputs


def private_copies(args) -> list:
    """``args`` with every tensor copied, strides kept (an emulated capture behind runs on these;
    compiled code checks its inputs' strides)."""
    return [
        torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(a)
        if isinstance(a, torch.Tensor)
        else a
        for a in args
    ]
