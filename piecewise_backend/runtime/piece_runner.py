"""One compiled compute piece, replayed from one CUDA graph per shape key: the runner and the step.

Design (the reasons are the hard-won ones from vLLM, SGLang and torch's cudagraph_trees):

* **One key per step, not per piece.** The stitched graph computes a shape key once per call (the
  values of the batch symbols, never the per-step KV position) and every runner uses it. Either
  every piece has seen the key (all replay) or none has (all capture, in execution order). That
  makes sharing one pool safe: a capture never allocates over memory that a replayed piece's output
  still occupies, because in a capturing step every earlier output is a real, owned tensor.
* **The step protocol.** The compiled graph tells its runners what the current call is through
  one :class:`~.step_state.StepState`, and only through its methods: :meth:`StepState.ungraphed`,
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
* **Hot and cold paths apart.** This module replays (a few dict lookups and compares per piece per
  step); ``capture/piece.py`` captures a new key.
* **Loud fallback.** A capture that fails warns with the reason and the piece runs compiled but
  un-graphed for that key; the compiled graph tries the whole key again later
  (``capture/retries.py``). A compiled piece that raises where its traced FX code does not runs
  that code from then on, after putting back what the failed run wrote to args it writes
  non-idempotently: the fallback never raises where eager would not, and never writes twice.
* **One caller at a time.** The step protocol's state and the runners' buffers are shared by every
  call of the graph: the compiled graph holds its device's call guard for the whole call
  (``call_guard.py``), so a second thread waits rather than reading half-written buffers.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from .. import _torch_internals
from ..plan.types import TensorSpec
from .buffers import InputArenas, narrowed, written_snapshot
from .capture import Captured, capture_piece
from .distributed import RankAgreement
from .messages import user_stacklevel
from .stats import PieceStats
from .step_state import StepState
from .symbolic import strides_at, symbol_values

if TYPE_CHECKING:
    from ..plan.types import PieceCode, PiecePlan

# What Inductor's input check raises when an input's strides are not those it compiled for:
# ``assert_size_stride`` (torch._C._dynamo.guards), an AssertionError whose message starts so
# (checked on torch 2.11 and 2.13). Any other AssertionError is the code's own: it propagates.
STRIDE_CHECK = "expected size "


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

    def __init__(
        self,
        piece: PiecePlan,
        code: PieceCode,
        step: StepState,
        stats: PieceStats,
        warmup_runs: int,
        clone_outputs: bool,
        agreement: RankAgreement | None = None,
        device: torch.device | None = None,
    ):
        self.piece = piece  # read as it is: its args' specs, padding, staging, what it writes
        self.name = piece.name
        self.fn = code.runs
        self.eager_fn = code.traced  # the piece's FX code: the fallback when the compiled code raises
        self.step = step
        self.stats = stats
        self.warmup_runs = warmup_runs
        self.clone_outputs = clone_outputs
        self.agreement = agreement
        self.device = device  # the graph's: where a piece without tensor inputs captures
        self.captures: dict[tuple, Captured] = {}
        self.arenas = InputArenas()  # the copied inputs' buffers, shared by every key (buffers.py)
        self.failed_keys: set = set()
        self._clones = clone_outputs and bool(piece.escaping_outputs)  # any output to copy out of the pool

    def use_graphs(self, captures: dict, failed_keys: set) -> None:
        """Replay from (and capture into) these graphs: the active weight set's (``weight_sets.py``)."""
        self.captures, self.failed_keys = captures, failed_keys

    def __call__(self, *args):
        """The replay path runs once per piece per decode step: keep it to dict lookups and compares."""
        step = self.step
        if not step.graphing:
            return self.run_compiled(args) if step.whole else self.run_ungraphed(args)
        captured = self.captures.get(step.key)
        if captured is None:
            if step.key in self.failed_keys:
                return self.run_ungraphed(args)
            return capture_piece(self, step.key, args)  # the cold path, inline (capture/piece.py)
        checks, outputs = (
            (captured.views.get(step.size) or self._slice(captured, step.size))
            if step.padded
            else (captured.checks, captured.outputs)
        )
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
        return self.user_outputs(outputs) if self._clones else outputs

    def run_ungraphed(self, args: tuple):
        """Run the compiled code as it is; if it raises where the traced code does not, that (see
        :meth:`_run_eagerly_from_now_on`), after undoing the failed run's non-idempotent writes."""
        self.stats.ungraphed_runs += 1
        fallback = self.eager_fn is not None and self.fn is not self.eager_fn
        undo = written_snapshot(args, self.piece.restore_after_warmup) if fallback else None
        try:
            return self.run_compiled(args)
        except torch.OutOfMemoryError:
            raise  # not the code's fault: eager would need the memory too
        except Exception as exc:  # the compiled code is broken where the traced code is not
            if not fallback:
                raise
            if undo is not None:
                undo()  # what the failed run wrote before it raised: written once, by the traced code
            out = self.eager_fn(*args)  # raises what eager raises, if the inputs are at fault
            self._run_eagerly_from_now_on(exc)
            return out

    def run_compiled(self, args: tuple):
        try:
            return self.fn(*args)
        except AssertionError as exc:  # Inductor's input stride check (see _expected_layout), nothing else
            if not str(exc).startswith(STRIDE_CHECK):
                raise
            relaid = self._expected_layout(args)
            if relaid is None:
                raise
            return self.fn(*relaid)

    def _run_eagerly_from_now_on(self, exc: Exception) -> None:
        """The compiled piece raised where its FX code, run as Dynamo traced it, did not: say so once,
        and run (and capture) the FX code from now on. Graphs already captured keep replaying."""
        reason = (
            f"the compiled code raised {type(exc).__name__}: {exc}; its traced code did not, so it runs "
            f"that (eagerly, or captured as it is) from now on. Please report it with the piece's code "
            f"(piecewise_backend.inspect_split)"
        )
        self.fn = self.eager_fn = _torch_internals.generated_forward(self.eager_fn)  # a lazy graph module's
        self.stats.failures.append(reason)
        warnings.warn(f"piecewise: {self.name}: {reason}", stacklevel=user_stacklevel())

    def _expected_layout(self, args: tuple) -> list | None:
        """``args`` with every tensor copied to the strides the compiled piece was compiled for, or
        None if all had them already.

        Fake propagation predicts an eager op's output strides, and Inductor compiles the next piece
        for them (and asserts them). Eager kernels do not always agree: CPU ``batch_norm`` on a
        transposed input returned a contiguous output at some batch sizes where the prediction kept
        the input's strides. Captured graphs never see this (their input buffers have the expected
        strides and ``copy_`` converts), un-graphed calls retry through this.
        """
        specs = self.piece.arg_specs
        values = symbol_values(specs, args)
        out, changed = list(args), False
        for i, (spec, arg) in enumerate(zip(specs, args)):
            if isinstance(spec, TensorSpec) and isinstance(arg, torch.Tensor):
                strides = strides_at(spec, values)
                if strides is not None and tuple(arg.stride()) != strides and arg.numel() > 1:
                    out[i] = torch.empty_strided(arg.shape, strides, dtype=arg.dtype, device=arg.device).copy_(arg)
                    changed = True
        return out if changed else None

    # -- replay helpers ---------------------------------------------------------------------------

    def _slice(self, captured: Captured, size: int):
        """The captured buffers and outputs cut to the caller's ``size`` rows (cached per size)."""
        pad = self.piece.padding
        checks = [
            (i, buf.narrow(pad.arg_dims[i], 0, size) if i in pad.arg_dims else buf, ptr, stage)
            for i, buf, ptr, stage in captured.checks
        ]
        outputs = self.narrow_outputs(captured.outputs, size)
        captured.views[size] = (checks, outputs)
        return checks, outputs

    def narrow_outputs(self, outputs, size: int):
        return narrowed(outputs, self.piece.padding.out_dims, size)

    def user_outputs(self, outputs):
        if not self._clones:
            return outputs
        if not isinstance(outputs, tuple):
            return outputs.clone() if isinstance(outputs, torch.Tensor) else outputs  # a bool, an int: as is
        return tuple(
            o.clone() if i in self.piece.escaping_outputs and isinstance(o, torch.Tensor) else o
            for i, o in enumerate(outputs)
        )
