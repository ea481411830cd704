"""Where every call's way of running is decided: replay, capture, ride, retry, replace, up front, full
or un-graphed. One object per compiled graph; the compiled graph asks it once per call and does
what it is told.

The questions, in the order a call asks them (``graphs_allowed``, ``weights_ready``, ``route``):
0. **Graphs at all?** Not when the plan turned them off (why: ``stats``), nor under grad.
1. **Which set of graphs?** The parameters' addresses choose the active :class:`WeightSet`
   (``weight_sets.py`` says why sets, and when a new one is refused); with collectives, all ranks
   agree (``distributed.py``). A refused set: un-graphed.
2. **Full or piecewise?** Under ``cudagraph_mode("full")`` (``graph_mode.py``) a full graph of the
   whole call serves it where the plan allows one and its key's capture has not failed; else the
   call runs piecewise, the reason counted. Under ``"none"``: un-graphed.
3. **The first call** remembers what up-front capture needs and hands ``eager_capture_sizes`` to
   the capture thread (``behind.py``), itself served at once; with collectives, it captures them
   before its own output (``up_front.py`` executes both).
4. **Which key?** ``policy.CapturePolicy`` maps the shape key to a :class:`~.policy.Route`: replay a
   captured key (maybe padded), capture a new one, ride a larger captured graph while the size's
   own capture waits (``deferral.py``), or run un-graphed with a counted reason. The route is
   cached per key (a decode loop pays one dict lookup).
5. **Behind or inline?** A key to capture goes to the capture thread (``handover.py``); the call
   rides the smallest larger captured graph it may pad into, else runs un-graphed (not cached: the
   call after the key is in replays it). A full graph of an exact size (padding refused) is handed
   over at its second call, the first served by padded piecewise graphs. Inline
   (``handover.inline_reasons``), the call captures it itself.
6. **Replace?** Under ``max_captured_sizes``, a refused key that keeps coming replaces the least used
   captured one (``traffic.py``).
7. **Retry?** A key whose capture failed is captured again after a wait (``retries.py``).

After a capture, :meth:`CaptureDecisions.recorded` updates what the next calls are decided from
(captured keys, retries, the budget's measure); nothing else in the package changes those.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

from ...kinds import CaptureHow, GraphMode, Miss
from .. import messages
from ..distributed import RankAgreement, agreed_refusal
from ..stats import CaptureEvent, GraphStats
from ..symbolic import row_limit
from . import handover
from .policy import CapturePolicy, Route
from .traffic import CaptureTraffic
from .weight_sets import WeightSet, WeightSets

log = logging.getLogger(__name__)  # under the "piecewise_backend" logger

UNGRAPHED_NONE = Route(None, miss=Miss.MODE_NONE)


class CaptureDecisions:
    """Every per-call choice of one compiled graph, and the state they are made from.

    Args:
        plan: the graph's plan (its key, padding, full-graph plan, inputs, settings).
        stats: the graph's counters (decisions count their reasons there).
        memory: ``() -> bytes`` of graph memory now (the budget's measure).
        warnings: the graph's once-per-topic warnings (``messages.GraphWarnings``).
    """

    def __init__(self, plan, stats: GraphStats, memory: Callable[[], int], warnings: messages.GraphWarnings):
        settings = plan.settings
        self.plan, self.settings = plan, settings
        self.stats = stats
        self.memory = memory
        self.warnings = warnings
        # ranks that must decide captures together (distributed.py), from the groups the plan names
        self.agreement = RankAgreement(list(plan.collective_groups)) if plan.collective_groups else None
        full_refusal = None if plan.full.padding is not None else plan.full.padding_note
        self.policy = CapturePolicy(
            settings,
            plan.key.pad_position,
            plan.padding.refusal,
            self.agreement,
            row_limit(plan.padding.capacities, plan.key.symbols),
            tuple(map(str, plan.key.symbols)),
            (full_refusal, row_limit(plan.full.capacities, plan.key.symbols)),
        )
        self.full_refusal = plan.full.refusal
        self.weights = WeightSets(plan.inputs.weight_indices, settings.max_weight_sets)
        self.active = WeightSet(0)  # until the first call's addresses make one (weights_ready)
        # mode -> why its captures are made in the calls that need them (None: behind them)
        self.inline = handover.inline_reasons(plan, self.agreement)
        self._graph = lambda: None  # the CompiledGraph these decisions are for (attach), held weakly
        self._seen_whole: set = set()  # keys called whole at least once (full graphs of exact sizes)
        self._traffic = CaptureTraffic() if self.policy.budget.caps_sizes else None
        self._names = plan.inputs.names
        self._pad = plan.key.pad_position
        self._first = True
        self._graphs_off = plan.graphs_disabled_reason is not None
        self._any_requires_grad = (
            plan.inputs.any_requires_grad
        )  # the first piecewise route: up-front capture remembers, eager sizes are captured

    def attach(self, graph) -> None:
        """The compiled graph whose captures these decisions hand to the capture thread."""
        self._graph = weakref.ref(graph)

    @property
    def captured(self) -> set:
        """Shape keys with piecewise graphs, for the active set of weights."""
        return self.active.captured

    # -- 0. graphs at all -----------------------------------------------------------------------------

    def graphs_allowed(self) -> bool:
        """May this call be graphed at all? Not when the plan turned graphs off, nor while its
        inputs require grad under grad mode (CUDA graphs are for inference: warned once)."""
        if self._graphs_off:
            return False
        if not (self._any_requires_grad and torch.is_grad_enabled()):
            return True
        self.warnings.once(
            "grad",
            "piecewise: inputs require grad and grad mode is on; CUDA graphs are for "
            "inference, so this graph runs un-graphed. Call it under torch.no_grad() or "
            "torch.inference_mode() to get graphs.",
        )
        return False

    # -- 1. which set of graphs -------------------------------------------------------------------

    def weights_ready(self, args: tuple, runners: dict, up_front) -> bool:
        """Are the graphs of the call's parameter addresses the active ones, or made so now?

        With collectives, every rank asks on every call whether all ranks' parameters are where
        their graphs have them, and the ranks switch sets together (``distributed.py`` says why)."""
        unchanged = self.weights.unchanged(args)
        if self.agreement is not None:
            unchanged = self.agreement.all_allow(unchanged)
        if unchanged or self._switch_weights(self.weights.addresses(args), args, runners, up_front):
            return True
        self.stats.misses[Miss.WEIGHTS_MOVED] += 1
        return False

    def _switch_weights(self, addresses: tuple, args: tuple, runners: dict, up_front) -> bool:
        """Make the graphs of this set of parameter addresses the active ones (``weight_sets.py``);
        False when the set is new, ``max_weight_sets`` sets have graphs, and these addresses have not
        come before (they get graphs if they come again). With collectives, False on every rank
        when it is False on one, and the set switched to starts without graphs on every rank (its
        graphs, if it had any, are released): ranks whose addresses did not move capture again
        beside the one whose did."""
        moved = self.weights.first_moved(addresses, self._names)
        weight_set = self.weights.find(addresses)
        detail = None
        if weight_set is None:
            detail = (
                f"parameters/buffers (or inputs it writes in place) at a new set of addresses ({moved}); "
                f"{len(self.weights)} sets have graphs, max_weight_sets={self.weights.limit}"
            )
        if self.agreement is not None:
            detail = agreed_refusal(self.agreement, detail, messages.WEIGHTS_BOUND_ELSEWHERE)
        serial = self.stats.serial
        if detail is not None:
            self.stats.miss_details[Miss.WEIGHTS_MOVED] = detail
            self.warnings.once("weights bound", messages.weights_bound(serial, detail, weight_set is not None))
            return False
        if self.agreement is not None:
            weight_set.release()
        if weight_set.number > 1:
            self.warnings.once(
                "weights moved", messages.weights_moved(serial, moved, weight_set.number, self.weights.limit)
            )
        self.stats.weight_sets = max(self.stats.weight_sets, weight_set.number)
        self.stats.weight_sets_replaced = self.weights.replaced
        self.weights.activate(addresses, weight_set)
        self.active = weight_set
        weight_set.bind(runners)
        up_front.use_weights(args)  # capture() uses these weights from now on
        return True

    # -- 2-7. the route -----------------------------------------------------------------------------

    def route(self, key: tuple, args: tuple, mode: GraphMode, up_front) -> Route:
        """What this call does (``up_front``: the graph's ``UpFrontCapture``, which executes step 3)."""
        if mode is GraphMode.NONE:
            if not up_front.remembered:  # an un-graphed warm-up still lets capture() run after it
                up_front.remember(key, args)
            self.stats.misses[Miss.MODE_NONE] += 1
            if self._pad is not None:
                self.stats.batch_sizes[key[self._pad]] += 1
            return UNGRAPHED_NONE
        if mode is GraphMode.FULL:
            route = self._full_route(key, args)
            if route.key is not None:
                return route
            self.stats.full_fallbacks[route.detail] += 1
            if route.waiting is not None:  # its full graph waits: piecewise graphs serve, padded where they may
                return self.piecewise_route(key, args, up_front, captures=self.policy.full.exact_sizes)
        return self.piecewise_route(key, args, up_front)

    def piecewise_route(self, key: tuple, args: tuple, up_front, captures: bool = True) -> Route:
        """Steps 3-7 (a full graph that could not serve the call comes here too); ``captures=False``:
        replay or ride what is captured, capture nothing."""
        active = self.active
        route = active.routes.get(key)
        if route is None:
            route = self._new_route(key, args, up_front, captures)
        if route.size is not None:
            self.stats.batch_sizes[route.size] += 1
        if self._traffic is not None and captures:
            route = self._follow_traffic(route, key, args, up_front)
        if route.key is None:
            self.stats.misses[route.miss] += 1
            return route
        if route.waiting is not None or route.miss is not None:  # its own size waits or was refused
            self.stats.rides += 1
        if captures and active.retries.pending and not route.capture and active.retries.due(route.key):
            self._drop(route.key)  # a failed capture's turn: the whole step is captured again (retries.py)
            route = self._new_route(key, args, up_front)
        return route

    def _new_route(self, key: tuple, args: tuple, up_front, captures: bool = True) -> Route:
        if self._first:
            self._first = False
            up_front.remember(key, args)
            self._warn_exact_sizes("piecewise")
            sizes = up_front.eager_sizes()
            if sizes and self.agreement is not None:
                up_front.capture_sizes(sizes)  # collectives: every rank in one order, before the output
            elif sizes:  # behind this call, in the capture thread, largest first
                up_front.capture_behind(sizes)
        active = self.active
        route = self.policy.route(key, active.captured, self.memory, active.unreplayed)
        if (route.capture or route.miss is Miss.NOT_CAPTURED) and self._eager_sizes_queued():
            return Route(None, route.size, miss=Miss.CAPTURING_BEHIND)  # served at once; not kept: routed anew
        if route.capture and (not captures or self.inline[GraphMode.PIECEWISE] is None):
            return self._while_behind(key, route, args, captures, active.captured, full=False)
        if route.miss is not None:
            self._warn_refused(key, route)
        if route.key is not None and not route.capture:
            active.unreplayed.discard(route.key)  # a captured key's first replay is routed here (routes were cleared)
        if not route.capture and route.waiting is None:  # a size waiting for its own graph counts its calls
            active.routes[key] = route
        return route

    def _while_behind(self, key: tuple, route: Route, args: tuple, submit: bool, captured, full: bool) -> Route:
        """The route of a call whose key (``route.key``) is to be captured behind it: the key handed
        to the capture thread (``submit``: the callers pass it only where that kind's captures go
        behind), and the call served by the smallest larger captured graph it may pad into, else
        un-graphed. Not cached: the call after the thread published the key replays it."""
        graph = self._graph()
        if submit and graph is not None:
            handover.submit_for(graph, GraphMode.FULL if full else GraphMode.PIECEWISE, route.key, args)
        ride = self.policy.ride(key, captured, full=full)
        if ride is not None:
            return Route(ride, route.size, padded=True, waiting=route.key, full=full)
        detail = str(Miss.CAPTURING_BEHIND)  # (a full call's fallback counts by it too)
        return Route(None, route.size, miss=Miss.CAPTURING_BEHIND, detail=detail, waiting=route.key, full=full)

    def _eager_sizes_queued(self) -> bool:
        return bool(self.settings.eager_sizes) and handover.busy(self._graph())

    def up_front_route(self, key: tuple) -> Route:
        """May ``key`` be captured up front now (``capture()``)? The budget's answer, as a route."""
        route = self.policy.admit(key, self.active.captured, self.memory)
        if not route.capture:
            self.warnings.once(
                Miss.OVER_BUDGET,
                f"piecewise: graph {self.stats.serial}: stopped capturing at shape key {key}: {route.detail}.",
            )
        return route

    def _full_route(self, key: tuple, args: tuple) -> Route:
        """A full graph to replay or capture, or (no key) why the call runs piecewise, every rank agreeing."""
        state = self.active.full
        route = state.routes.get(key)
        if route is None:
            if not state.graphs and not state.failed:
                self._warn_exact_sizes("full")
            route = self.policy.full_route(
                key, state.graphs, state.failed, self.memory, state.unreplayed, self.full_refusal
            )
            if route.capture and self.inline[GraphMode.FULL] is None:
                submit = not self.policy.full.exact_sizes or key in self._seen_whole
                self._seen_whole.add(key)  # an exact size (padding refused) is captured whole once it recurs
                route = self._while_behind(key, route, args, submit, state.graphs, full=True)
            if route.key is not None and not route.capture:
                state.unreplayed.discard(route.key)  # a captured key's first replay is routed here
            if not route.capture and route.waiting is None:
                state.routes[key] = route
        reason = route.detail if route.key is None else None
        reason = agreed_refusal(self.agreement, reason, "another rank runs this call piecewise")
        return route if reason is None else Route(None, route.size, detail=reason, full=True, waiting=route.waiting)

    def _follow_traffic(self, route: Route, key: tuple, args: tuple, up_front) -> Route:
        """Count the call's key; a key refused by ``max_captured_sizes`` that keeps coming replaces
        the least used captured key (``traffic.py``), every rank agreeing."""
        decide, victim = self._traffic.replacement(route, self.active.captured, self.policy, self.memory)
        if not decide or agreed_refusal(
            self.agreement, None if victim is not None else "keeps its graphs", "another rank keeps them"
        ):
            return route
        self._drop(victim)
        self.stats.replaced_keys.append(victim)
        log.info(
            "piecewise: graph %d: shape key %s replaces %s (%s)",
            self.stats.serial,
            route.wanted,
            victim,
            self._traffic.describe(route.wanted, victim),
        )
        return self._new_route(key, args, up_front)

    def _drop(self, captured_key: tuple) -> None:
        self.active.drop(captured_key)

    def _warn_exact_sizes(self, kind: str) -> None:
        """Padding wanted but refused: each size is captured as it is; said once, at the user's line."""
        plan = self.plan
        if self._pad is None:  # one shape (Dynamo specialised it): nothing to pad
            return
        rule, refusal = (
            (self.policy.pieces, plan.padding.refusal)
            if kind == "piecewise"
            else (self.policy.full, plan.full.padding_note if plan.full.refusal is None else None)
        )
        if rule.exact_sizes and refusal and f"{kind} graphs" not in self.stats.exact_sizes:
            self.stats.exact_sizes += f"{'; ' if self.stats.exact_sizes else ''}{kind} graphs: {refusal}"
            self.warnings.once(f"exact {kind} sizes", messages.exact_sizes(self.stats.serial, kind, refusal))

    def _warn_refused(self, key: tuple, route: Route) -> None:
        self.stats.miss_details[route.miss] = route.detail
        message = messages.refused(self.stats.serial, key, route.miss, route.detail, route.key)
        if message is not None:
            self.warnings.once(route.miss, message)

    # -- after a capture ------------------------------------------------------------------------------

    def recorded(
        self,
        key: tuple,
        how: CaptureHow,
        seconds: float,
        before: int,
        mode: GraphMode,
        failed: bool = False,
        pieces: int = 1,
        weight_set: WeightSet | None = None,
    ) -> None:
        """A capture of ``key`` ended (``failed``: some piece of it failed), for the active set of
        weights or ``weight_set`` (a capture behind, which may finish after a switch): what the
        next calls are decided from, the budget's measure, the event and the log line. From the
        capture thread, its warnings wait for the next call (``messages.GraphWarnings.later``)."""
        after = self.memory()
        active = weight_set or self.active
        warn = self.warnings.once if weight_set is None else self.warnings.later
        if mode is GraphMode.PIECEWISE:
            active.captured.add(key)
            if failed:
                active.retries.failed(key)
            else:
                active.retries.succeeded(key)
            if how in (CaptureHow.LAZY, CaptureHow.BEHIND):
                active.unreplayed.add(key)
            active.routes.clear()  # misses may now be served (lazy_capture=False) or refused (budget)
        else:
            active.full.unreplayed.add(key)
            active.full.routes.clear()  # misses may now be served (a larger graph to ride)
        self.policy.budget.record(key[self._pad] if self._pad is not None else None, after - before)
        self.stats.events.append(CaptureEvent(key, how, seconds, after, after - before, pieces, self.stats.calls, mode))
        log.info(
            "piecewise: graph %d: captured shape key %s (%s, %s) in %.0f ms; graph pool %.1f MiB (+%.1f MiB)",
            self.stats.serial,
            key,
            how,
            "whole call" if mode is GraphMode.FULL else f"{pieces} pieces",
            seconds * 1e3,
            after / 2**20,
            (after - before) / 2**20,
        )
        cap = self.settings.max_graph_memory
        if cap is not None and after > cap:
            warn(
                "over cap",
                f"piecewise: graph {self.stats.serial}: graph memory holds "
                f"{after / 2**20:.1f} MiB after capturing {key}, above max_graph_memory="
                f"{cap / 2**20:.1f} MiB; no further captures.",
            )

    def full_failed(self, key: tuple, message: str, weight_set: WeightSet | None = None) -> None:
        """A full capture of ``key`` failed: that size runs piecewise from now on (``weight_set``: as
        for :meth:`recorded`)."""
        state = (weight_set or self.active).full
        state.failed[key] = message
        state.routes.clear()
        self.stats.full_failures.append(message)
        warn = self.warnings.once if weight_set is None else self.warnings.later
        warn("full capture", f"piecewise: graph {self.stats.serial}: {message}")

    def release(self) -> int:
        """Forget every shape key's graphs, for every set of weights; the number of keys released."""
        return sum(weight_set.release() for weight_set in self.weights.all())
