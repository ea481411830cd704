"""Graph memory known before the KV cache is sized: the pool a list of sizes needs, from two captures.

Why it can be predicted: every graph of a device captures into one pool, and a captured step's
temporaries are free once the step ends (outputs are kept as non-owning aliases), so the next
capture reuses them. Captured largest first (``capture()``, ``eager_capture_sizes``), the pool of
all sizes is the pool of the largest: on the H200, 67 sizes of a 16-layer Llama held exactly the
bytes of size 512 alone. What a size needs grows with its rows (activations) on top of a fixed
part (workspaces, the keeper): a line through two measured points.

So :func:`estimate` captures the smallest and the largest size asked about (smallest first, so
that its point is measured from the pool as it was), reads the pool after each, and fits
``bytes = fixed + per_row * size``. The captures are real and stay (the sizes are then served). The
estimate answers for any list (``for_sizes``) and a budget (``largest_size_within``).

Vendors' estimates miss by 3x in both directions (vLLM #45178, #51590) because they sum per-size
costs that the pool shares, or profile without the capture's own allocations; this one is the
allocator's own count of the pool, measured, for this model on this device.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class GraphMemoryEstimate:
    """What the graph pool holds once sizes are captured (largest first, or after the largest).

    Attributes:
        sizes: the sizes it was asked about.
        measured: ((size, pool bytes after capturing it), ...), the points it rests on.
        fixed_bytes, bytes_per_row: the line through them.
    """

    sizes: tuple
    measured: tuple
    fixed_bytes: float
    bytes_per_row: float

    @property
    def predicted_bytes(self) -> int:
        """The pool once all of ``sizes`` are captured."""
        return self.for_sizes(self.sizes)

    def for_sizes(self, sizes: Iterable[int]) -> int:
        """The pool once ``sizes`` are captured: the line at the largest."""
        return int(max(0.0, self.fixed_bytes + self.bytes_per_row * max(sizes)))

    def largest_size_within(self, budget_bytes: int, capture_sizes: Iterable[int]) -> int | None:
        """The largest of ``capture_sizes`` whose pool fits ``budget_bytes`` (None: not even the smallest)."""
        fitting = [s for s in capture_sizes if self.for_sizes([s]) <= budget_bytes]
        return max(fitting) if fitting else None

    def __str__(self) -> str:
        points = ", ".join(f"{s}: {b / 2**20:.1f} MiB" for s, b in self.measured)
        return (f"graph pool for sizes up to {max(self.sizes)}: {self.predicted_bytes / 2**20:.1f} MiB "
                f"(measured {points}; {self.fixed_bytes / 2**20:.1f} MiB + {self.bytes_per_row / 2**10:.1f} KiB "
                f"per row)")


def fit(points: list[tuple[int, int]]) -> tuple[float, float]:
    """(fixed, per_row) of the line through two (size, bytes) points; through the origin for one."""
    (s1, b1), (s2, b2) = points[0], points[-1]
    if s1 == s2:
        return 0.0, b2 / s2
    per_row = max(0.0, (b2 - b1) / (s2 - s1))
    return b1 - per_row * s1, per_row


def estimate(graph, sizes: Iterable[int] | str = "all") -> GraphMemoryEstimate:
    """Capture the smallest and the largest of ``sizes`` (those not captured yet) on ``graph`` and
    predict the pool of all of them (see the module docstring)."""
    if graph.device.type != "cuda":
        raise ValueError(f"piecewise: graph {graph.serial} runs on {graph.device}: graph memory is measured from "
                         f"the CUDA allocator's pool; estimate on the GPU the model will serve on.")
    keys = graph.up_front.keys_of(sizes)  # checked, largest first
    if not keys:
        raise ValueError(f"piecewise: no capture size of graph {graph.serial} among {sizes!r}.")
    position = graph.pad_position
    measured = []
    for key in (keys[-1], keys[0]) if len(keys) > 1 else keys:
        if key not in graph.captured and not graph.capture([key[position]]):
            raise RuntimeError(f"piecewise: graph {graph.serial} did not capture size {key[position]} (see its "
                               f"warnings and stats.summary()); nothing to measure.")
        after = next((e.pool_bytes for e in graph.stats.events if e.key == key), None)
        measured.append((key[position], graph.pool_bytes() if after is None else after))
    fixed, per_row = fit(measured)
    return GraphMemoryEstimate(tuple(sorted(k[position] for k in keys)), tuple(measured), fixed, per_row)
