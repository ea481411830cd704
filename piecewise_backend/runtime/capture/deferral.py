"""Lazy capture waits for a size to come back while a larger captured graph can serve it.

Why: a mixed step's token count is whatever the prefill chunks leave, so a serving run touches most
capture sizes, most of them a few times; captured at first call, each stalls its step for every
request in the batch. A padded replay of a larger captured graph stalls nothing; it costs the padded
rows' compute, little in a decode step (the weights are read once whatever the rows). The
measurement that decided it: ``benchmarks/README.md``, "Measurement history".

So a size whose padded bucket is not captured rides the smallest larger captured graph (padded,
within the rows the graph may pad to), and its bucket is captured once it has come often enough
to earn its stall:

* at its :data:`FAR_CALLS`-th call when the graph it rides is more than :data:`RIDE_RATIO` times
  its size (padding that costly is worth a capture soon);
* at its :data:`NEAR_CALLS`-th call otherwise (within 2x, a size earns its own graph only by being
  a steady share of the traffic).

A size that no captured graph can serve is captured at its first call, as before. Calls are
counted per bucket over the graph's life: the same sequence of shape keys gives the same captures
on every rank (and every capture is agreed across ranks anyway, ``distributed.agreed_refusal``).
"""

from __future__ import annotations

import collections

RIDE_RATIO = 2  # a ride more than this many times the size's bucket is "far"
FAR_CALLS = 4  # calls before a bucket that rides a far larger graph is captured
NEAR_CALLS = 64  # calls before a bucket that rides a graph within RIDE_RATIO is captured


class CaptureDeferral:
    """Calls per bucket served by a larger captured graph, and when each bucket is due its own."""

    def __init__(self):
        self.calls: collections.Counter = collections.Counter()

    def due(self, bucket_key: tuple, bucket: int, ride: int) -> bool:
        """Count a call of ``bucket_key`` (batch size ``bucket``) that could ride a graph of size
        ``ride``; True when this call should capture the bucket instead."""
        self.calls[bucket_key] += 1
        needed = FAR_CALLS if ride > RIDE_RATIO * bucket else NEAR_CALLS
        return self.calls[bucket_key] >= needed
