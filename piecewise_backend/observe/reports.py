"""The whole process's counters: every live compiled graph's :class:`GraphStats`, summed or tabled."""

from __future__ import annotations

import collections

from ..registry import compiled_graphs
from ..runtime.compile_clock import request_path_compile_seconds
from ..runtime.devices import pool_bytes
from ..runtime.stats import GraphStats, format_table


def capture_table() -> str:
    """Every live graph's captures as one text table (a notebook can ``print`` it)."""
    rows = [{"graph": g.serial, **row} for g in _all_stats() for row in g.rows()]
    return format_table(rows)


def process_stats() -> dict:
    """Totals over every live compiled graph in this process (pool bytes: the shared pool, now).

    ``request_path_capture_s``: seconds callers' calls spent capturing (inline captures; captures
    behind the calls are ``captures_behind``); ``request_path_compile_s``: seconds callers' threads
    spent compiling since the first compile (Dynamo's compiles and Triton's JIT compiles there; the
    capture thread's and compile workers' are not a caller's). Read them before and after a phase
    (after ``warm_up``, say) for what that phase cost its callers."""
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
        "captures_behind": sum(g.captures_behind for g in graphs),
        "exact_size_graphs": sum(1 for g in graphs if g.exact_sizes),
        "request_path_capture_s": sum(g.request_path_capture_seconds for g in graphs),
        "request_path_compile_s": request_path_compile_seconds(),
        "misses": {str(reason): count for reason, count in misses.items()},
        "pool_bytes": pool_bytes(),
    }


def explain() -> str:
    """What every live compiled graph did and why, one block each (its ``stats.summary()``): pieces,
    captures (in calls or behind them), padding or why each size is captured exactly, misses and
    their reasons, failed captures."""
    return "\n\n".join(f"graph {g.serial}:\n{g.summary()}" for g in _all_stats()) or "no compiled graph yet"


def _all_stats() -> list[GraphStats]:
    return [g.stats for g in compiled_graphs()]
