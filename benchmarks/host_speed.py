"""The host's speed, read beside every timed run: the H200 machine's CPU runs at two speeds ~3×
apart, switching every few seconds (``timing.host_probe_us``).

:func:`settled_probe` probes before a timed run (waiting for full speed where allowed);
:func:`fast_host_times` keeps, per row, the rounds timed at full speed.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.timing import host_probe_us

# a round met the host at full speed when its probe took at most this times the fastest probe
# (the process's, or its rows' own: ``fast_host_times``; the slow spells are ~3×: ``timing.host_probe_us``)
FAST_HOST = 1.3


FASTEST_PROBE = [float("inf")]  # the fastest host probe of this process, µs


def probe() -> float:
    """One host probe (µs), remembered if it is the fastest so far."""
    microseconds = host_probe_us()
    FASTEST_PROBE[0] = min(FASTEST_PROBE[0], microseconds)
    return microseconds


def settled_probe(wait_s: float) -> float:
    """A host probe (µs); with ``wait_s`` > 0, probed again every 50 ms while the host runs slower
    than ``FAST_HOST`` times the fastest probe so far, for up to ``wait_s`` seconds (``--settle``):
    a timed run then starts, where it can, on a host at full speed."""
    deadline = time.perf_counter() + wait_s
    while True:
        microseconds = probe()
        if microseconds <= FAST_HOST * FASTEST_PROBE[0] or time.perf_counter() >= deadline:
            return microseconds
        time.sleep(0.05)


def fast_host_times(rows: list[dict], fastest: float = float("inf")) -> None:
    """Add to each interleaved row the median of the rounds timed while the host ran at full speed:
    ``step_ms_fast_host`` over ``fast_host_rounds`` of its rounds (None when none was).

    "Full speed" is relative to the fastest probe: ``fastest`` (the process's) or the rows' own,
    whichever is less. A round is fast when the probes just before and after it took at most
    ``FAST_HOST`` times that. ``step_ms`` (every round) stays the row's main figure; this one says
    what the backend costs on the host the machine has when it is not slowed, the reading a
    quieter machine would give.
    """
    probes = [p for r in rows if "error" not in r for p in r.get("host_probe_us_rounds") or ()]
    if not probes:
        return
    fastest = min(fastest, *probes)
    for row in rows:
        times = row.get("step_ms_rounds")
        if not times or "error" in row:
            continue
        fast = [t for t, p in zip(times, row["host_probe_us_rounds"]) if p <= FAST_HOST * fastest]
        row["fast_host_rounds"] = len(fast)
        row["step_ms_fast_host"] = round(statistics.median(fast), 4) if fast else None
        row["host_probe_fastest_us"] = round(fastest, 2)
