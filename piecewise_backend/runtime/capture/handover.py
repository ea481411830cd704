"""Between a call and the capture thread: the job a call hands over, and the graphs handed back.

A call hands over (:func:`submit`) what a recording needs and no more: the shape key, the weight set
its graphs belong to, the tensors it uses in place (weights, a cache it writes, the step scalars),
its Python scalars, its symbol values, and its context, grad mode and stream. The thread
(:func:`capture_job`) records under the device's capture lock only, so the callers' calls go on,
then takes the call guard for the moment it takes to publish (:func:`publish`): the keys captured
become routable at the next call, failures are said at the next call, in its thread.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import time
import weakref

import torch

from ... import _torch_internals
from ...kinds import CaptureHow, GraphMode
from ...plan.types import TensorSpec
from ..call_guard import call_guard, guarded_devices
from ..devices import device_graphs, device_index
from ..symbolic import spec_symbols, symbol_values
from .behind import BehindJob, CaptureThread
from .behind_record import record_pieces, record_whole
from .piece import counted


def template_of(args: tuple, kept) -> list:
    """A call's ``args`` as a recording keeps them: the tensors at ``kept`` (used in place) and every
    non-tensor; None for the other tensors (made up at the key's sizes when recorded)."""
    return [a if i in kept or not isinstance(a, torch.Tensor) else None for i, a in enumerate(args)]


def submit(graph, mode: GraphMode, key: tuple, template: list, values: dict, how=CaptureHow.BEHIND) -> bool:
    """Queue the capture of ``key`` for ``graph``'s active weight set (False: already queued)."""
    weight_set = graph.decisions.active
    values = {**values, **dict(zip(graph.plan.key.symbols, key))}
    stream = None
    if graph.device.type == "cuda":
        stream = torch.cuda.current_stream(graph.device)
        _torch_internals.guard_device_syncs(
            _capture_lock_of, functools.partial(guarded_devices, "cuda")
        )  # (once per process)
    job = BehindJob(
        weakref.ref(graph), mode, key, weight_set, weight_set.generation, template, values, how, stream=stream
    )
    return THREAD.submit(job)


def submit_for(graph, mode: GraphMode, key: tuple, args: tuple) -> bool:
    """:func:`submit` what a call of ``graph`` with ``args`` gives a recording of ``key``."""
    plan = graph.plan
    kept = plan.inputs.static_inputs | plan.inputs.python_scalars | plan.full.in_place
    return submit(graph, mode, key, template_of(args, kept), symbol_values(plan.inputs.specs, args))


def _capture_lock_of(index: int):
    return call_guard(torch.device("cuda", index)).capture_lock


def busy(graph) -> bool:
    """Are up-front captures of ``graph`` still queued (``eager_capture_sizes``)?"""
    return any(j.how == CaptureHow.UP_FRONT and j.graph() is graph for j in THREAD.jobs())


def wait(graph=None, timeout: float | None = None) -> bool:
    return THREAD.wait(graph, timeout)


def capture_job(job: BehindJob) -> None:
    """In the capture thread: record ``job``'s key, then publish it (see the module docstring)."""
    graph = job.graph()
    if graph is None:  # Dynamo dropped it meanwhile
        return
    device = graph.device
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(job.inference))
        stack.enter_context(torch.set_grad_enabled(job.grad))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
            stack.enter_context(torch.cuda.stream(job.stream))
            _prime_handles(device)
        with graph.call_guard.capture_lock:
            if not _still_wanted(graph, job):
                return
            before, start = graph.memory_bytes(), time.perf_counter()
            result = _record(graph, job)
            seconds = time.perf_counter() - start
        with graph.call_guard:
            publish(graph, job, result, seconds, before)


def _still_wanted(graph, job: BehindJob) -> bool:
    """Not captured meanwhile, its weight set not released, and (up front) within the budget."""
    weight_set = job.weight_set
    if weight_set.generation != job.generation:
        return False
    if job.mode == GraphMode.FULL:
        return job.key not in weight_set.full.graphs
    if job.key in weight_set.captured:
        return False
    return job.how != CaptureHow.UP_FRONT or graph.decisions.up_front_route(job.key).capture


def _record(graph, job: BehindJob):
    """Piecewise: piece name -> Captured or why it failed. Full: a WholeCapture, or why it failed."""
    key_size = job.key[graph.plan.key.pad_position] if graph.plan.key.pad_position is not None else None
    if job.mode == GraphMode.PIECEWISE:
        try:
            return record_pieces(graph, job.key, key_size, job.template, job.values)
        except Exception as exc:  # noqa: BLE001 - outside any piece (a stand-in): every piece failed, retried later
            why = f"capture at shape key {job.key} failed ({type(exc).__name__}: {exc})"
            return dict.fromkeys(graph.runners, why)
    try:
        return record_whole(graph, job.key, job.template, job.values)
    except Exception as exc:  # noqa: BLE001 - said at the next call (publish)
        if graph.device.type == "cuda":
            device_graphs(graph.device).recover()
        return f"{exc}"


def publish(graph, job: BehindJob, result, seconds: float, before: int) -> None:
    """Hand the recorded graphs to ``job``'s weight set (the caller holds the call guard)."""
    weight_set, decisions, key = job.weight_set, graph.decisions, job.key
    if weight_set.generation != job.generation:  # released while it was recorded: not used
        return
    if job.mode == GraphMode.FULL:
        if isinstance(result, str):
            message = f"full capture behind the calls: {result}; that size runs piecewise"
            decisions.full_failed(key, message, weight_set)
            return
        weight_set.full.graphs[key] = result
        decisions.recorded(key, job.how, seconds, before, GraphMode.FULL, weight_set=weight_set)
        return
    failed = False
    for name, got in result.items():
        runner = graph.runners[name]
        if isinstance(got, str):
            failed = True
            weight_set.failed.setdefault(name, set()).add(key)
            reason = f"{got}; running un-graphed"
            runner.stats.failures.append(reason)
            graph.warnings.later(("behind failed", name), f"piecewise: {runner.name}: {reason}")
        else:
            weight_set.captures.setdefault(name, {})[key] = got
            counted(runner, key, seconds / max(1, len(result)))
    pieces = sum(1 for got in result.values() if not isinstance(got, str))
    decisions.recorded(key, job.how, seconds, before, GraphMode.PIECEWISE, failed, pieces, weight_set)


def inline_reasons(plan, agreement) -> dict:
    """Per kind of graph (piecewise, full), why its captures are made by the call that needs them
    rather than behind it (None: behind)."""
    reason = None
    if not plan.settings.capture_behind:
        reason = "capture_behind=False"
    elif agreement is not None:
        reason = "it has collectives: every rank captures at the same call"
    elif plan.device.type == "cuda" and any(s.device.type == "cpu" for s in _tensor_specs(plan)):
        reason = "it reads host tensors"
    elif _sizes_only_a_call_knows(plan):
        reason = "an eager piece makes a size only a real call knows (a value read with .item())"
    random = "it draws random numbers (the default generator is registered with its capture)"
    pieces = reason or (random if any(p.draws_random for p in plan.pieces.values()) else None)
    return {GraphMode.PIECEWISE: pieces, GraphMode.FULL: reason or (random if plan.full.draws_random else None)}


def _sizes_only_a_call_knows(plan) -> bool:
    """Does an eager piece output a tensor sized by a symbol no graph input carries (data-dependent)?
    Its stand-in could not be made: such graphs capture inline, on the call's own values."""
    known = spec_symbols(plan.inputs.specs)
    eager = [spec for name, spec in plan.output_specs.items() if name not in plan.pieces]
    return bool(spec_symbols(_flat(eager)) - known)


def _flat(specs) -> list:
    out = []
    for spec in specs:
        out += _flat(spec) if isinstance(spec, (tuple, list)) else [spec]
    return out


def _tensor_specs(plan) -> list:
    """The graph's tensor inputs, Python floats passed as CPU scalars left out."""
    scalars = plan.inputs.python_scalars
    return [s for i, s in enumerate(plan.inputs.specs) if isinstance(s, TensorSpec) and i not in scalars]


THREAD = CaptureThread(capture_job)
atexit.register(THREAD.stop)


_PRIMED: set = set()  # device indices whose cuBLAS handles the capture thread has made


def _prime_handles(device: torch.device) -> None:
    """Create this thread's cuBLAS and cuBLASLt handles outside any capture (the first matmul of a
    thread creates them; inside a capture that would fail it)."""
    if device_index(device) in _PRIMED:
        return
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones(8, 8, device=device, dtype=dtype)
        torch.nn.functional.linear(x, x, x[0])
        torch.mm(x, x)
    _PRIMED.add(device_index(device))
