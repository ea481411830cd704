"""Which captured graph serves a call: capture sizes, padding, lazy vs up-front capture, a budget.

The seed RFC's trade-off: capturing every size up front costs seconds and memory nobody planned
for; capturing lazily makes latency and memory unpredictable. So every knob is explicit and this
module turns them into one :class:`Route` per call, which the stitched graph caches per shape key (a
decode loop pays one dict lookup per step for it).

A call is graphed in one of two ways, the caller choosing per call (``graph_mode.cudagraph_mode``):
piecewise (compute pieces, splitting ops eager between them) or full (the whole call, one graph).
Both kinds of graph share the sizes, the budget and the pool, but each has its own captured keys,
its own padding rule (a full graph runs the splitting ops at the padded size too, so the proof
covers them: :class:`SizeRule`) and its own deferral counts. This module is where the choice of
graph for a call is made, for both.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable

from ...kinds import Miss
from ...plan.types import RuntimeSettings
from ..distributed import RankAgreement, agreed_refusal
from .deferral import CaptureDeferral


@dataclasses.dataclass(frozen=True)
class Route:
    """What one call does: which captured graph it replays or captures, or why it runs un-graphed.

    Attributes:
        key: shape key of the graphs to replay or capture (batch size rounded up to a capture size);
            None when the call runs un-graphed.
        size: the caller's batch size, which outputs are sliced back to.
        padded: the key's batch size is larger than the caller's.
        capture: no graph exists for ``key`` yet; this call captures it.
        miss: why the call runs un-graphed (stats count by it).
        detail: the reason with its numbers, for people.
        wanted: the key a refused capture would have captured (``capture_traffic.py`` counts it).
        waiting: the bucket key this call's size waits to have captured while it rides ``key``, a
            larger captured graph (``capture_deferral.py``); such a route is made anew at each call.
        full: the graph is a full one (the whole call captured, ``full_graph.py``), not pieces.

    A route with a ``key`` and a ``miss`` replays ``key`` padded: the size's own capture was refused
    (``miss`` says why) and a larger captured graph serves it rather than an un-graphed run.
    """

    key: tuple | None
    size: int | None = None
    padded: bool = False
    capture: bool = False
    miss: Miss | None = None
    detail: str | None = None
    wanted: tuple | None = None
    waiting: tuple | None = None
    full: bool = False


@dataclasses.dataclass(frozen=True)
class SizeRule:
    """How one kind of graph (piecewise or full) maps a batch size to a captured size.

    ``padding``: pad up to the next capture size (the proof held); ``exact_sizes``: padding was
    wanted but refused, so each size up to the largest is captured as it is; ``row_limit``: ``key ->
    rows`` that a padded batch may not exceed (see :class:`CapturePolicy`); ``deferral``: the
    counts of ``defer_captures``, or None.
    """

    padding: bool
    exact_sizes: bool
    row_limit: Callable | None
    deferral: CaptureDeferral | None

    @classmethod
    def of(cls, config: RuntimeSettings, no_padding_reason: str | None, row_limit) -> SizeRule:
        return cls(
            config.padding and no_padding_reason is None,
            config.padding and no_padding_reason is not None,
            row_limit,
            CaptureDeferral() if config.defer_captures else None,
        )


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


class CaptureBudget:
    """Caps on graph-pool bytes and on the number of captured sizes.

    Bytes are what the CUDA allocator says the pool holds, measured after each capture. Before a
    capture we only know an estimate: the most bytes per batch row any earlier capture of this graph
    added to the pool, times the new size (0 for the first capture: it is allowed while the pool is
    under the cap, and its real cost is measured and reported).
    """

    def __init__(self, max_bytes: int | None, max_sizes: int | None):
        self.max_bytes = max_bytes
        self.max_sizes = max_sizes
        self.bytes_per_row = 0.0

    @property
    def needs_pool_bytes(self) -> bool:
        return self.max_bytes is not None

    @property
    def caps_sizes(self) -> bool:
        return self.max_sizes is not None

    def refusal(self, size: int | None, captured: int, pool_bytes: int) -> str | None:
        """Why capturing one more size (``size`` rows) is refused, or None if it is allowed."""
        if self.max_sizes is not None and captured >= self.max_sizes:
            return f"{captured} sizes captured, max_captured_sizes={self.max_sizes}"
        if self.max_bytes is not None:
            estimate = self.bytes_per_row * (size or 1)
            if pool_bytes + estimate > self.max_bytes:
                return (
                    f"graph memory (pool and input buffers) holds {_mib(pool_bytes)}, a capture of size "
                    f"{size} adds about {_mib(estimate)}, max_graph_memory={_mib(self.max_bytes)}"
                )
        return None

    def record(self, size: int | None, growth: int) -> None:
        if growth > 0:
            self.bytes_per_row = max(self.bytes_per_row, growth / (size or 1))


class CapturePolicy:
    """Turns a call's shape key into a :class:`Route`.

    Args:
        config: the options run time reads (``plan.types.RuntimeSettings``).
        pad_position: index in the shape key of the padded (leading dynamic) size, or None when the
            graph has none (a graph Dynamo specialised to one batch size: its one key is captured
            as is).
        no_padding_reason: why this graph cannot be padded (None if it can). Then each batch size up
            to the largest capture size is captured as it is, on first sight: padding was wanted and
            the proof refused it, and a size left un-graphed (batch 3 of a generate() call) would
            cost the launch overhead at every step. ``padding=False`` keeps to ``capture_sizes``.
        agreement: for a graph with collectives, the other ranks' say in every budget decision
            (``distributed.RankAgreement``), so all ranks capture the same sizes at the same call.
        row_limit: ``key -> rows``: the fewest rows of the tensors the graph reads or writes by batch
            row (``cache[:B]``; see ``row_independence``), or None. A batch pads only up to it;
            past it, the exact size is captured (padded rows would reach past those tensors).
        full_padding: (why full graphs cannot be padded or None, their ``row_limit``).
    """

    def __init__(
        self,
        config: RuntimeSettings,
        pad_position: int | None,
        no_padding_reason: str | None,
        agreement: RankAgreement | None = None,
        row_limit=None,
        symbols: tuple = (),
        full_padding: tuple = (None, None),
    ):
        self.sizes = config.sizes
        self.max_unreplayed = config.max_unreplayed_captures
        self.symbols = symbols  # the name of each shape-key position, for people
        self.pad_position = pad_position
        self.lazy = config.lazy_capture
        self.budget = CaptureBudget(config.max_graph_memory, config.max_captured_sizes)
        self.agreement = agreement
        self.pieces = SizeRule.of(config, no_padding_reason, row_limit)
        self.full = SizeRule.of(config, *full_padding)

    padding = property(lambda self: self.pieces.padding)  # the piecewise rule's, by their old names
    row_limit = property(lambda self: self.pieces.row_limit)

    def bucket(self, size: int, rows: int | None = None, rule: SizeRule | None = None) -> int | None:
        """The capture size that serves ``size`` if it were captured (ignoring what is); ``size``
        itself when padding up would pass ``rows``, or when the graph cannot be padded."""
        rule = rule or self.pieces
        if size > self.sizes[-1]:
            return None
        if rule.padding:
            bucket = self.sizes[bisect.bisect_left(self.sizes, size)]
            return size if rows is not None and bucket > rows else bucket
        return size if size in self.sizes or rule.exact_sizes else None

    def with_size(self, key: tuple, size: int) -> tuple:
        p = self.pad_position
        return key[:p] + (size,) + key[p + 1 :]

    def route(self, key: tuple, captured, pool_bytes, unreplayed: set = frozenset(), full: bool = False) -> Route:
        """The route for ``key`` given the keys already ``captured`` (``unreplayed``: those captured
        lazily and not replayed since), among piecewise graphs or, ``full``, full graphs.

        ``pool_bytes`` is a callable (measuring the pool costs a snapshot; only done when a memory
        cap exists and a capture is being considered).
        """
        route = self._route(key, captured, pool_bytes, unreplayed, self.full if full else self.pieces)
        return dataclasses.replace(route, full=True) if full else route

    def full_route(self, key: tuple, graphs, failed, pool_bytes, unreplayed: set, refusal: str | None) -> Route:
        """The route of a call under ``cudagraph_mode("full")``: a full graph to replay or capture
        (``graphs``: those captured), or, with no key, why the call runs piecewise instead (this
        graph may never be captured whole: ``refusal``; the key's capture ``failed``; a miss)."""
        if refusal is not None:
            return Route(None, detail=refusal, full=True)
        route = self.route(key, graphs, pool_bytes, unreplayed, full=True)
        if route.key is None:
            return dataclasses.replace(route, detail=route.detail or str(route.miss))
        if route.key in failed:
            return Route(None, route.size, detail="its capture failed", full=True)
        return route

    def _route(self, key: tuple, captured, pool_bytes, unreplayed, rule: SizeRule) -> Route:
        if self.pad_position is None:
            return Route(key) if key in captured else self.admit(key, captured, pool_bytes, None, unreplayed)
        size = key[self.pad_position]
        rows = rule.row_limit(key) if rule.padding and rule.row_limit is not None else None
        bucket = self.bucket(size, rows, rule)
        if bucket is None:
            if size > self.sizes[-1]:
                return Route(
                    None, size, miss=Miss.ABOVE_MAX, detail=f"size {size} > largest capture size {self.sizes[-1]}"
                )
            # reached only with padding=False: a graph whose padding the proof refused has exact sizes
            return Route(None, size, miss=Miss.NOT_A_CAPTURE_SIZE, detail=f"size {size}: padding=False in options")
        bucket_key = self.with_size(key, bucket)
        if bucket_key in captured:
            return Route(bucket_key, size, padded=bucket != size)
        ride = self._ride(key, bucket, captured, rows, rule)
        if not self.lazy:
            if ride is not None:
                return Route(ride, size, padded=True)
            return Route(None, size, miss=Miss.NOT_CAPTURED, detail=f"no captured size >= {size}")
        if rule.deferral is None or ride is None:
            return self.admit(bucket_key, captured, pool_bytes, size, unreplayed)
        if not rule.deferral.due(bucket_key, bucket, ride[self.pad_position]):
            return Route(ride, size, padded=True, waiting=bucket_key)
        route = self.admit(bucket_key, captured, pool_bytes, size, unreplayed)
        if route.key is None:  # refused: the larger graph serves it, not an un-graphed run
            return dataclasses.replace(route, key=ride, padded=True)
        return route

    def ride(self, key: tuple, captured, full: bool = False) -> tuple | None:
        """The smallest captured key (among ``captured``) larger than ``key``'s bucket that its call may
        pad up into (its bucket is the one to capture); None where padding is refused or none is
        captured."""
        rule = self.full if full else self.pieces
        if self.pad_position is None or not rule.padding:
            return None
        rows = rule.row_limit(key) if rule.row_limit is not None else None
        bucket = self.bucket(key[self.pad_position], rows, rule)
        return None if bucket is None else self._ride(key, bucket, captured, rows, rule)

    def _ride(self, key: tuple, bucket: int, captured, rows: int | None, rule: SizeRule) -> tuple | None:
        """The smallest captured key larger than ``bucket`` that ``key`` may pad up to, or None."""
        if not rule.padding:
            return None
        for larger in self.sizes[bisect.bisect_right(self.sizes, bucket) :]:
            if rows is not None and larger > rows:
                return None
            larger_key = self.with_size(key, larger)
            if larger_key in captured:
                return larger_key
        return None

    def admit(
        self, key: tuple, captured: set, pool_bytes, size: int | None = None, unreplayed: set = frozenset()
    ) -> Route:
        """Route to capture ``key`` (for a caller's ``size``, default the key's own), budget allowing
        and unless too many shapes captured before were never replayed (:meth:`churn`)."""
        bucket = key[self.pad_position] if self.pad_position is not None else None
        size = bucket if size is None else size
        churn = self.churn(key, unreplayed)
        refusal = churn or self.budget.refusal(
            bucket, len(captured), pool_bytes() if self.budget.needs_pool_bytes else 0
        )
        refusal = agreed_refusal(
            self.agreement,
            refusal,
            "another rank of this graph's collective group is over its capture budget; "
            "every rank skips this size so their collectives stay paired",
        )
        if refusal:
            return Route(
                None, size, miss=Miss.NEVER_REPLAYED if churn else Miss.OVER_BUDGET, detail=refusal, wanted=key
            )
        return Route(key, size, padded=bucket != size, capture=True)

    def churn(self, key: tuple, unreplayed: set) -> str | None:
        """Why ``key`` is not captured when ``max_unreplayed_captures`` shapes captured lazily were
        never replayed: a size that changes at every call would capture a graph per call (each
        capture costs more than the eager run it replaces, and the pool grows). None otherwise."""
        if self.max_unreplayed is None or len(self._unbounded(unreplayed)) < self.max_unreplayed:
            return None
        keys = sorted(unreplayed | {key})
        varying = [
            f"{name} ({', '.join(str(k[i]) for k in keys[:4])}{', ...' if len(keys) > 4 else ''})"
            for i, name in enumerate(self.symbols)
            if len({k[i] for k in keys}) > 1
        ]
        return (
            f"{len(unreplayed)} shapes captured were never replayed, max_unreplayed_captures="
            f"{self.max_unreplayed}; the sizes that keep changing: {'; '.join(varying) or 'none named'}"
        )

    def _unbounded(self, unreplayed: set) -> set:
        """The keys that count towards :meth:`churn`: with padding, keys that differ only in the
        padded size count once (there are at most ``len(capture_sizes)`` of them: a serving
        engine's token counts, not a size that changes at every call)."""
        p = self.pad_position
        if not self.pieces.padding or p is None:
            return unreplayed
        return {k[:p] + k[p + 1 :] for k in unreplayed}
