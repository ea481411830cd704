"""Lazy capture waits for a size to come back while a larger captured graph can serve it.

Why, measured (``benchmarks/serving.py``, H200, Qwen2.5-1.5B's dimensions, 200 requests under
continuous batching, 616 steps): a mixed step's token count is whatever the prefill chunks leave,
so the steps touched 58 of the 67 capture sizes, 45 of them at most 3 times. Captured at their
first call, each stalled its step by 60-90 ms for every request in the batch: the run's
inter-token p99 was 70-78 ms against 14 ms with every size captured up front. A padded replay of
a larger captured graph stalls nothing; it costs the padded rows' compute, little in a decode step
(the weights are read once whatever the rows). The serving rows say what it came to (``rides``).

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
