"""Counters that tests assert on and people read: what was compiled, captured, replayed, and why not.

One :class:`GraphStats` per compiled Dynamo graph, kept by run time as it goes;
``observe/reports.py``'s ``process_stats`` sums them all. Reasons are
strings you can print ("graphs need CUDA tensors; inputs are on cpu"), not booleans.
:meth:`GraphStats.rows` and ``capture_table`` give one row per captured size, for a notebook
(``pandas.DataFrame(rows)``) or a plain table (:meth:`GraphStats.table`).
"""

from __future__ import annotations

import collections
import dataclasses

from ..kinds import CaptureHow, GraphMode


@dataclasses.dataclass
class PieceStats:
    name: str
    captures: int = 0  # CUDA graphs captured (one per new shape key)
    replays: int = 0  # graph replays
    ungraphed_runs: int = 0  # compiled but not graphed (no CUDA, graphs off, capture failed, ...)
    capture_seconds: float = 0.0
    input_copies: int = 0  # inputs copied into captured buffers at replay (address changed)
    keys: list = dataclasses.field(default_factory=list)  # shape keys captured, in order
    failures: list = dataclasses.field(default_factory=list)  # reasons a capture failed


@dataclasses.dataclass(frozen=True)
class CaptureEvent:
    """One size captured across all pieces of a graph."""

    key: tuple  # the shape key (batch size as captured, after padding)
    how: CaptureHow  # lazy (first sight in a call) or up-front (eager_capture_sizes / capture())
    seconds: float  # wall time of the capturing step (warm-up, capture and replay of every piece)
    pool_bytes: int  # graph memory after it: the pool (the CUDA allocator's count) and the input buffers
    pool_growth: int  # bytes the pool grew by
    pieces: int  # pieces captured (pieces whose capture failed run un-graphed at this key)
    call: int  # the graph's call count when it happened (eager captures of the first call: 1)
    mode: GraphMode = GraphMode.PIECEWISE  # full: the whole call captured as one graph


@dataclasses.dataclass(eq=False)  # identity semantics
class GraphStats:
    """Stats of one compiled Dynamo graph."""

    serial: int = 0  # the CompiledGraph's serial number
    num_pieces: int = 0
    num_compute_pieces: int = 0
    num_split_pieces: int = 0
    inductor_compiles: int = 0
    inductor_seconds: float = 0.0
    build_seconds: float = 0.0  # the whole backend call (split, fake run, Inductor, runners)
    loaded: bool = False  # built from a saved artifact (``persist/``): no trace, no compile
    code_switches: int = 0  # switches to code compiled behind (``compiler="eager_then_inductor"``)
    switched_at: float | None = None  # ``time.perf_counter()`` of the last switch
    behind_timeline: dict | None = None  # the last switch's compile behind: its steps' ``time.time()``
    calls: int = 0
    graphs_disabled_reason: str | None = None  # why this graph never captures, if it never does
    padding: str = ""  # what is padded, or why nothing is
    unsafe_ops: tuple = ()  # ops split at because they are tagged torch.Tag.cudagraph_unsafe (not named)
    eager_sdpa: str = ""  # which SDPA kernels eager attention may use, and why (empty: torch's choice)
    attention: dict = dataclasses.field(default_factory=dict)  # how attention runs -> how many calls
    weight_sets: int = 0  # sets of parameter addresses seen with graphs (more than 1: weights moved)
    weight_sets_replaced: int = 0  # of those, dropped past max_weight_sets for a newer one
    replaced_keys: list = dataclasses.field(default_factory=list)  # captured keys released for busier ones
    rides: int = 0  # calls that replayed a larger captured graph, their own size waiting or refused
    request_path_capture_seconds: float = 0.0  # capturing inside callers' calls (inline captures)
    exact_sizes: str = ""  # why each batch size gets graphs of its own (padding refused), once met
    full_padding: str = ""  # what full graphs pad, or why nothing is (naming the op)
    full_refusal: str | None = None  # why no call is captured whole, if none is
    graph_calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # (mode, size) -> calls
    #   served by graphs of that kind and captured size (replays, and the calls that captured them)
    full_failures: list = dataclasses.field(default_factory=list)  # reasons a full capture failed
    full_fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # calls under
    #   cudagraph_mode("full") that ran piecewise, by reason
    pieces: dict = dataclasses.field(default_factory=dict)  # name -> PieceStats
    events: list = dataclasses.field(default_factory=list)  # CaptureEvent, in order
    batch_sizes: collections.Counter = dataclasses.field(
        default_factory=collections.Counter
    )  # calls per caller batch size
    misses: collections.Counter = dataclasses.field(
        default_factory=collections.Counter
    )  # calls run un-graphed, by reason
    miss_details: dict = dataclasses.field(default_factory=dict)  # reason -> the last full message

    @classmethod
    def of_plan(cls, plan) -> GraphStats:
        """A compiled graph's counters at its start: what its plan says of its pieces."""
        compute = len(plan.pieces)
        return cls(
            num_pieces=len(plan.piece_specs),
            num_compute_pieces=compute,
            num_split_pieces=len(plan.piece_specs) - compute,
            inductor_compiles=plan.report.inductor_compiles,
            inductor_seconds=plan.report.inductor_seconds,
            graphs_disabled_reason=plan.graphs_disabled_reason,
            padding=plan.padding.note,
            unsafe_ops=plan.unsafe_ops,
            full_padding=plan.full.padding_note,
            full_refusal=plan.full.refusal,
            eager_sdpa=plan.sdpa_choice.reason if plan.sdpa_choice is not None else "",
            attention=dict(collections.Counter(how for _, how in plan.report.attention)),
        )

    @property
    def captures(self) -> int:
        return sum(p.captures for p in self.pieces.values())

    @property
    def replays(self) -> int:
        return sum(p.replays for p in self.pieces.values())

    @property
    def ungraphed_runs(self) -> int:
        return sum(p.ungraphed_runs for p in self.pieces.values())

    @property
    def full_replays(self) -> int:
        """Calls served by a full graph (the whole call, one CUDA graph), capturing calls included."""
        return sum(n for (mode, _), n in self.graph_calls.items() if mode == GraphMode.FULL)

    @property
    def piecewise_replays(self) -> int:
        """Calls served by piecewise graphs (compute pieces replayed, splitting ops eager)."""
        return sum(n for (mode, _), n in self.graph_calls.items() if mode == GraphMode.PIECEWISE)

    @property
    def full_keys(self) -> list:
        """Shape keys captured as full graphs, in order (a key released and captured again: twice)."""
        return [e.key for e in self.events if e.mode == GraphMode.FULL]

    @property
    def full_captures(self) -> int:
        return len(self.full_keys)

    @property
    def captures_behind(self) -> int:
        """Sizes captured by the capture thread, behind the calls (``capture_behind``)."""
        return sum(1 for e in self.events if e.how == CaptureHow.BEHIND)

    @property
    def capture_seconds(self) -> float:
        return sum(e.seconds for e in self.events)

    @property
    def pool_bytes(self) -> int:
        """Graph pool bytes after this graph's last capture (0 before any)."""
        return self.events[-1].pool_bytes if self.events else 0

    @property
    def captured_keys(self) -> set:
        return {k for p in self.pieces.values() for k in p.keys}

    @property
    def failed_captures(self) -> int:
        return sum(len(p.failures) for p in self.pieces.values())

    def rows(self) -> list[dict]:
        """One dict per captured size: key, how, seconds, pool MiB, growth MiB, pieces."""
        return [
            {
                "key": e.key,
                "mode": e.mode,
                "how": e.how,
                "capture_ms": round(e.seconds * 1e3, 1),
                "pool_mib": round(e.pool_bytes / 2**20, 1),
                "growth_mib": round(e.pool_growth / 2**20, 1),
                "pieces": e.pieces,
                "call": e.call,
            }
            for e in self.events
        ]

    def table(self) -> str:
        """:meth:`rows` as a fixed-width text table."""
        return format_table(self.rows())

    def summary(self) -> str:
        lines = [
            f"pieces: {self.num_pieces} ({self.num_compute_pieces} compute, {self.num_split_pieces} split/eager); "
            f"Inductor compiles: {self.inductor_compiles} in {self.inductor_seconds:.1f} s; calls: {self.calls}"
        ]
        if self.graphs_disabled_reason:  # no capture line of zeros: say why, once, and what ran
            lines.append(
                f"CUDA graphs off: {self.graphs_disabled_reason}; pieces run compiled, un-graphed "
                f"(piece runs: {self.ungraphed_runs})"
            )
        else:
            lines.append(
                f"captures: {self.captures} piece graphs for shape keys {sorted(self.captured_keys)} in "
                f"{self.capture_seconds:.2f} s; graph pool {self.pool_bytes / 2**20:.1f} MiB; piece replays: "
                f"{self.replays}; un-graphed piece runs: {self.ungraphed_runs}"
            )
        if self.full_replays or self.full_fallbacks or self.full_failures:
            lines.append(self._full_summary())
        # without graphs nothing is padded: every batch runs at its own size
        if self.padding and not self.graphs_disabled_reason:
            lines.append(f"padding: {self.padding}")
        if self.weight_sets > 1:
            replaced = f" ({self.weight_sets_replaced} replaced by newer ones)" if self.weight_sets_replaced else ""
            lines.append(f"parameters moved: graphs for {self.weight_sets} sets of parameter addresses{replaced}")
        if self.replaced_keys:
            lines.append(
                f"captured sizes replaced by busier ones (max_captured_sizes): {len(self.replaced_keys)} "
                f"({', '.join(map(str, self.replaced_keys[:6]))}{', ...' if len(self.replaced_keys) > 6 else ''})"
            )
        if self.exact_sizes:
            lines.append(f"captured per exact batch size: {self.exact_sizes}")
        if self.captures_behind or self.request_path_capture_seconds:
            lines.append(
                f"captures behind the calls: {self.captures_behind}; seconds callers spent capturing: "
                f"{self.request_path_capture_seconds:.2f}"
            )
        if self.rides:
            lines.append(
                f"calls that replayed a larger captured graph, padded, while their own size waited "
                f"(defer_captures) or was refused: {self.rides}"
            )
        if self.unsafe_ops:
            lines.append(f"split at ops tagged cudagraph_unsafe: {', '.join(self.unsafe_ops)}")
        if self.attention:
            lines.append("attention: " + "; ".join(self.attention_ways()))
        if self.eager_sdpa:
            lines.append(f"eager attention: {self.eager_sdpa}")
        for reason, count in self.misses.items():
            lines.append(f"un-graphed calls, {reason}: {count} ({self.miss_details.get(reason, reason)})")
        for p in self.pieces.values():
            for reason in p.failures:
                lines.append(f"{p.name}: {reason}")
        return "\n".join(lines)

    def attention_ways(self) -> list[str]:
        """``"N × how"`` per way attention runs here; graphs off, plain "eager" (the reason is said
        once, where graphs being off is)."""
        off = f"eager: {self.graphs_disabled_reason}"
        return [f"{n} × {'eager' if how == off else how}" for how, n in self.attention.items()]

    def _full_summary(self) -> str:
        sizes = sorted((size, n) for (mode, size), n in self.graph_calls.items() if mode == GraphMode.FULL)
        line = (
            f"full graphs: {self.full_replays} calls at sizes {dict(sizes)} (captured {sorted(self.full_keys)}); "
            f"piecewise: {self.piecewise_replays} calls; full padding: {self.full_padding}"
        )
        for reason, count in self.full_fallbacks.items():
            line += f"\ncalls under cudagraph_mode('full') run piecewise, {reason}: {count}"
        return "\n".join([line, *self.full_failures])


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(no captures)"
    cols = list(rows[0])
    cells = [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*cols)] + [fmt.format(*row) for row in cells])
