"""The callable Dynamo installs for one graph: per call, pick the graphs that serve it, or say why not.

Built from a frozen :class:`~piecewise_backend.plan.types.GraphPlan` (the wrap stage of ``backend.py``):
each compute piece of the split graph is replaced by a
:class:`~piecewise_backend.runtime.piece_runner.PieceRunner`, the eager pieces run as they are
between the replays. Per call, in order:

1. the step scalars are refreshed (the decode rewrite's positions, checked on the host; after the
   call, the next decode position is written ahead);
2. un-graphed if graphs are off for this graph or grad is needed;
3. the parameters' addresses choose the set of graphs (``weight_sets.py``);
4. a call under ``cudagraph_mode("full")`` is served by a full graph of the whole call
   (``full_graph.py``) where it can be; under ``"none"``, un-graphed; else, or when a full graph
   cannot serve it, the shape key picks a cached :class:`~.capture_policy.Route`: replay a
   captured key (maybe padded), capture a new one, or run un-graphed with a counted reason;
5. under ``max_captured_sizes``, a refused key that keeps coming replaces the least used captured
   one (``capture_traffic.py``);
6. the runners are told through the step protocol (``StepState``) and the split graph runs.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

import torch

from .. import _torch_internals
from ..config import PiecewiseConfig
from ..kinds import CaptureHow, GraphMode, Miss, PieceKind
from ..plan.types import PieceCode
from . import messages
from .call_guard import call_guard
from .capture_policy import CapturePolicy, Route
from .capture_retries import CaptureRetries
from .capture_traffic import CaptureTraffic
from .code_switch import CodeSwitch
from .devices import pool_bytes, synchronize
from .distributed import RankAgreement, agreed_refusal
from .full_graph import FALLBACK, FullGraphs
from .graph_mode import current_mode
from .piece_runner import PieceRunner, StepState
from .sdpa_backends import SdpaBackends
from .split_forward import one_piece_forward
from .stats import CaptureEvent, GraphStats, PieceStats
from .up_front import UpFrontCapture
from .weight_sets import WeightSet, WeightSets

if TYPE_CHECKING:
    from ..plan.types import GraphPlan

log = logging.getLogger(__name__)  # under the "piecewise_backend" logger


class CompiledGraph:
    """The callable Dynamo installs for one captured graph."""

    def __init__(self, plan: GraphPlan, config: PiecewiseConfig, compiled: Mapping[str, Callable | None]):
        """``compiled``: each compute piece's compiled code (None, or left out: it runs its traced code)."""
        self.plan = plan
        self.config = config
        self.compiled_code = dict(compiled)  # what the pieces were built with (``persist/`` saves it)
        self.serial = 0  # numbered by the registry (``registry.py``) once built
        self.stats = GraphStats.of_plan(plan)
        # ranks that must decide captures together (distributed.py), from the groups the plan names
        self.agreement = RankAgreement(list(plan.collective_groups)) if plan.collective_groups else None
        full_refusal = None if plan.full.padding is not None else plan.full.padding_note
        self.policy = CapturePolicy(config, plan.key.pad_position, plan.padding.refusal, self.agreement,
                                    plan.row_limit(), tuple(map(str, plan.key.symbols)),
                                    (full_refusal, plan.full.row_limit(plan.key.symbols)))
        self.step = StepState()
        # the split graph this graph runs: a copy of the plan's program, its pieces replaced by runners
        self.split_module = torch.fx.GraphModule(plan.program.module, plan.program.module.graph)
        self.runners = self._wrap_pieces(compiled)
        self.captured: set = set()  # shape keys captured (for the active set of weights)
        self._routes: dict[tuple, Route] = {}
        self._unreplayed: set = set()  # keys captured lazily and not replayed since (capture_policy.churn)
        self._retries = CaptureRetries()  # keys whose capture failed, tried again later (capture_retries.py)
        self._traffic = CaptureTraffic() if self.policy.budget.caps_sizes else None  # capture_traffic.py
        self.weights = WeightSets(plan.inputs.weight_indices, config.max_weight_sets)
        self.up_front = UpFrontCapture(self)
        self._warned: set = set()
        self.forward_split = one_piece_forward(self.split_module) or \
            _torch_internals.generated_forward(self.split_module)
        self.full = FullGraphs(self)  # calls under cudagraph_mode("full"): the whole call, one graph
        # the positions written per call: state of this graph's own (the plan's step scalars are a layout)
        self.step_scalars = plan.step_scalars.fresh() if plan.step_scalars is not None else None
        # read on every call: kept here rather than derived from the plan each time
        self._graphs_off = plan.graphs_disabled_reason is not None
        self._any_requires_grad = plan.inputs.any_requires_grad
        self._shape_key = plan.key.of
        self._pad = plan.key.pad_position
        self._sdpa_backends = SdpaBackends(dict(plan.sdpa_choice.enabled), plan.sdpa_choice.reason) \
            if plan.sdpa_choice is not None else None
        self.call_guard = self._guard = call_guard(plan.device)
        self.code_switch = CodeSwitch()  # code compiled while this graph serves (compiler="eager_then_inductor")

    def _wrap_pieces(self, compiled: Mapping[str, Callable | None]) -> dict[str, PieceRunner]:
        """Replace each compute submodule by its runner (an instance attribute shadows the registered
        submodule, which stays for inspection); eager submodules are called without
        ``nn.Module.__call__``'s overhead."""
        split_gm = self.split_module
        device = self.plan.device
        runners = {}
        for spec in self.plan.piece_specs:
            if spec.kind == PieceKind.COMPUTE:
                self.stats.pieces[spec.name] = PieceStats(spec.name)
                code = PieceCode(compiled.get(spec.name), self.plan.program.piece(spec.name))
                runners[spec.name] = PieceRunner(self.plan.pieces[spec.name], code, self.step, self.stats.pieces[spec.name],
                                                 self.config.warmup_runs, self.config.clone_outputs,
                                                 self.agreement, device)
                split_gm.__dict__[spec.name] = runners[spec.name]
            else:
                split_gm.__dict__[spec.name] = getattr(split_gm, spec.name).forward
        return runners

    # -- what the plan says, by name ----------------------------------------------------------------

    pieces = property(lambda self: self.plan.piece_specs)
    signatures = property(lambda self: self.plan.report.signatures)
    key_symbols = property(lambda self: self.plan.key.symbols)
    pad_position = property(lambda self: self.plan.key.pad_position)
    graphs_disabled_reason = property(lambda self: self.plan.graphs_disabled_reason)
    unmasked_writes = property(lambda self: self.plan.unmasked_writes)
    device = property(lambda self: self.plan.device)

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
        :meth:`UpFrontCapture.capture`). Safe beside other threads' calls (it holds the call guard)."""
        with self._guard:
            return self.up_front.capture(sizes)

    # -- per call ---------------------------------------------------------------------------------

    def __call__(self, *args):
        if self.code_switch.pending:  # code compiled behind (code_switch.py): all pieces at once, then capture
            self.code_switch.apply(self)
        if self._graphs_off:  # never graphed: nothing shared with other callers
            return self._call(args)
        with self._guard:  # one graphed call at a time per device, in stream order (call_guard.py)
            return self._call(args)

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
        step = self.step
        self.stats.calls += 1
        if self._graphs_off or not self._grad_allows_graphs():
            self._count_batch(args)
            step.ungraphed()
            return self.forward_split(*args)
        if not self._weights_ready(args):
            step.ungraphed()
            self.stats.misses[Miss.WEIGHTS_MOVED] += 1
            return self.forward_split(*args)
        key = self._shape_key(args)
        mode = current_mode()
        if mode is not GraphMode.PIECEWISE:  # the caller chose (graph_mode.py)
            out = self._other_mode(mode, key, args)
            if out is not FALLBACK:
                return out
        route = self._routes.get(key)
        if route is None:
            route = self._new_route(key, args)
        if route.size is not None:
            self.stats.batch_sizes[route.size] += 1
        if self._traffic is not None:
            route = self._follow_traffic(route, key, args)
        if route.key is None:
            step.ungraphed()
            self.stats.misses[route.miss] += 1
            return self.forward_split(*args)
        if route.waiting is not None or route.miss is not None:  # its own size waits or was refused
            self.stats.rides += 1
        if self._retries.pending and not route.capture and self._retries.due(route.key):
            route = self._forget(route.key, key, args)  # a failed capture's turn to be tried again
            if route.key is None:
                step.ungraphed()
                return self.forward_split(*args)
        step.replay(route.key, route.size, route.padded)
        self.stats.graph_calls[(GraphMode.PIECEWISE, route.key[self._pad] if self._pad is not None else None)] += 1
        if route.capture:
            return self.capturing_step(route.key, CaptureHow.LAZY, dict(zip(self.plan.key.symbols, route.key)),
                                       lambda: self.forward_split(*args))
        return self.forward_split(*args)

    def _other_mode(self, mode: GraphMode, key: tuple, args: tuple):
        """A call under ``cudagraph_mode("full")`` or ``("none")``: its output, or FALLBACK (run it piecewise)."""
        if mode is GraphMode.NONE:
            self.step.ungraphed()
            self.stats.misses[Miss.MODE_NONE] += 1
            out = self.forward_split(*args)
        else:
            out = self.full.call(key, args)
        if out is not FALLBACK:  # (a fallback's piecewise route counts its size)
            self._count_batch(args)
        return out

    def _forget(self, captured_key: tuple, key: tuple, args: tuple) -> Route:
        """Drop the graphs of ``captured_key`` (one of its pieces failed to capture) and route the call
        anew: the whole step is captured again (``capture_retries.py`` says why not one piece)."""
        self._drop(captured_key)
        return self._new_route(key, args)

    def _drop(self, captured_key: tuple) -> None:
        for runner in self.runners.values():
            runner.captures.pop(captured_key, None)
            runner.failed_keys.discard(captured_key)
        self.captured.discard(captured_key)
        self._unreplayed.discard(captured_key)
        self._routes.clear()

    def _follow_traffic(self, route: Route, key: tuple, args: tuple) -> Route:
        """Count the call's key; a key refused by ``max_captured_sizes`` that keeps coming replaces
        the least used captured key (``capture_traffic.py``), every rank agreeing."""
        decide, victim = self._traffic.replacement(route, self.captured, self.policy, self.memory_bytes)
        if not decide or agreed_refusal(self.agreement, None if victim is not None else "keeps its graphs",
                                        "another rank keeps them"):
            return route
        self._drop(victim)
        self.stats.replaced_keys.append(victim)
        log.info("piecewise: graph %d: shape key %s replaces %s (%s)", self.serial, route.wanted, victim,
                 self._traffic.describe(route.wanted, victim))
        return self._new_route(key, args)

    def _count_batch(self, args: tuple) -> None:
        """Un-graphed graphs count their batch sizes too (``stats.batch_sizes``, on CPU as well)."""
        if self._pad is not None:
            self.stats.batch_sizes[self._shape_key(args)[self._pad]] += 1

    def _weights_ready(self, args: tuple) -> bool:
        """Are the graphs of the call's parameter addresses the active ones, or made so now?

        With collectives, every rank asks on every call whether all ranks' parameters are where
        their graphs have them, and the ranks switch sets together (``distributed.py`` says why)."""
        unchanged = self.weights.unchanged(args)
        if self.agreement is not None:
            unchanged = self.agreement.all_allow(unchanged)
        return unchanged or self._use_weights(self.weights.addresses(args), args)

    def _use_weights(self, addresses: tuple, args: tuple) -> bool:
        """Make the graphs of this set of parameter addresses the active ones (``weight_sets.py``);
        False when the set is new, ``max_weight_sets`` sets have graphs, and these addresses have not
        come before (they get graphs if they come again). With collectives, False on every rank
        when it is False on one, and the set switched to starts without graphs on every rank (its
        graphs, if it had any, are released): ranks whose addresses did not move capture again
        beside the one whose did."""
        moved = self.weights.first_moved(addresses, self.plan.inputs.names)
        weight_set = self.weights.find(addresses)
        detail = None
        if weight_set is None:
            detail = (f"parameters/buffers (or inputs it writes in place) at a new set of addresses ({moved}); "
                      f"{len(self.weights)} sets have graphs, max_weight_sets={self.weights.limit}")
        if self.agreement is not None:
            detail = agreed_refusal(self.agreement, detail, messages.WEIGHTS_BOUND_ELSEWHERE)
        if detail is not None:
            self.stats.miss_details[Miss.WEIGHTS_MOVED] = detail
            self.warn_once("weights bound", messages.weights_bound(self.serial, detail, weight_set is not None))
            return False
        if self.agreement is not None:
            weight_set.release()
        if weight_set.number > 1:
            self.warn_once("weights moved", messages.weights_moved(self.serial, moved, weight_set.number,
                                                                   self.weights.limit))
        self.stats.weight_sets = max(self.stats.weight_sets, weight_set.number)
        self.stats.weight_sets_replaced = self.weights.replaced
        self._activate(addresses, weight_set)
        self.up_front.use_weights(args)
        return True

    def _activate(self, addresses: tuple, weight_set: WeightSet) -> None:
        for name, runner in self.runners.items():
            runner.captures = weight_set.captures.setdefault(name, {})
            runner.failed_keys = weight_set.failed.setdefault(name, set())
        self.captured, self._routes, self._unreplayed = weight_set.captured, weight_set.routes, weight_set.unreplayed
        self._retries, self.full.state = weight_set.retries, weight_set.full
        self.weights.activate(addresses, weight_set)

    def _new_route(self, key: tuple, args: tuple) -> Route:
        if not self.up_front.remembered:
            self.up_front.remember(key, args)
            self.up_front.capture_eager_sizes()  # before the first output
        route = self.policy.route(key, self.captured, self.memory_bytes, self._unreplayed)
        if route.miss is not None:
            self._warn_refused(key, route)
        if route.key is not None and not route.capture:
            self._unreplayed.discard(route.key)  # a captured key's first replay is routed here (routes were cleared)
        if not route.capture and route.waiting is None:  # a size waiting for its own graph counts its calls
            self._routes[key] = route
        return route

    def _warn_refused(self, key: tuple, route: Route) -> None:
        self.stats.miss_details[route.miss] = route.detail
        instead = (f"Those calls replay the graph of {route.key}, padded" if route.key is not None
                   else "Those calls run un-graphed")
        if route.miss == Miss.OVER_BUDGET:
            self.warn_once(route.miss, messages.over_budget(self.serial, key, route.detail, instead))
        elif route.miss == Miss.NEVER_REPLAYED:
            self.warn_once(route.miss, messages.never_replayed(self.serial, route.detail, instead))

    def capturing_step(self, key: tuple, how: CaptureHow, sym_values: dict, run):
        """Run ``run()`` as the step that captures ``key``: fresh per-capture state, timed, recorded."""
        position = self.plan.key.pad_position
        self.step.capturing(key[position] if position is not None else None, sym_values)
        before, start = self.memory_bytes(), time.perf_counter()
        out = run()
        synchronize(self.device)
        self._record_capture(key, how, time.perf_counter() - start, before)
        return out

    def _grad_allows_graphs(self) -> bool:
        if not (self._any_requires_grad and torch.is_grad_enabled()):
            return True
        self.warn_once("grad", "piecewise: inputs require grad and grad mode is on; CUDA graphs are for "
                               "inference, so this graph runs un-graphed. Call it under torch.no_grad() or "
                               "torch.inference_mode() to get graphs.")
        return False

    def warn_once(self, topic: str, message: str) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            warnings.warn(message, stacklevel=4)

    # -- capture bookkeeping ----------------------------------------------------------------------

    def release_graphs(self) -> int:
        """Forget every shape key's graphs, for every set of weights (see ``registry.release_graphs``);
        the number of keys released. Keys whose capture failed stay un-graphed."""
        with self._guard:
            return self.forget_graphs()

    def forget_graphs(self) -> int:
        """:meth:`release_graphs` for a caller that holds the call guard."""
        released = sum(weight_set.release() for weight_set in self.weights.all())
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

    def _record_capture(self, key: tuple, how: CaptureHow, seconds: float, before: int) -> None:
        after = self.memory_bytes()
        self.captured.add(key)
        if any(key in r.failed_keys for r in self.runners.values()):
            self._retries.failed(key)
        else:
            self._retries.succeeded(key)
        if how == CaptureHow.LAZY:
            self._unreplayed.add(key)
        self._routes.clear()  # misses may now be served (lazy_capture=False) or refused (budget)
        self.log_capture(key, how, seconds, before, GraphMode.PIECEWISE, after)

    def log_capture(self, key: tuple, how: CaptureHow, seconds: float, before: int, mode: GraphMode,
                    after: int | None = None) -> None:
        """What every capture leaves, piecewise or full: the budget's measure, the event, the log line."""
        after = self.memory_bytes() if after is None else after
        position = self.plan.key.pad_position
        self.policy.budget.record(key[position] if position is not None else None, after - before)
        pieces = sum(1 for r in self.runners.values() if key in r.captures) if mode is GraphMode.PIECEWISE else 1
        self.stats.events.append(CaptureEvent(key, how, seconds, after, after - before, pieces, self.stats.calls, mode))
        log.info("piecewise: graph %d: captured shape key %s (%s, %s) in %.0f ms; graph pool %.1f MiB (+%.1f MiB)",
                 self.serial, key, how, "whole call" if mode is GraphMode.FULL else f"{pieces} pieces",
                 seconds * 1e3, after / 2**20, (after - before) / 2**20)
        cap = self.config.max_graph_memory
        if cap is not None and after > cap:
            self.warn_once("over cap", f"piecewise: graph {self.serial}: graph memory holds {after / 2**20:.1f} "
                                       f"MiB after capturing {key}, above max_graph_memory={cap / 2**20:.1f} "
                                       f"MiB; no further captures.")
