"""Counters that tests assert on and people read: what was compiled, captured, replayed, and why not.

One :class:`GraphStats` per compiled Dynamo graph; :func:`process_stats` sums them all. Reasons are
strings you can print ("graphs need CUDA tensors; inputs are on cpu"), not booleans.
"""

from __future__ import annotations

import dataclasses
import weakref


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


@dataclasses.dataclass(eq=False)  # identity semantics: kept in a WeakSet
class GraphStats:
    """Stats of one compiled Dynamo graph."""

    num_pieces: int = 0
    num_compute_pieces: int = 0
    num_split_pieces: int = 0
    inductor_compiles: int = 0
    inductor_seconds: float = 0.0
    calls: int = 0
    graphs_disabled_reason: str | None = None  # why this graph never captures, if it never does
    pieces: dict = dataclasses.field(default_factory=dict)  # name -> PieceStats

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
    def captured_keys(self) -> set:
        return {k for p in self.pieces.values() for k in p.keys}

    def summary(self) -> str:
        lines = [
            f"pieces: {self.num_pieces} ({self.num_compute_pieces} compute, {self.num_split_pieces} split/eager); "
            f"Inductor compiles: {self.inductor_compiles} in {self.inductor_seconds:.1f} s; calls: {self.calls}",
            f"captures: {self.captures} for shape keys {sorted(self.captured_keys)}; replays: {self.replays}; "
            f"un-graphed runs: {self.ungraphed_runs}",
        ]
        if self.graphs_disabled_reason:
            lines.append(f"CUDA graphs off: {self.graphs_disabled_reason}")
        for p in self.pieces.values():
            for reason in p.failures:
                lines.append(f"{p.name}: {reason}")
        return "\n".join(lines)


_ALL: "weakref.WeakSet[GraphStats]" = weakref.WeakSet()


def register(stats: GraphStats) -> GraphStats:
    _ALL.add(stats)
    return stats


def process_stats() -> dict:
    """Totals over every live compiled graph in this process."""
    graphs = list(_ALL)
    return {
        "graphs": len(graphs),
        "inductor_compiles": sum(g.inductor_compiles for g in graphs),
        "captures": sum(g.captures for g in graphs),
        "replays": sum(g.replays for g in graphs),
        "ungraphed_runs": sum(g.ungraphed_runs for g in graphs),
    }
