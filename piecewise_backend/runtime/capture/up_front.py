"""Capturing sizes before any call needs them (``capture()``, ``eager_capture_sizes``), with no side
effects on the caller's state.

To capture size 64 we must record every compute piece at 64 with inputs at the right addresses, but
there is no batch of 64 to run: ``behind_record.py`` records them on stand-ins (weights and buffers
remembered from the graph's first call, zeros for the rest), in the capture thread, running no
kernel; ``capture()`` hands the sizes over one at a time and waits for each, ``eager_capture_sizes``
hands them all over at the first call, which is served at once.

With collectives every rank must capture in one order, with the collectives' warm-up runs in step,
which a thread beside the callers cannot promise: those graphs capture in the caller's thread
(:meth:`UpFrontCapture.capture_sizes`), the compute pieces run on the same stand-ins with their warm-up
(the moved KV writes turned off: the caller's cache is untouched), holding the call guard.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ...kinds import CaptureHow, GraphMode
from ..symbolic import symbol_values
from . import handover
from .behind_record import ComputeOnlyRun, stand_in_inputs

if TYPE_CHECKING:
    from ...plan.types import GraphPlan
    from .decisions import CaptureDecisions


def _progress(items: list, desc: str):
    """A tqdm bar that appears only if the loop takes more than a second (plain list without tqdm)."""
    try:
        from tqdm import tqdm  # the text bar: tqdm.auto warns in a notebook without ipywidgets
    except ImportError:
        return items
    return tqdm(items, desc=desc, delay=1.0, unit="size", leave=False)


class CaptureHost(Protocol):
    """All up-front capture reads of the compiled graph it captures for (the narrow interface)."""

    plan: GraphPlan
    decisions: CaptureDecisions  # the budget's say (``up_front_route``), the captured keys, the serial
    runners: dict  # piece name -> PieceRunner: what runs at the made-up inputs
    step_scalars: Any  # the positions tensor, whose writes are turned off for the run (or None)

    def capture_up_front(self, key: tuple, sym_values: dict, run: Callable[[], Any]) -> Any:
        """Run ``run()`` as the step that captures ``key`` (timed and recorded as up-front)."""


class UpFrontCapture:
    """What capturing without a real call needs from the graph's first call, and the capture itself.

    ``host`` is the :class:`~.compiled_graph.CompiledGraph` this belongs to, read through
    :class:`CaptureHost` only, and held weakly: a cycle would keep a graph Dynamo dropped, and its
    CUDA graphs' memory, alive until the next garbage collection. Which sizes are captured and
    when (``eager_capture_sizes`` on the first call, the budget) is ``decisions.py``'s.
    """

    def __init__(self, host: CaptureHost):
        self.host = weakref.proxy(host)
        self._graph = weakref.ref(host)  # what the capture thread is handed (it keeps it weakly too)
        self.plan = host.plan
        self._template: list | None = None  # first call's weights and scalars
        self._key: tuple = ()
        self._values: dict = {}

    @property
    def remembered(self) -> bool:
        return self._template is not None

    @property
    def serial(self) -> int:
        return self.host.decisions.stats.serial

    @property
    def writes_unmasked(self) -> bool:
        return bool(self.plan.unmasked_writes)

    def remember(self, key: tuple, args: tuple) -> None:
        """Keep what capture() needs from a real call: weights (by reference) and symbol values."""
        self._template = handover.template_of(args, self.plan.inputs.static_inputs | self.plan.inputs.python_scalars)
        self._key = key
        self._values = symbol_values(self.plan.inputs.specs, args)

    def use_weights(self, args: tuple) -> None:
        """capture() uses these weights from now on (and not the old ones)."""
        if self._template is not None:
            static = self.plan.inputs.static_inputs
            self._template = [args[i] if i in static else t for i, t in enumerate(self._template)]

    def refusal(self) -> str | None:
        """Why this graph cannot capture up front now (None: it can)."""
        plan, serial = self.plan, self.serial
        if plan.graphs_disabled_reason is not None:
            return f"graph {serial} cannot capture: {plan.graphs_disabled_reason}."
        if plan.key.pad_position is None:
            return (
                f"graph {serial} has no dynamic batch size (Dynamo specialised it); it captures its "
                f"one shape on its first call. Compile with dynamic=True or "
                f"torch._dynamo.mark_dynamic(input, 0) to capture sizes up front."
            )
        if self._template is None:
            return (
                f"graph {serial} has not been called yet; call the compiled model once (capture() "
                f"takes the weights and other sizes from that call)."
            )
        if self.writes_unmasked:
            return f"graph {serial} cannot capture up front: {self.no_up_front_capture()}"
        return None

    def no_up_front_capture(self) -> str:
        return (
            f"its compute pieces write {', '.join(self.plan.unmasked_writes)} (full mode) at positions the "
            f"inputs give, and capturing on made-up inputs would write garbage there. Its sizes are captured "
            f"lazily, on the first real call at each size."
        )

    def eager_sizes(self) -> tuple:
        """``eager_capture_sizes`` this graph captures on its first call (warned when some cannot be)."""
        decisions = self.host.decisions
        sizes, serial, warnings = decisions.settings.eager_sizes, self.serial, decisions.warnings
        if not sizes or self.plan.key.pad_position is None:
            return ()
        if self.writes_unmasked:
            warnings.once(
                "eager sizes",
                f"piecewise: graph {serial}: eager_capture_sizes ignored: {self.no_up_front_capture()}",
            )
            return ()
        rows = self.row_limit()
        if rows is not None and any(s > rows for s in sizes):
            warnings.once(
                "eager rows",
                f"piecewise: graph {serial}: eager_capture_sizes above {rows} are "
                f"not captured: the graph reads or writes tensors of {rows} rows by "
                f"batch row (a KV cache's batch dim).",
            )
            sizes = tuple(s for s in sizes if s <= rows)
        return sizes

    def row_limit(self) -> int | None:
        """The most rows a padded or up-front batch may have (a KV cache's batch dim), None: no limit."""
        policy = self.host.decisions.policy
        return policy.row_limit(self._key) if policy.row_limit is not None else None

    def capture_sizes(self, sizes: Iterable[int] | str = "all") -> list[tuple]:
        """Capture the graphs of ``sizes`` now, largest first; returns the shape keys captured.

        ``sizes``: capture sizes, or ``"all"``. Needs one earlier call (for the weights and the
        sizes of other dynamic dims). Stops, with a warning, at the first size the budget refuses.
        Shows a progress bar (tqdm) when it takes more than a moment. Behind (the default), each
        size is recorded by the capture thread while this waits, and other threads' calls go on.
        """
        refusal = self.refusal()
        if refusal is not None:
            raise RuntimeError(f"piecewise: {refusal}")
        decisions = self.host.decisions
        todo = [k for k in self.keys_of(sizes) if k not in decisions.captured]
        inline = decisions.inline[GraphMode.PIECEWISE] is not None
        done = []
        for key in _progress(todo, f"piecewise: capturing {len(todo)} sizes"):
            if not decisions.up_front_route(key).capture:
                break
            if inline:
                self._capture_inline(key)
            else:
                self._submit(key)
                handover.wait(self._graph())
                if key not in decisions.captured:
                    break
            done.append(key)
        return done

    def capture_behind(self, sizes: Iterable[int]) -> None:
        """Hand ``sizes`` to the capture thread, largest first (``eager_capture_sizes``): the first
        call of a graph is not held up by them."""
        for key in self.keys_of(sizes):
            self._submit(key)

    def _submit(self, key: tuple) -> None:
        handover.submit(
            self._graph(), GraphMode.PIECEWISE, key, list(self._template), self._values, CaptureHow.UP_FRONT
        )

    def keys_of(self, sizes) -> list[tuple]:
        """The shape keys of ``sizes`` (checked), largest first."""
        policy = self.host.decisions.policy
        every = isinstance(sizes, str) and sizes == "all"
        sizes = policy.sizes if every else tuple(sizes)
        unknown = [s for s in sizes if s not in policy.sizes]
        if unknown:
            raise ValueError(
                f"piecewise: {unknown} are not capture sizes of graph {self.serial}; "
                f"its capture sizes are {list(policy.sizes)}."
            )
        rows = self.row_limit()
        too_many = [s for s in sizes if rows is not None and s > rows]
        if too_many and not every:
            raise ValueError(
                f"piecewise: graph {self.serial} reads or writes tensors of {rows} rows by batch row "
                f"(a KV cache's batch dim); sizes {too_many} would reach past them."
            )
        sizes = tuple(s for s in sizes if s not in too_many)
        return [policy.with_size(self._key, s) for s in sorted(set(sizes), reverse=True)]

    def _capture_inline(self, key: tuple) -> None:
        """Capture ``key`` in this thread: the runners capture as the stand-in run reaches them."""
        host, plan = self.host, self.plan
        values = {**self._values, **dict(zip(plan.key.symbols, key))}
        scalars = host.step_scalars.writes_disabled() if host.step_scalars is not None else contextlib.nullcontext()
        runners, template = host.runners, self._template

        def run() -> None:
            inputs = stand_in_inputs(plan, template, values)
            run_piece = lambda name, args: runners[name](*args)  # noqa: E731 - each runner captures itself
            with torch.no_grad():
                ComputeOnlyRun(plan.program.module, run_piece, runners, plan.output_specs, values, plan.device).run(
                    *inputs
                )

        with scalars:  # the moved KV writes put back what they read: the caller's cache is untouched
            host.capture_up_front(key, values, run)
