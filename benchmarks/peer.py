"""The bar an engine author sets before adopting the backend: ``torch.compile(model)`` (Inductor's
default) plus the CUDA graphs they would capture by hand.

Decode-only steps (the engine's :class:`~toys.engine.DecodeMetadata` path, graph-safe) are padded
to the backend's own capture sizes and replayed from one ``torch.cuda.CUDAGraph`` per size, captured
the first time a size is met (inside that step, as a hand-written engine does), all in one memory
pool, over the engine's persistent decode buffers. Every other step runs the compiled model
un-graphed. Same warm-up and sizes as the backend's variants: it is the bar, not a strawman.
"""

from __future__ import annotations

import torch

from toys import engine as toy


class HandCaptured:
    """What the engine calls for the ``hand-captured`` variant; :meth:`attach` gives it the engine's
    decode buffers (made after this)."""

    def __init__(self, model, sizes: tuple):
        self.compiled = torch.compile(model)
        self.sizes = sorted(sizes)
        self.graphs: dict[int, tuple] = {}  # padded size -> (graph, its output)
        self.pool = None
        self.buffers = None

    def attach(self, engine: toy.Engine) -> HandCaptured:
        self.buffers = engine._decode
        return self

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        decode = isinstance(toy._CONTEXT.get(), toy.DecodeMetadata)
        size = next((s for s in self.sizes if s >= n), None)
        if not (decode and ids.is_cuda and size is not None and size <= self.buffers.step.shape[1]):
            return self.compiled(ids, positions)
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]

    def _capture(self, size: int) -> tuple:
        """Rows past the step are the buffers' padding (slot -1, length 0): they write and read nothing."""
        ids, positions = self.buffers.step[0, :size], self.buffers.step[1, :size]
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up run torch.cuda.graph's documentation asks for
            self.compiled(ids, positions)
        torch.cuda.current_stream().wait_stream(side)
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.compiled(ids, positions)
        return graph, out
