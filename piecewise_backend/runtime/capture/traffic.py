"""Capture follows traffic: under ``max_captured_sizes``, a size that keeps coming replaces the least
used captured one, instead of running un-graphed for the rest of the process.

Why: with a cap on captured sizes, the first sizes seen would keep their graphs for good. A serving
process runs for days, and the batch sizes of its first minutes (start-up, a burst of long prompts)
are not those of its afternoon. No peer does this (PyTorch turned down re-recording as too complex,
pytorch#188913); here it is a counter per shape key and one rule.

The rule, deterministic so that ranks calling in lockstep decide alike (and the decision is agreed
across ranks anyway, ``distributed.agreed_refusal``):

* calls are counted per shape key (after padding) over the last :data:`WINDOW` calls; only graphs
  with a cap on captured sizes count them, so no other graph pays for it;
* a key refused by the cap replaces the captured key with the fewest calls in the window once it
  has had :data:`MIN_CALLS` calls there *and* more than :data:`MARGIN` times that key's calls. The
  margin keeps two sizes that come equally often from taking each other's place at every call (each
  swap costs a capture).

The replaced key's graphs are released (their memory goes back to the shared graph pool, which is
why a cap on graph *memory* is not served by replacing: the pool does not shrink); it is captured
again if it comes back often enough.
"""

from __future__ import annotations

import collections

from ...kinds import Miss

WINDOW = 512  # calls over which traffic is counted
MIN_CALLS = 16  # calls in the window before a refused key may replace a captured one
MARGIN = 2  # ... and it must have had more than MARGIN times the replaced key's calls


class CaptureTraffic:
    """Calls per shape key over the last :data:`WINDOW` calls of one compiled graph."""

    def __init__(self, window: int = WINDOW):
        self._recent: collections.deque = collections.deque(maxlen=window)
        self._counts: collections.Counter = collections.Counter()

    def saw(self, key: tuple) -> None:
        recent = self._recent
        if len(recent) == recent.maxlen:
            old = recent[0]
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]
        recent.append(key)
        self._counts[key] += 1

    def calls(self, key: tuple) -> int:
        return self._counts.get(key, 0)

    def victim(self, wanted: tuple, captured: set) -> tuple | None:
        """The captured key that ``wanted`` replaces now, or None (see the module docstring)."""
        calls = self.calls(wanted)
        if calls < MIN_CALLS or not captured:
            return None
        least = min(captured, key=lambda k: (self.calls(k), k))
        return least if calls > MARGIN * self.calls(least) else None

    def replacement(self, route, captured: set, policy, pool_bytes) -> tuple[bool, tuple | None]:
        """Count a call's ``route``. Returns (decide, victim): ``decide`` when this call is one where a
        replacement is considered (the same calls on every rank in lockstep), ``victim`` the captured
        key that the refused key replaces, or None. Only a refusal by the count cap is served: if the
        memory cap would refuse the key anyway, nothing is replaced (a released graph does not shrink
        the shared pool)."""
        # the size's own key: the one refused, or waiting while a larger graph serves it, or the one replayed
        wanted = next((k for k in (route.wanted, route.waiting, route.key) if k is not None), None)
        if wanted is None:
            return False, None
        self.saw(wanted)
        if route.miss != Miss.OVER_BUDGET or self.calls(wanted) < MIN_CALLS:
            return False, None
        victim = self.victim(wanted, captured)
        budget = policy.budget
        size = wanted[policy.pad_position] if policy.pad_position is not None else None
        if victim is not None and budget.needs_pool_bytes and budget.refusal(size, len(captured) - 1, pool_bytes()):
            victim = None
        return True, victim

    def describe(self, wanted: tuple, victim: tuple) -> str:
        return f"{self.calls(wanted)} against {self.calls(victim)} of the last {self._recent.maxlen} calls"
