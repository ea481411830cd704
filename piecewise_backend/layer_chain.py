"""A compute piece that holds many layers' attention, compiled layer by layer and run as one.

A decode step whose attention is graph-safe (``decode/graph_attention.py``'s ``prefix_attention``,
or a fixed-shape SDPA over a static cache) stays one compute piece, so that it replays as one CUDA
graph. Compiled whole, Inductor lowers and generates code for every layer: the same layer N times.
On the H200 that made our cold start slower than Inductor's own (Qwen2.5-1.5B's widths, 8 layers,
static cache: 87.5 s against 76.4 s), though our prefill pieces compile only three times.

Cut at its attention calls, the piece becomes a chain of sub-pieces whose middles are the same
code up to the weights they read, which :class:`~piecewise_backend.compiling.PieceCompiler`
compiles once for all: three compiles at any depth, as for the prefill's pieces. The chain is one
callable, so the runner still captures the whole step as one CUDA graph, and nothing is lost to
fusion: Inductor cannot fuse across an attention call (an extern kernel or a custom op) anyway.

Only done when it pays: with 3 or more attention calls at least two middle sub-pieces share code.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from . import _torch_internals
from .kinds import PieceKind
from .op_names import canonical_op_name
from .piece_boundaries import keep_containers_in_their_piece

MIN_ATTENTION_CALLS = 3  # fewer: first, middle and last sub-pieces all differ, so cutting saves nothing


class _Compiled(torch.nn.Module):
    """A compiled sub-piece in the chain's module tree (positional args, as Inductor's callables take)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def attention_calls(gm: torch.fx.GraphModule, attention_ops: frozenset[str]) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and canonical_op_name(n.target) in attention_ops]


def split_at_attention(gm: torch.fx.GraphModule, attention_ops: frozenset[str]
                       ) -> tuple[torch.fx.GraphModule, set[str]] | None:
    """``gm`` (left as it is) cut before and after each attention call: the chain, and the names of
    its compute sub-pieces. None when there are fewer than :data:`MIN_ATTENTION_CALLS` calls."""
    gm = _torch_internals.copy_graph_module(gm)
    cuts = set(attention_calls(gm, attention_ops))
    if len(cuts) < MIN_ATTENTION_CALLS:
        return None
    part, kinds, pid = {}, {}, 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node in cuts:
            pid += 1
        part[node] = pid
        kinds[node] = PieceKind.SPLIT if node in cuts else PieceKind.COMPUTE
        if node in cuts:
            pid += 1
    keep_containers_in_their_piece(gm.graph, kinds, part, {})  # an attention returning a tuple keeps it
    chain = split_module(gm, None, lambda n: part[n], keep_original_order=True)
    attention_parts = {part[n] for n in cuts}
    compute = {str(n.target) for n in chain.graph.nodes if n.op == "call_module"
               and int(str(n.target).rsplit("_", 1)[1]) not in attention_parts}
    return chain, compute


def install(chain: torch.fx.GraphModule, compiled: dict) -> torch.fx.GraphModule:
    """``chain`` with each compute sub-piece replaced by its compiled callable (``compiled``: name ->
    callable); the attention sub-pieces stay FX code, which runs their one op."""
    for name, fn in compiled.items():
        setattr(chain, name, _Compiled(fn))
    return chain
