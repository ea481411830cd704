"""Graph memory known before the KV cache is sized: what a list of sizes needs, from two captures.

Graph memory is the graph pool (every graph of a device captures into one) and the buffers the
captures copy their inputs into (``buffers.InputArenas``: one per input, shared by all sizes).
Why it can be predicted from the largest size: a captured step's temporaries are free once the
step ends (outputs are kept as non-owning aliases), so the next capture reuses them, and a smaller
size fits in what a larger one freed; the input buffers of every size are the first rows of the
largest's. Fits, once: the first size just below the largest re-lays the pool. Its temporaries are
each a little smaller than the largest's, the allocator's best fit hands some of them blocks that
other temporaries of its step then miss, and one of those (a large one) takes a new segment; after
that, every smaller size fits in what the pool holds. So once the largest and the size next below
it are captured (largest first, as ``capture()`` goes), the others add next to nothing (measured
per size: ``benchmarks/README.md``, "History").

Two estimates before this one missed on the serving engine by a quarter: the first took the growth
of one size captured after the largest for bytes every size keeps (sizes keep none); the second
measured the largest and the smallest, and the smallest's requests fit in the largest's blocks by
splitting them, so it never saw the re-layout. What does make a pool larger is order: a capture
larger than every free block takes a new segment, and what the smaller sizes before it freed stays
reserved in the pool, so sizes captured in growing order (lazily, as traffic grows) can hold more
than the largest alone. The estimate is for sizes captured as ``capture()`` captures them.

So :func:`estimate` captures the largest and then the next size below it of the sizes asked about
(those not captured yet) and reads graph memory after each. For lists whose largest size is
smaller, memory is a line in the largest size: through the next size alone when it came first,
else through what the device held before the first capture. The captures are real and stay (the
sizes are then served). The estimate answers for any list (``for_sizes``) and a budget (``largest_size_within``).

Vendors' estimates miss by 3x in both directions (vLLM #45178, #51590) because they sum per-size
costs that the pool shares, or profile without the capture's own allocations; this one is the
allocator's own count, measured, for this model on this device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class GraphMemoryEstimate:
    """Graph memory once sizes are captured.

    Attributes:
        sizes: the sizes it was asked about.
        measured: ((size, graph memory after capturing it), ...), the points it rests on, in capture order.
        fixed_bytes, bytes_per_row: the line in a list's largest size.
    """

    sizes: tuple
    measured: tuple
    fixed_bytes: float
    bytes_per_row: float

    @property
    def predicted_bytes(self) -> int:
        """Graph memory once all of ``sizes`` are captured."""
        return self.for_sizes(self.sizes)

    def for_sizes(self, sizes: Iterable[int]) -> int:
        """Graph memory once ``sizes`` are captured (largest first): the line at the largest."""
        return int(max(0.0, self.fixed_bytes + self.bytes_per_row * max(sizes)))

    def largest_size_within(self, budget_bytes: int, capture_sizes: Iterable[int]) -> int | None:
        """The largest of ``capture_sizes`` such that it and every smaller one fit ``budget_bytes``
        (None: not even the smallest)."""
        fitting = [s for s in set(capture_sizes) if self.for_sizes([s]) <= budget_bytes]
        return max(fitting) if fitting else None

    def __str__(self) -> str:
        points = ", ".join(f"{s}: {b / 2**20:.1f} MiB" for s, b in self.measured)
        return (
            f"graph memory for {len(set(self.sizes))} sizes up to {max(self.sizes)}: "
            f"{self.predicted_bytes / 2**20:.1f} MiB (measured after capturing {points}; "
            f"{self.fixed_bytes / 2**20:.1f} MiB + {self.bytes_per_row / 2**10:.1f} KiB per row of the largest)"
        )


def fit(points: list[tuple[int, int]]) -> tuple[float, float]:
    """(fixed, per_row) of the line through two (size, bytes) points; flat for one."""
    (s1, b1), (s2, b2) = points[0], points[-1]
    if s1 == s2:
        return float(b2), 0.0
    per_row = max(0.0, (b2 - b1) / (s2 - s1))
    return b2 - per_row * s2, per_row


def _largest_two(sizes) -> tuple[int, int]:
    """The largest size and the one next below it (the largest again for a list of one size)."""
    ordered = sorted(set(sizes))
    return ordered[-1], ordered[-2] if len(ordered) > 1 else ordered[-1]


def from_events(sizes: tuple, events: list, position: int) -> GraphMemoryEstimate:
    """The estimate from a graph's capture events of ``sizes`` (``stats.events``, in capture order;
    their ``pool_bytes`` is graph memory after each): what the graph held once the largest and the
    size next below it were both captured, and the line to it from that size alone (when it came
    first) or from before the first capture."""
    first = {}  # size -> its first capture event, in capture order
    for event in events:
        first.setdefault(event.key[position], event)
    order = list(first)
    largest, below = _largest_two(sizes)
    both = first[order[max(order.index(below), order.index(largest))]].pool_bytes
    if order.index(below) < order.index(largest):  # the size below alone, then the largest
        start = (below, first[below].pool_bytes)
    else:  # the largest first: the line starts at what the device held before
        start = (0, first[order[0]].pool_bytes - first[order[0]].pool_growth)
    fixed, per_row = fit([start, (largest, both)])
    measured = tuple((s, first[s].pool_bytes) for s in order)
    return GraphMemoryEstimate(tuple(sorted(sizes)), measured, fixed, per_row)


def estimate(graph, sizes: Iterable[int] | str = "all") -> GraphMemoryEstimate:
    """Capture the largest of ``sizes`` and the size next below it (those not captured yet) on
    ``graph`` and predict the graph memory of all of them (see the module docstring)."""
    if graph.device.type != "cuda":
        raise ValueError(
            f"piecewise: graph {graph.serial} runs on {graph.device}: graph memory is measured from "
            f"the CUDA allocator's pool; estimate on the GPU the model will serve on."
        )
    keys = graph.up_front.keys_of(sizes)  # checked, largest first
    if not keys:
        raise ValueError(f"piecewise: no capture size of graph {graph.serial} among {sizes!r}.")
    position = graph.pad_position
    for key in keys[:2]:  # the largest, then the size next below it
        if key not in graph.captured and not graph.capture([key[position]]):
            raise RuntimeError(
                f"piecewise: graph {graph.serial} did not capture size {key[position]} (see its "
                f"warnings and stats.summary()); nothing to measure."
            )
    asked = set(keys)
    return from_events(tuple(k[position] for k in keys), [e for e in graph.stats.events if e.key in asked], position)
