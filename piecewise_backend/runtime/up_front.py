"""Capturing sizes before any call needs them (``capture()``, ``eager_capture_sizes``), with no side
effects on the caller's state.

To capture size 64 we must run every compute piece at 64 with inputs at the right addresses, but
we have no batch of 64 to run. Running the whole graph on made-up inputs would run its eager pieces
too, and those write the caller's KV cache. So only the compute pieces run (they never write a
caller's tensor except, in full mode, buffers the graph itself writes at the positions it is given),
in order, fed by zero stand-ins for everything else:

* weights and buffers: the real tensors, remembered from the graph's first call;
* other graph inputs and the eager pieces' outputs: zeros shaped as the plan describes them, with the
  batch symbol set to the size being captured (zeros are valid token ids and harmless activations);
* earlier compute pieces' outputs: the real captured outputs, as in a real step, so each piece is
  captured reading its predecessor's pool memory and a later real step replays with no copies.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.fx

from ..plan.types import SymSpec, TensorSpec
from .background_capture import BackgroundCapture
from .symbolic import materialize, symbol_values

if TYPE_CHECKING:
    from ..plan.types import GraphPlan
    from .capture_decisions import CaptureDecisions


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

    def capture(self, sizes: Iterable[int]) -> list[tuple]:
        """Capture ``sizes`` now, holding the call guard (what the thread of ``capture_behind`` calls)."""

    def warn_once(self, topic: str, message: str) -> None:
        """Warn ``message`` once per ``topic`` for this graph."""


class UpFrontCapture:
    """What capturing without a real call needs from the graph's first call, and the capture itself.

    ``host`` is the :class:`~.compiled_graph.CompiledGraph` this belongs to, read through
    :class:`CaptureHost` only, and held weakly: a cycle would keep a graph Dynamo dropped, and its
    CUDA graphs' memory, alive until the next garbage collection. Which sizes are captured and
    when (``eager_capture_sizes`` on the first call, the budget) is ``capture_decisions.py``'s.
    """

    def __init__(self, host: CaptureHost):
        self.host = weakref.proxy(host)
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
        kept = self.plan.inputs.static_inputs | self.plan.inputs.python_scalars
        self._template = [a if i in kept or not isinstance(a, torch.Tensor) else None for i, a in enumerate(args)]
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

    def row_limit(self) -> int | None:
        """The most rows a padded or up-front batch may have (a KV cache's batch dim), None: no limit."""
        policy = self.host.decisions.policy
        return policy.row_limit(self._key) if policy.row_limit is not None else None

    def capture_sizes(self, sizes: Iterable[int] | str = "all") -> list[tuple]:
        """Capture the graphs of ``sizes`` now, largest first; returns the shape keys captured.

        ``sizes``: capture sizes, or ``"all"``. Needs one earlier call (for the weights and the
        sizes of other dynamic dims). Stops, with a warning, at the first size the budget refuses.
        Shows a progress bar (tqdm) when it takes more than a moment.
        """
        refusal = self.refusal()
        if refusal is not None:
            raise RuntimeError(f"piecewise: {refusal}")
        decisions = self.host.decisions
        todo = [k for k in self.keys_of(sizes) if k not in decisions.captured]
        done = []
        for key in _progress(todo, f"piecewise: capturing {len(todo)} sizes"):
            if not decisions.up_front_route(key).capture:
                break
            self._capture_key(key)
            done.append(key)
        return done

    def capture_behind(self, sizes: Iterable[int]) -> BackgroundCapture:
        """Capture ``sizes`` in a thread, one at a time, once the call in progress returned
        (``background_capture.py``): the first call of a graph is not held up by them."""
        host = self.host
        warn = lambda message: host.warn_once("eager sizes behind", message)  # noqa: E731
        return BackgroundCapture(host.capture, sizes, warn, self.plan.device).start()

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

    def _capture_key(self, key: tuple) -> None:
        host, plan = self.host, self.plan
        values = {**self._values, **dict(zip(plan.key.symbols, key))}
        scalars = host.step_scalars.writes_disabled() if host.step_scalars is not None else contextlib.nullcontext()
        runners, template = host.runners, self._template
        with scalars:  # the moved KV writes put back what they read: the caller's cache is untouched
            host.capture_up_front(key, values, lambda: run_compute_pieces(plan, runners, template, values))


class _ComputeOnlyRun(torch.fx.Interpreter):
    """Runs the split graph's compute pieces; eager pieces are replaced by zero stand-ins."""

    def __init__(self, split_gm, runners: dict, output_specs: dict, values: dict, device):
        super().__init__(split_gm)
        self.runners = runners
        self.output_specs = output_specs
        self.values = values
        self.device = device

    def call_module(self, target, args, kwargs):
        if target in self.runners:
            return self.runners[target](*args)
        return materialize(self.output_specs[target], self.values, self.device)


def run_compute_pieces(plan: GraphPlan, runners: dict, template: list, values: dict) -> None:
    """Run every compute piece of ``plan`` once on stand-ins at the symbol ``values`` (the runners
    capture); weights and Python scalars are taken from ``template`` as they are."""
    taken = plan.inputs.static_inputs | plan.inputs.python_scalars
    inputs = [
        template[i]
        if i in taken or not isinstance(spec, (TensorSpec, SymSpec))
        else materialize(spec, values, plan.device)
        for i, spec in enumerate(plan.inputs.specs)
    ]
    with torch.no_grad():
        _ComputeOnlyRun(plan.program.module, runners, plan.output_specs, values, plan.device).run(*inputs)
