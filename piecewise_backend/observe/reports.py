"""The whole process's counters: every live compiled graph's :class:`GraphStats`, summed or tabled."""

from __future__ import annotations

import collections

from ..registry import compiled_graphs
from ..runtime.devices import pool_bytes
from ..runtime.stats import GraphStats, format_table


def capture_table() -> str:
    """Every live graph's captures as one text table (a notebook can ``print`` it)."""
    rows = [{"graph": g.serial, **row} for g in _all_stats() for row in g.rows()]
    return format_table(rows)


def process_stats() -> dict:
    """Totals over every live compiled graph in this process (pool bytes: the shared pool, now)."""
    graphs = _all_stats()
    misses: collections.Counter = collections.Counter()
    for g in graphs:
        misses.update(g.misses)
    return {
        "graphs": len(graphs),
        "inductor_compiles": sum(g.inductor_compiles for g in graphs),
        "inductor_seconds": sum(g.inductor_seconds for g in graphs),
        "captures": sum(g.captures for g in graphs),
        "captured_sizes": sum(len(g.events) for g in graphs),
        "capture_seconds": sum(g.capture_seconds for g in graphs),
        "replays": sum(g.replays for g in graphs),
        "full_replays": sum(g.full_replays for g in graphs),  # calls served by a full graph
        "piecewise_replays": sum(g.piecewise_replays for g in graphs),  # calls served by piecewise graphs
        "ungraphed_runs": sum(g.ungraphed_runs for g in graphs),
        "rides": sum(g.rides for g in graphs),
        "misses": {str(reason): count for reason, count in misses.items()},
        "pool_bytes": pool_bytes(),
    }


def _all_stats() -> list[GraphStats]:
    return [g.stats for g in compiled_graphs()]
