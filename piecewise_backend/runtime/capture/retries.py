"""A shape key whose capture failed is captured again later, twice at most, then left un-graphed.

Some failures pass: a capture that another process-wide event broke, memory that was short for a
moment. Others never do: an op that syncs with the host inside a compute piece fails every capture
(a custom attention op missing from ``extra_splitting_ops``). Each failed attempt costs a warm-up and
a capture, and retires the graph pool it was capturing into (``devices.DeviceGraphs.recover``), so
retries are few and spaced: after ``WAITS[0]`` more calls at that key, then ``WAITS[1]``; then the
key runs un-graphed for good (its pieces that did capture keep replaying meanwhile).

A retry re-captures the key's whole step, every piece in order, never one piece amid replays: a
replayed piece's outputs live in pool memory that the pool counts as free (outputs are kept as
non-owning aliases), so a lone capture could allocate over them (see ``piece_runner``'s step
protocol). The counting is deterministic, so ranks that call in lockstep retry at the same call.
"""

from __future__ import annotations

WAITS = (8, 64)  # calls at a failed key before the first retry, and before the second


class CaptureRetries:
    """Failed shape keys of one weight set: key -> [failures so far, calls left before the next try]."""

    def __init__(self):
        self._keys: dict = {}
        self.pending = 0  # keys that will be tried again (per-call check: skipped while 0)

    def failed(self, key) -> bool:
        """Count a failed capture of ``key``; True if it will be tried again."""
        entry = self._keys.get(key)
        failures = entry[0] + 1 if entry else 1
        if entry is not None and entry[1] is not None:
            self.pending -= 1
        wait = WAITS[failures - 1] if failures <= len(WAITS) else None
        self._keys[key] = [failures, wait]
        self.pending += wait is not None
        return wait is not None

    def succeeded(self, key) -> None:
        entry = self._keys.pop(key, None)
        if entry is not None and entry[1] is not None:
            self.pending -= 1

    def due(self, key) -> bool:
        """One more call at ``key``: is it time to capture it again?"""
        entry = self._keys.get(key)
        if entry is None or entry[1] is None:
            return False
        entry[1] -= 1
        return entry[1] <= 0

    def failures(self, key) -> int:
        entry = self._keys.get(key)
        return entry[0] if entry else 0
