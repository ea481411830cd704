"""The serving benchmarks' peer with no compiler: Meta's ``breakable-cuda-graphs`` around the engine's model.

``breakable_cuda_graphs`` (BSD, on the package index; carried to the GPU machine as a wheel) captures
one region as a sequence of CUDA graph segments split at functions marked ``@no_graph``, which run
eagerly at replay. Here the region is the engine's model at a capture size (vLLM's sizes, padded up,
captured lazily on first sight, one pool for all), and the attention op is the ``@no_graph``
function: at replay it runs again, reading the step's metadata from the engine's forward context,
for the step's real rows (its padded rows are left alone, as nobody reads them). No Inductor: the
model's own eager kernels are what is captured.
"""

from __future__ import annotations

import bisect

import torch

from toys import engine as toy


def _sizes(largest: int = 512) -> list[int]:
    return sorted({1, 2, 4, *range(8, largest + 1, 8)})


class BreakableForward:
    """``forward(ids, positions)`` for :class:`toys.engine.Engine`, replayed from breakable graphs."""

    def __init__(self, model: toy.EngineModel):
        from breakable_cuda_graphs import BreakableCUDAGraph, breakable_graph, no_graph

        self.model, self._graph_type, self._capture = model, BreakableCUDAGraph, breakable_graph
        self.sizes = _sizes()
        self.graphs: dict[int, tuple] = {}  # size -> (graph, ids buffer, positions buffer, output)
        self.pool = None
        self.capture_seconds = 0.0
        attention = no_graph(_real_rows_attention)
        for layer in model.layers:
            layer.attention = attention

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        if n > self.sizes[-1]:
            return self.model(ids, positions)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        if size not in self.graphs:
            self.graphs[size] = self._record(size, ids, positions)
        graph, ids_buf, positions_buf, out = self.graphs[size]
        ids_buf[:n].copy_(ids)
        positions_buf[:n].copy_(positions)
        graph.replay()
        return out[:n]

    def _record(self, size: int, ids: torch.Tensor, positions: torch.Tensor) -> tuple:
        import time

        start = time.perf_counter()
        ids_buf = torch.zeros(size, dtype=ids.dtype, device=ids.device)
        positions_buf = torch.zeros(size, dtype=positions.dtype, device=positions.device)
        ids_buf[: ids.shape[0]].copy_(ids)
        positions_buf[: positions.shape[0]].copy_(positions)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model(ids_buf, positions_buf)  # warm-up, as the package's README asks
        torch.cuda.current_stream().wait_stream(side)
        graph = self._graph_type(pool=self.pool)
        with self._capture(graph):
            out = self.model(ids_buf, positions_buf)
        self.pool = graph.pool()
        graph.replay()  # capture runs no kernel: this call's output comes from a replay
        self.capture_seconds += time.perf_counter() - start
        return graph, ids_buf, positions_buf, out


def _real_rows_attention(q, k, v, out, layer: int) -> None:
    """The engine's attention over the step's real rows only (a padded capture size has more)."""
    n = toy._CONTEXT.get().num_tokens
    toy._attention_impl(q[:n], k[:n], v[:n], out[:n], layer)
