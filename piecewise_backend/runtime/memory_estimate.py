"""Graph memory known before the KV cache is sized: the pool a list of sizes needs, from three captures.

Why it can be predicted: every graph of a device captures into one pool, and a captured step's
temporaries are free once the step ends (outputs are kept as non-owning aliases), so the next
capture reuses them. Two parts make the pool of a list of sizes:

* what the largest needs while it runs: activations that grow with its rows on top of a fixed
  part (workspaces, the keeper): a line through the pool after the smallest alone and after the
  largest (16-layer Llama on the H200: 67 sizes held about the bytes of size 512 alone);
* what each further size keeps of its own once captured, whatever it reuses: measured as the
  growth of one size captured after the largest. On the serving engine (28 layers, 29 pieces
  per size) it was ~0.4 MiB a size: 98 MiB for 67 sizes where the line alone said 72 MiB
  (``"graph_memory_estimate"``, code hash ``bbf21f8e``, before this term).

So :func:`estimate` captures the smallest, the largest and then one more size of those asked about
(the smallest not yet captured), reading the pool after each. Sizes captured before keep their
order: a smallest captured after the largest gives no "alone" point (the line is then flat at the
largest's bytes, an over-estimate for lists without it). The captures are real and stay (the
sizes are then served). The estimate answers for any list (``for_sizes``) and a budget
(``largest_size_within``).

Vendors' estimates miss by 3x in both directions (vLLM #45178, #51590) because they sum per-size
costs that the pool shares, or profile without the capture's own allocations; this one is the
allocator's own count of the pool, measured, for this model on this device.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class GraphMemoryEstimate:
    """What the graph pool holds once sizes are captured.

    Attributes:
        sizes: the sizes it was asked about.
        measured: ((size, pool bytes after capturing it), ...), the points it rests on, in capture order.
        fixed_bytes, bytes_per_row: the line of what the largest size of a list needs.
        per_size_bytes: what each further size keeps of its own.
    """

    sizes: tuple
    measured: tuple
    fixed_bytes: float
    bytes_per_row: float
    per_size_bytes: float = 0.0

    @property
    def predicted_bytes(self) -> int:
        """The pool once all of ``sizes`` are captured."""
        return self.for_sizes(self.sizes)

    def for_sizes(self, sizes: Iterable[int]) -> int:
        """The pool once ``sizes`` are captured: the line at the largest, and each other size's own bytes."""
        distinct = set(sizes)
        line = self.fixed_bytes + self.bytes_per_row * max(distinct)
        return int(max(0.0, line + self.per_size_bytes * (len(distinct) - 1)))

    def largest_size_within(self, budget_bytes: int, capture_sizes: Iterable[int]) -> int | None:
        """The largest of ``capture_sizes`` such that it and every smaller one fit ``budget_bytes``
        (None: not even the smallest)."""
        ordered = sorted(set(capture_sizes))
        fitting = [s for i, s in enumerate(ordered) if self.for_sizes(ordered[:i + 1]) <= budget_bytes]
        return max(fitting) if fitting else None

    def __str__(self) -> str:
        points = ", ".join(f"{s}: {b / 2**20:.1f} MiB" for s, b in self.measured)
        return (f"graph pool for {len(set(self.sizes))} sizes up to {max(self.sizes)}: "
                f"{self.predicted_bytes / 2**20:.1f} MiB (measured {points}; {self.fixed_bytes / 2**20:.1f} MiB + "
                f"{self.bytes_per_row / 2**10:.1f} KiB per row of the largest, {self.per_size_bytes / 2**10:.1f} "
                f"KiB per further size)")


def fit(points: list[tuple[int, int]]) -> tuple[float, float]:
    """(fixed, per_row) of the line through two (size, bytes) points; through the origin for one."""
    (s1, b1), (s2, b2) = points[0], points[-1]
    if s1 == s2:
        return 0.0, b2 / s2
    per_row = max(0.0, (b2 - b1) / (s2 - s1))
    return b1 - per_row * s1, per_row


def from_events(sizes: tuple, events: list, position: int) -> GraphMemoryEstimate:
    """The estimate from a graph's capture events of ``sizes`` (``stats.events``, in capture order):
    the line through the smallest alone (when it came first) and the largest, and the mean growth
    of the sizes captured after the largest as each further size's own bytes."""
    first = {}  # size -> its first capture event, in capture order
    for event in events:
        first.setdefault(event.key[position], event)
    order = list(first)
    smallest, largest = min(sizes), max(sizes)
    after = [first[s].pool_growth for s in order[order.index(largest) + 1:]]
    per_size = sum(after) / len(after) if after else 0.0
    largest_alone = first[largest].pool_bytes - per_size * order.index(largest)  # less the sizes before it
    if smallest != largest and order[0] == smallest:  # captured first: the pool as it was, plus it alone
        fixed, per_row = fit([(smallest, first[smallest].pool_bytes), (largest, largest_alone)])
    else:  # no smaller size alone: what the largest needs, for every list
        fixed, per_row = largest_alone, 0.0
    measured = tuple((s, first[s].pool_bytes) for s in order)
    return GraphMemoryEstimate(tuple(sorted(sizes)), measured, fixed, per_row, per_size)


def estimate(graph, sizes: Iterable[int] | str = "all") -> GraphMemoryEstimate:
    """Capture the smallest, the largest and one more of ``sizes`` (those not captured yet) on
    ``graph`` and predict the pool of all of them (see the module docstring)."""
    if graph.device.type != "cuda":
        raise ValueError(f"piecewise: graph {graph.serial} runs on {graph.device}: graph memory is measured from "
                         f"the CUDA allocator's pool; estimate on the GPU the model will serve on.")
    keys = graph.up_front.keys_of(sizes)  # checked, largest first
    if not keys:
        raise ValueError(f"piecewise: no capture size of graph {graph.serial} among {sizes!r}.")
    position = graph.pad_position

    def ensure(key) -> None:
        if key not in graph.captured and not graph.capture([key[position]]):
            raise RuntimeError(f"piecewise: graph {graph.serial} did not capture size {key[position]} (see its "
                               f"warnings and stats.summary()); nothing to measure.")

    def measure() -> GraphMemoryEstimate:
        asked = set(keys)
        return from_events(tuple(k[position] for k in keys), [e for e in graph.stats.events if e.key in asked],
                           position)

    for key in (keys[-1], keys[0]):  # the smallest, then the largest
        ensure(key)
    guess = measure()
    more = next((k for k in reversed(keys) if k not in graph.captured), None)
    if guess.measured[-1][0] == keys[0][position] and more is not None:  # no size captured after the largest
        ensure(more)
        guess = measure()
    return guess
