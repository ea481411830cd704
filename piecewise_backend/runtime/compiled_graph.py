"""The callable Dynamo installs for one graph: per call, pick the graphs that serve it, or say why not.

Built from a frozen :class:`~piecewise_backend.plan.types.GraphPlan` (the wrap stage of ``backend.py``):
each compute piece of the split graph is replaced by a
:class:`~piecewise_backend.runtime.piece_runner.PieceRunner`, the eager pieces run as they are
between the replays. Per call, in order:

1. the step scalars are refreshed (the decode rewrite's positions, checked on the host; after the
   call, the next decode position is written ahead: ``step_scalars.py``);
2. un-graphed if graphs are off for this graph or grad is needed;
3. everything else is decided by :class:`~.capture.CaptureDecisions` (which set of graphs, full
   or piecewise, which key: replay, capture inline or behind, ride, retry, replace, up front, or
   un-graphed with a counted reason): this module holds none of those rules, it does what the
   ``Route`` (``capture/policy.py``) says;
4. the runners are told through the step protocol (``StepState``) and the split graph runs, or a
   full graph is replayed or captured (``full_graph.py``).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from .. import _torch_internals
from ..kinds import CaptureHow, GraphMode, PieceKind
from ..plan.types import PieceCode
from . import compile_clock
from .call_guard import call_guard
from .capture import CaptureDecisions, UpFrontCapture, hold_captures, release_captures, wait_for_captures
from .code_switch import CodeSwitch
from .devices import pool_bytes, synchronize
from .direct_calls import recording
from .full_graph import FALLBACK, FullGraphs
from .graph_mode import current_mode
from .messages import GraphWarnings
from .piece_runner import PieceRunner
from .sdpa_backends import SdpaBackends
from .split_forward import one_piece_forward
from .stats import GraphStats, PieceStats
from .step_scalars import StepScalars
from .step_state import StepState

if TYPE_CHECKING:
    from ..plan.types import GraphPlan


class CompiledGraph:
    """The callable Dynamo installs for one captured graph."""

    def __init__(self, plan: GraphPlan, compiled: Mapping[str, Callable | None]):
        """``compiled``: each compute piece's compiled code (None, or left out: it runs its traced code)."""
        compile_clock.install(with_triton=plan.device.type == "cuda")  # process_stats' request_path_compile_s
        self.plan = plan
        self.compiled_code = dict(compiled)  # what the pieces were built with (``persist/`` saves it)
        self.stats = GraphStats.of_plan(plan)
        self.warnings = GraphWarnings()
        self.step = StepState()
        # the split graph this graph runs: a copy of the plan's program, its pieces replaced by runners
        self.split_module = torch.fx.GraphModule(plan.program.module, plan.program.module.graph)
        self.full = FullGraphs(self)  # calls under cudagraph_mode("full"): the whole call, one graph
        self.decisions = CaptureDecisions(plan, self.stats, self.memory_bytes_reader(), self.warnings)
        self.decisions.attach(self)  # (weakly) what its captures behind the calls are made for
        self.runners = self._wrap_pieces(compiled)
        self.up_front = UpFrontCapture(self)
        self.forward_split = one_piece_forward(self.split_module) or _torch_internals.generated_forward(
            self.split_module
        )
        # the positions written per call: a tensor of this graph's own, from the plan's layout
        self.step_scalars = StepScalars(plan.step_scalars) if plan.step_scalars is not None else None
        # read on every call: kept here rather than derived from the plan each time
        self._graphs_off = plan.graphs_disabled_reason is not None
        self._kernels_ran = False  # has a call run every piece's kernels yet (_first_call)
        self._shape_key = plan.key.of
        self._pad = plan.key.pad_position
        self._sdpa_backends = (
            SdpaBackends(dict(plan.sdpa_choice.enabled), plan.sdpa_choice.reason)
            if plan.sdpa_choice is not None
            else None
        )
        self.call_guard = self._guard = call_guard(plan.device)
        self.code_switch = CodeSwitch()  # code compiled while this graph serves (compiler="eager_then_inductor")

    def _wrap_pieces(self, compiled: Mapping[str, Callable | None]) -> dict[str, PieceRunner]:
        """Replace each compute submodule by its runner (an instance attribute shadows the registered
        submodule, which stays for inspection); eager submodules are called without
        ``nn.Module.__call__``'s overhead."""
        split_gm, settings = self.split_module, self.plan.settings
        runners = {}
        for spec in self.plan.piece_specs:
            if spec.kind == PieceKind.COMPUTE:
                self.stats.pieces[spec.name] = PieceStats(spec.name)
                code = PieceCode(compiled.get(spec.name), self.plan.program.piece(spec.name))
                runners[spec.name] = PieceRunner(
                    self.plan.pieces[spec.name],
                    code,
                    self.step,
                    self.stats.pieces[spec.name],
                    settings.warmup_runs,
                    settings.clone_outputs,
                    self.decisions.agreement,
                    self.plan.device,
                )
                split_gm.__dict__[spec.name] = runners[spec.name]
            else:
                split_gm.__dict__[spec.name] = getattr(split_gm, spec.name).forward
        return runners

    # -- what the plan says, and what the decisions hold, by name -------------------------------------

    pieces = property(lambda self: self.plan.piece_specs)
    signatures = property(lambda self: self.plan.report.signatures)
    key_symbols = property(lambda self: self.plan.key.symbols)
    pad_position = property(lambda self: self.plan.key.pad_position)
    graphs_disabled_reason = property(lambda self: self.plan.graphs_disabled_reason)
    unmasked_writes = property(lambda self: self.plan.unmasked_writes)
    device = property(lambda self: self.plan.device)
    settings = property(lambda self: self.plan.settings)
    policy = property(lambda self: self.decisions.policy)
    agreement = property(lambda self: self.decisions.agreement)
    captured = property(lambda self: self.decisions.captured, doc="Shape keys captured (the active weights').")
    weights = property(lambda self: self.decisions.weights)

    @property
    def serial(self) -> int:
        """The graph's number in this process (``registry.py`` gives it once built)."""
        return self.stats.serial

    @serial.setter
    def serial(self, value: int) -> None:
        self.stats.serial = value

    @property
    def __code__(self):
        """Tools that walk Dynamo's cache (depyf) expect what a backend returns to be a function and
        read its ``__code__``; ours is this object's ``__call__``."""
        return type(self).__call__.__code__

    @property
    def can_capture_up_front(self) -> bool:
        return self.up_front.refusal() is None

    def capture(self, sizes: Iterable[int] | str = "all") -> list[tuple]:
        """Capture the graphs of ``sizes`` now, largest first; returns the shape keys captured (see
        :meth:`UpFrontCapture.capture_sizes`). Safe beside other threads' calls: the capture thread
        records them while they go on (inline graphs: this holds the call guard meanwhile)."""
        if self.decisions.inline[GraphMode.PIECEWISE] is None:
            return self.up_front.capture_sizes(sizes)
        with self._guard:
            return self.up_front.capture_sizes(sizes)

    def wait_for_captures(self, timeout: float | None = None) -> bool:
        """Wait for this graph's captures behind the calls (lazy ones and ``eager_capture_sizes``):
        True once none is left, False if some still were after ``timeout`` seconds."""
        return wait_for_captures(self, timeout)

    def warn_once(self, topic: str, message: str) -> None:
        self.warnings.once(topic, message)

    # -- per call ---------------------------------------------------------------------------------

    def __call__(self, *args):
        if self.warnings.pending:  # what the capture thread found, said here, at the caller's line
            self.warnings.flush()
        if self.code_switch.pending:  # code compiled behind (code_switch.py): all pieces at once, then capture
            self.code_switch.apply(self)
        run = self._call if self._kernels_ran else self._first_call
        held = hold_captures()  # the captures this call asks for start once it has run (behind.py)
        try:
            if self._graphs_off:  # never graphed: nothing shared with other callers
                out = run(args)
            else:
                with self._guard:  # one graphed call at a time per device, in stream order (call_guard.py)
                    out = run(args)
        except BaseException:
            release_captures(held, ran=False)
            raise
        release_captures(held, ran=True)
        recorder = recording()  # a direct() wrapper learning which graph serves a signature
        if recorder is not None:
            recorder.append((self, args, out))
        return out

    def _first_call(self, args: tuple):
        """The first call launches kernels that never ran: Inductor tunes one of several configurations
        there (``torch.cuda.synchronize`` between timed runs), Triton loads its module. A device-wide
        synchronize fails, and breaks the capture, while any stream of the device is capturing: so
        not beside a recording of the capture thread (the device's capture lock)."""
        with self.call_guard.capture_lock:
            out = self._call(args)
        self._kernels_ran = True
        return out

    def _call(self, args: tuple):
        if self._sdpa_backends is None:
            out = self._dispatch(args)
        else:
            out = self._sdpa_backends.call(self._dispatch, (args,))
        if self.step_scalars is not None:
            self.step_scalars.write_ahead()  # the next decode position, while the GPU runs this step
        return out

    def _dispatch(self, args: tuple):
        if self.step_scalars is not None:
            args = self.step_scalars.refresh(args)  # positions of the KV writes moved into the graphs
        self.stats.calls += 1
        if not self.decisions.graphs_allowed():
            self._count_batch(args)
            return self._ungraphed(args)
        decisions = self.decisions
        if not decisions.weights_ready(args, self.runners, self.up_front):
            return self._ungraphed(args)
        key = self._shape_key(args)
        route = decisions.route(key, args, current_mode(), self.up_front)
        if route.full:
            out = self.full.call(route, args)
            if out is not FALLBACK:
                self._count_batch(args)
                return out
            route = decisions.piecewise_route(key, args, self.up_front)  # it could not be captured whole
        if route.key is None:
            return self._ungraphed(args)
        self.step.replay(route.key, route.size, route.padded)
        self.stats.graph_calls[(GraphMode.PIECEWISE, route.key[self._pad] if self._pad is not None else None)] += 1
        if route.capture:
            return self.capturing_step(
                route.key,
                CaptureHow.LAZY,
                dict(zip(self.plan.key.symbols, route.key)),
                lambda: self.forward_split(*args),
            )
        return self.forward_split(*args)

    def _ungraphed(self, args: tuple):
        self.step.ungraphed()
        return self.forward_split(*args)

    def _count_batch(self, args: tuple) -> None:
        """Calls no route counted count their batch sizes too (``stats.batch_sizes``, on CPU as well)."""
        if self._pad is not None:
            self.stats.batch_sizes[self._shape_key(args)[self._pad]] += 1

    def capturing_step(self, key: tuple, how: CaptureHow, sym_values: dict, run):
        """Run ``run()`` as the step that captures ``key``: fresh per-capture state, timed, recorded."""
        position = self.plan.key.pad_position
        self.step.capturing(key[position] if position is not None else None, sym_values)
        with self.call_guard.capture_lock:  # not beside the capture thread's recording
            before, start = self.memory_bytes(), time.perf_counter()
            out = run()
            synchronize(self.device)
        seconds = time.perf_counter() - start
        if how == CaptureHow.LAZY:
            self.stats.request_path_capture_seconds += seconds
        failed = any(key in r.failed_keys for r in self.runners.values())
        pieces = sum(1 for r in self.runners.values() if key in r.captures)
        self.decisions.recorded(key, how, seconds, before, GraphMode.PIECEWISE, failed, pieces)
        return out

    def capture_up_front(self, key: tuple, sym_values: dict, run):
        """Run ``run()`` (the compute pieces on made-up inputs, ``capture/up_front.py``) as the step that captures ``key``."""
        self.step.replay(key, key[self._pad], False)
        return self.capturing_step(key, CaptureHow.UP_FRONT, sym_values, run)

    # -- graph memory ---------------------------------------------------------------------------------

    def release_graphs(self) -> int:
        """Forget every shape key's graphs, for every set of weights (see ``registry.release_graphs``);
        the number of keys released. Keys whose capture failed stay un-graphed."""
        with self._guard:
            return self.forget_graphs()

    def forget_graphs(self) -> int:
        """:meth:`release_graphs` for a caller that holds the call guard."""
        released = self.decisions.release()
        for arenas in self.input_arenas():
            arenas.clear()  # no graph reads them any more
        return released

    def input_arenas(self) -> list:
        """The buffers captures copy their inputs into (``buffers.InputArenas``): per runner, and full graphs'."""
        return [r.arenas for r in self.runners.values()] + [self.full.arenas]

    def input_buffer_bytes(self) -> int:
        """Bytes of the buffers this graph's captures copy their inputs into (outside the pool)."""
        return sum(a.nbytes() for a in self.input_arenas())

    def memory_bytes(self) -> int:
        """Graph memory: the device's graph pool and this graph's input buffers."""
        return (pool_bytes(self.device) if self.device.type == "cuda" else 0) + self.input_buffer_bytes()

    def memory_bytes_reader(self) -> Callable[[], int]:
        """:meth:`memory_bytes` without a reference to this graph (the decisions it is handed to are
        this graph's own: a cycle would keep its CUDA graphs alive until the next garbage collection)."""
        this = weakref.ref(self)
        return lambda: this().memory_bytes()
