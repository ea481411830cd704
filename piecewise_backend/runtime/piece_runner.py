"""One compiled compute piece, replayed from one CUDA graph per shape key: the runner and the step.

Design (the reasons are the hard-won ones from vLLM, SGLang and torch's cudagraph_trees):

* **One key per step, not per piece.** The stitched graph computes a shape key once per call (the
  values of the batch symbols, never the per-step KV position) and every runner uses it. Either
  every piece has seen the key (all replay) or none has (all capture, in execution order). That
  makes sharing one pool safe: a capture never allocates over memory that a replayed piece's output
  still occupies, because in a capturing step every earlier output is a real, owned tensor.
* **The step protocol.** The compiled graph tells its runners what the current call is through
  one :class:`StepState`, and only through its three methods: :meth:`StepState.ungraphed`,
  :meth:`StepState.replay` (a key, maybe padded) and :meth:`StepState.capturing` (fresh
  per-capture state). The runners read it; nothing else writes it.
* **One pool and one stream per device** (``devices.py``). Captured outputs are kept only as
  non-owning aliases, so once the step that captured them ends, their memory goes back to the pool
  for the next capture.
* **Inputs.** Parameters and buffers are captured in place; the compiled graph replays a key only
  while every one of them is at the address it was captured with (``weight_sets.py``), so a runner
  never checks them and never writes them. Outputs of earlier captured pieces are captured in
  place (same key → same address). Anything else (user inputs, attention outputs) is copied into
  a buffer the runner owns. On replay an input whose address differs from the captured one is
  copied into that buffer: never a replay on stale data, and no copy when the address is already
  right.
* **Outputs.** Outputs the user sees are cloned out of the pool unless ``clone_outputs=False``: the
  next replay would overwrite them (torch raises on that, vLLM silently aliases).
* **Padding.** A key's batch size may be larger than the caller's (a batch of 5 replays the graph
  of 8): inputs are copied into the first rows of the captured buffers, outputs are handed back as
  their first rows. Outputs of one captured piece feed the next at full size, so a step pads once
  (user inputs and eager outputs are copied in anyway), not once per piece. See ``padding.py``.
* **Loud fallback.** A capture that fails warns with the reason and the piece runs compiled but
  un-graphed for that key; the compiled graph tries the whole key again later
  (``capture_retries.py``). A compiled piece that raises where its traced FX code does not runs
  that code from then on: the fallback never raises where eager would not.
* **One caller at a time.** The step protocol's state and the runners' buffers are shared by every
  call of the graph: the compiled graph holds its device's call guard for the whole call
  (``call_guard.py``), so a second thread waits rather than reading half-written buffers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import _torch_internals, op_names
from .buffers import InputArenas, fits_in_storage, narrowed, owned_copy, weak_alias
from .devices import device_graphs
from .distributed import RankAgreement, agreed_refusal
from .emulation import EmulatedGraph, as_tuple
from .stats import PieceStats
from ..plan.types import TensorSpec
from .symbolic import evaluate, strides_at, symbol_values

if TYPE_CHECKING:
    from ..plan.types import PieceCode, PiecePlan

log = logging.getLogger(__name__)  # under the "piecewise_backend" logger


@dataclasses.dataclass
class StepState:
    """What the compiled graph tells every runner about the current call (see "The step protocol")."""

    graphing: bool = False
    whole: bool = False  # inside a full graph's run or capture: pieces run their compiled code as it is
    key: tuple = ()  # the shape key of the graphs to replay or capture
    size: int | None = None  # the caller's batch size when it is padded up to the key's
    key_size: int | None = None  # the key's batch size (what the graphs are captured at)
    padded: bool = False
    sym_values: dict = dataclasses.field(default_factory=dict)  # symbol -> value at the key (capture only)
    pool_ptrs: set = dataclasses.field(default_factory=set)  # outputs captured during this call
    staged: dict = dataclasses.field(default_factory=dict)  # stage key -> buffer (capturing calls)
    refreshed: dict = dataclasses.field(default_factory=dict)  # stage key -> source address copied this call

    def ungraphed(self) -> None:
        """This call runs every piece compiled but un-graphed."""
        self.graphing = self.whole = False

    def inside_full_graph(self) -> None:
        """This call is run, or captured, whole (``full_graph.py``): each piece runs its compiled code
        as it is, counted nowhere (the full graph's own stats count the call)."""
        self.graphing, self.whole = False, True

    def replay(self, key: tuple, size: int | None, padded: bool) -> None:
        """This call replays (or, for pieces without a graph of ``key``, captures) the graphs of ``key``."""
        self.graphing, self.whole, self.key, self.size, self.padded = True, False, key, size, padded
        self.refreshed.clear()

    def capturing(self, key_size: int | None, sym_values: dict) -> None:
        """This call captures: no output of an earlier capture is in the pool for it yet."""
        self.pool_ptrs.clear()
        self.staged.clear()
        self.key_size, self.sym_values = key_size, sym_values


@dataclasses.dataclass
class _Captured:
    graph: Any  # a torch.cuda.CUDAGraph, a RawGraph (devices.py), or an EmulatedGraph on CPU: replay()
    checks: list  # (arg index, captured buffer, captured data_ptr, stage key or None) per tensor input
    #               that is not a parameter/buffer
    outputs: Any  # the piece's output structure, tensors as non-owning aliases
    views: dict = dataclasses.field(default_factory=dict)  # caller size -> (checks, outputs) sliced to it


class PieceRunner:
    """Runs one compiled compute piece: replayed from a CUDA graph per shape key when it can be.

    Args:
        piece: what the plan decided for it (``plan.PiecePlan``): the compiled function and the fake
            inputs it was compiled for; which args are parameters/buffers (captured in place: the
            compiled graph replays only while they are where they were at capture); which outputs
            the user sees (cloned out of the pool); its padding (``padding.py``); its staged args
            (``staging.py``); and the written args whose writes are not idempotent (full mode's
            ``buf.mul_(...)``, an accumulator), saved before the warm-up runs and put back after,
            so that a capturing call changes them once, like any other call (the decode rewrite's
            KV writes write the same values however often they run: not saved).
        step: the state the compiled graph shares with its runners (the step protocol).
        agreement: for a graph with collectives, the ranks that must capture together
            (``distributed.py``): a capture that failed on any of them is given up on all, so that
            every rank runs the piece the same way (padded replay or un-graphed) and the
            collectives inside it still pair up.
    """

    def __init__(self, piece: PiecePlan, code: PieceCode, step: StepState, stats: PieceStats, warmup_runs: int,
                 clone_outputs: bool, agreement: RankAgreement | None = None, device: torch.device | None = None):
        self.name = piece.name
        self.fn = code.runs
        self.arg_specs = piece.arg_specs
        self.static_args = piece.static_args
        self.escaping_outputs = piece.escaping_outputs
        self.padding = piece.padding
        self.stage_keys = piece.stage_keys  # arg index -> stage key
        self.restore_after_warmup = piece.restore_after_warmup
        self.draws_random = piece.draws_random
        self.eager_fn = code.traced  # the piece's FX code: the fallback when the compiled code raises
        self.step = step
        self.stats = stats
        self.warmup_runs = warmup_runs
        self.clone_outputs = clone_outputs
        self.agreement = agreement
        self.device = device  # the graph's: where a piece without tensor inputs captures
        self.captures: dict[tuple, _Captured] = {}
        self.arenas = InputArenas()  # the copied inputs' buffers, shared by every key (buffers.py)
        self.failed_keys: set = set()
        self._clones = clone_outputs and bool(piece.escaping_outputs)  # any output to copy out of the pool

    def __call__(self, *args):
        """The replay path runs once per piece per decode step: keep it to dict lookups and compares."""
        step = self.step
        if not step.graphing:
            return self._run_compiled(args) if step.whole else self._ungraphed(args)
        captured = self.captures.get(step.key)
        if captured is None:
            if step.key in self.failed_keys:
                return self._ungraphed(args)
            return self._capture(step.key, args)
        checks, outputs = (captured.views.get(step.size) or self._slice(captured, step.size)) if step.padded \
            else (captured.checks, captured.outputs)
        for i, buf, ptr, stage in checks:
            arg = args[i]
            source = arg.data_ptr()
            if source != ptr:
                if stage is not None:  # one copy per call into a buffer several pieces read
                    if step.refreshed.get(stage) == source:
                        continue
                    step.refreshed[stage] = source
                buf.copy_(arg)  # a buffer this runner owns
                self.stats.input_copies += 1
        captured.graph.replay()
        self.stats.replays += 1
        return self._user_outputs(outputs) if self._clones else outputs

    def _ungraphed(self, args: tuple):
        self.stats.ungraphed_runs += 1
        try:
            return self._run_compiled(args)
        except torch.OutOfMemoryError:
            raise  # not the code's fault: eager would need the memory too
        except Exception as exc:  # the compiled code is broken where the traced code is not
            if self.eager_fn is None or self.fn is self.eager_fn:
                raise
            out = self.eager_fn(*args)  # raises what eager raises, if the inputs are at fault
            self._run_eagerly_from_now_on(exc)
            return out

    def _run_compiled(self, args: tuple):
        try:
            return self.fn(*args)
        except AssertionError:  # Inductor's input stride check (see _expected_layout)
            relaid = self._expected_layout(args)
            if relaid is None:
                raise
            return self.fn(*relaid)

    def _run_eagerly_from_now_on(self, exc: Exception) -> None:
        """The compiled piece raised where its FX code, run as Dynamo traced it, did not: say so once,
        and run (and capture) the FX code from now on. Graphs already captured keep replaying."""
        reason = (f"the compiled code raised {type(exc).__name__}: {exc}; its traced code did not, so it runs "
                  f"that (eagerly, or captured as it is) from now on. Please report it with the piece's code "
                  f"(piecewise_backend.inspect_split)")
        self.fn = self.eager_fn = _torch_internals.generated_forward(self.eager_fn)  # a lazy graph module's
        self.stats.failures.append(reason)
        warnings.warn(f"piecewise: {self.name}: {reason}", stacklevel=4)

    def _expected_layout(self, args: tuple) -> list | None:
        """``args`` with every tensor copied to the strides the compiled piece was compiled for, or
        None if all had them already.

        Fake propagation predicts an eager op's output strides, and Inductor compiles the next piece
        for them (and asserts them). Eager kernels do not always agree: CPU ``batch_norm`` on a
        transposed input returned a contiguous output at some batch sizes where the prediction kept
        the input's strides. Captured graphs never see this (their input buffers have the expected
        strides and ``copy_`` converts), un-graphed calls retry through this.
        """
        values = symbol_values(self.arg_specs, args)
        out, changed = list(args), False
        for i, (spec, arg) in enumerate(zip(self.arg_specs, args)):
            if isinstance(spec, TensorSpec) and isinstance(arg, torch.Tensor):
                strides = strides_at(spec, values)
                if strides is not None and tuple(arg.stride()) != strides and arg.numel() > 1:
                    out[i] = torch.empty_strided(arg.shape, strides, dtype=arg.dtype, device=arg.device).copy_(arg)
                    changed = True
        return out if changed else None

    # -- replay helpers ---------------------------------------------------------------------------

    def _slice(self, captured: _Captured, size: int):
        """The captured buffers and outputs cut to the caller's ``size`` rows (cached per size)."""
        pad = self.padding
        checks = [(i, buf.narrow(pad.arg_dims[i], 0, size) if i in pad.arg_dims else buf, ptr, stage)
                  for i, buf, ptr, stage in captured.checks]
        outputs = self._narrow_outputs(captured.outputs, size)
        captured.views[size] = (checks, outputs)
        return checks, outputs

    def _narrow_outputs(self, outputs, size: int):
        return narrowed(outputs, self.padding.out_dims, size)

    def _user_outputs(self, outputs):
        if not self._clones:
            return outputs
        if not isinstance(outputs, tuple):
            return outputs.clone() if isinstance(outputs, torch.Tensor) else outputs  # a bool, an int: as is
        return tuple(o.clone() if i in self.escaping_outputs and isinstance(o, torch.Tensor) else o
                     for i, o in enumerate(outputs))

    # -- capture ----------------------------------------------------------------------------------

    def _capture(self, key: tuple, args: tuple):
        start = time.perf_counter()
        failure = None
        watch = _torch_internals.OpsInFlight()  # which op a failing capture was running
        try:
            capture_args, checks = self._capture_inputs(args)
            captured, outputs = self._record(capture_args, checks, watch)
        except Exception as exc:  # capture is an optimisation: fall back loudly, never crash
            failure = f"capture at shape key {key} failed ({type(exc).__name__}: {exc})" \
                      f"{op_names.while_running(watch.raised)}"
        if failure is not None and self._device(args).type == "cuda":
            device_graphs(self._device(args)).recover()  # after the except: the failed graph is freed by now
        failure = agreed_refusal(self.agreement, failure,
                                 f"capture at shape key {key} failed on another rank of this graph's process "
                                 f"groups (all give it up, so their collectives keep pairing up)")
        if failure is not None:
            reason = f"{failure}; running un-graphed"
            self.failed_keys.add(key)
            self.stats.failures.append(reason)
            warnings.warn(f"piecewise: {self.name}: {reason}", stacklevel=3)
            return self._ungraphed(args)
        if self._device(args).type == "cuda":
            captured.graph.replay()  # capture does not run kernels; this call's outputs come from a replay
        self.captures[key] = captured
        elapsed = time.perf_counter() - start
        self.stats.captures += 1
        self.stats.capture_seconds += elapsed
        self.stats.keys.append(key)
        log.debug("piecewise: captured %s at shape key %s in %.1f ms", self.name, key, elapsed * 1e3)
        if self.step.padded:
            outputs = self._narrow_outputs(outputs, self.step.size)
        return self._user_outputs(outputs)

    def _capture_inputs(self, args: tuple) -> tuple[list, list]:
        """The args to capture with, and (index, buffer, address, stage) of every tensor input to
        check one by one (all but the parameters/buffers, see ``_index_statics``)."""
        step = self.step
        pad = self.padding if step.padded else None
        capture_args, checks = list(args), []
        for i, arg in enumerate(args):
            if pad is not None and i in pad.scalar_exprs:
                capture_args[i] = evaluate(pad.scalar_exprs[i], step.sym_values)
            if not isinstance(arg, torch.Tensor):
                continue
            dim = pad.arg_dims.get(i) if pad is not None else None
            size = list(arg.shape)
            if dim is not None:
                size[dim] = step.key_size
            stage = self.stage_keys.get(i)
            staged = step.staged.get(stage)
            if i in self.static_args:
                continue  # parameters keep their address: captured in place (weight_sets.py)
            if arg.data_ptr() in step.pool_ptrs and fits_in_storage(arg, size):
                # an earlier piece's captured output (the first rows of it, when padded)
                buf = weak_alias(arg, size)
                capture_args[i] = buf if dim is not None else arg
            elif staged is not None and list(staged.shape) == size and staged.stride() == arg.stride():
                buf = staged  # an earlier piece of this call copied the same source into it
                capture_args[i] = buf
            else:
                buf = owned_copy(arg, self.arg_specs[i], step.sym_values, size, dim, self.arenas, i)
                capture_args[i] = buf
                if stage is not None:
                    step.staged[stage] = buf
            checks.append((i, buf, buf.data_ptr(), stage if stage in step.staged else None))
        return capture_args, checks

    def _warmup_undo(self, capture_args: list) -> Callable[[], None] | None:
        """What puts the non-idempotent written args back as they were before the warm-up runs."""
        if not (self.warmup_runs and self.restore_after_warmup):
            return None
        saved = [(capture_args[i], capture_args[i].clone()) for i in sorted(self.restore_after_warmup)]

        def restore() -> None:
            for tensor, copy in saved:
                tensor.copy_(copy)
        return restore

    def _device(self, args) -> torch.device:
        """The graph's device (a Python float passed as a CPU scalar may come first among the args)."""
        return self.device or next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cuda"))

    def _record(self, capture_args: list, checks: list, watch):
        step = self.step
        device = self._device(capture_args)
        restore = self._warmup_undo(capture_args)

        def watched(*call_args):
            with watch:
                return self.fn(*call_args)

        if device.type == "cuda":
            graph, outputs = device_graphs(device).capture(lambda: watched(*capture_args), self.warmup_runs, restore,
                                                           self.draws_random, capture_args)
            outputs = as_tuple(outputs)
        else:
            for _ in range(self.warmup_runs):
                self.fn(*capture_args)
            if restore is not None:
                restore()
            graph = EmulatedGraph(self.fn, capture_args, watched)
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
        return _Captured(graph, checks, stored), outputs
