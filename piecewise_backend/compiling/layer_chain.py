"""A compute piece that holds many layers' attention, compiled layer by layer and run as one.

A decode step whose attention is graph-safe (``rewrite/graph_attention.py``'s ``prefix_attention``,
or a fixed-shape SDPA over a static cache) stays one compute piece, so that it replays as one CUDA
graph. Compiled whole, Inductor lowers and generates code for every layer: the same layer N times.
On the H200 that made our cold start slower than Inductor's own (Qwen2.5-1.5B's widths, 8 layers,
static cache: 87.5 s against 76.4 s), though our prefill pieces compile only three times.

Cut at its attention calls, the piece becomes a chain of sub-pieces whose middles are the same
code up to the weights they read, which :class:`~piecewise_backend.compiling.PieceCompiler`
compiles once for all: three compiles at any depth, as for the prefill's pieces. The chain is one
callable, so the runner still captures the whole step as one CUDA graph, and nothing is lost to
fusion: Inductor cannot fuse across an attention call (an extern kernel or a custom op) anyway.

Only done when it pays: when the distinct sub-pieces hold at most half of the piece's ops (8
layers: about a quarter; 4 layers: no cut). Should cutting fail, the piece is compiled whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from .. import _torch_internals
from ..fx import graph_facts as facts
from ..kinds import PieceKind
from ..op_names import canonical_op_name
from ..split.piece_boundaries import keep_containers_in_their_piece

MIN_ATTENTION_CALLS = 3  # fewer: first, middle and last sub-pieces all differ, so cutting saves nothing
MAX_DISTINCT_SHARE = 0.5  # cut only if the distinct sub-pieces hold at most this share of the ops


class CompiledSubPiece(torch.nn.Module):
    """A compiled sub-piece in the chain's module tree (positional args, as Inductor's callables take)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def attention_calls(gm: torch.fx.GraphModule, attention_ops: frozenset[str]) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and canonical_op_name(n.target) in attention_ops]


SymbolReader = tuple[int, str, int | None]  # (input index, "size" | "stride" | "storage_offset", dim)


def _lift_input_symbols(graph: torch.fx.Graph) -> list[SymbolReader]:
    """Make each symbol of the inputs' sizes, strides and storage offsets that no node has as its
    value an input of its own (after the others); returns where each is read from the piece's inputs.

    ``split_module`` hands a sub-piece each symbol free in the values it receives, but only symbols
    some node's value is (else ``KeyError``), and the split drops a piece's scalar inputs that no node
    reads: a KV length the piece only knows as a dim of its cache, or a sliding-window cache view's
    storage offset (transformers 5.17's Mistral on the H200: ``KeyError: s86``). An input, not a
    ``sym_size`` node: ``split_module`` makes the partition holding such a node depend on itself
    through the very input it reads (a cycle).
    """
    sym = _torch_internals.sym_expr
    bound = {sym(v) for v in map(facts.example_value, graph.nodes) if isinstance(v, torch.SymInt)}
    inputs = facts.placeholders(graph)
    last, readers = inputs[-1], []
    for i, node in enumerate(inputs):
        value = facts.example_value(node)
        if not isinstance(value, torch.Tensor):
            continue
        for what, dim, symbol in [
            *(("size", d, s) for d, s in enumerate(value.shape)),
            *(("stride", d, s) for d, s in enumerate(value.stride())),
            ("storage_offset", None, value.storage_offset()),
        ]:
            if not isinstance(symbol, torch.SymInt) or not sym(symbol).is_Symbol or sym(symbol) in bound:
                continue
            with graph.inserting_after(last):
                last = graph.placeholder(f"{node.name}_{what}{'' if dim is None else dim}")
            last.meta["example_value"] = symbol
            bound.add(sym(symbol))
            readers.append((i, what, dim))
    return readers


def read_symbols(args, readers: list[SymbolReader]) -> list:
    """The values of the lifted symbols (:func:`_lift_input_symbols`) in the piece's inputs ``args``."""
    return [getattr(args[i], what)() if dim is None else getattr(args[i], what)(dim) for i, what, dim in readers]


def _pays(chain: torch.fx.GraphModule, compute: set[str], code_key: Callable) -> bool:
    """Do the distinct compute sub-pieces hold at most :data:`MAX_DISTINCT_SHARE` of their ops?"""
    ops = {name: sum(n.op == "call_function" for n in getattr(chain, name).graph.nodes) for name in compute}
    distinct = {code_key(getattr(chain, name)): ops[name] for name in compute}
    return sum(distinct.values()) <= MAX_DISTINCT_SHARE * sum(ops.values())


def split_at_attention(
    gm: torch.fx.GraphModule, attention_ops: frozenset[str], code_key: Callable
) -> tuple[torch.fx.GraphModule, set[str], list[SymbolReader]] | None:
    """``gm`` (left as it is) cut before and after each attention call: the chain, the names of its
    compute sub-pieces, and the symbols it takes after ``gm``'s inputs (:func:`read_symbols`). None
    when cutting does not pay (``code_key``: a sub-piece's code, up to names and input metadata) or
    there are fewer than :data:`MIN_ATTENTION_CALLS` calls."""
    if len(attention_calls(gm, attention_ops)) < MIN_ATTENTION_CALLS:
        return None
    gm = _torch_internals.copy_graph_module(gm)
    cuts = set(attention_calls(gm, attention_ops))
    readers = _lift_input_symbols(gm.graph)
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
    compute = {
        str(n.target)
        for n in chain.graph.nodes
        if n.op == "call_module" and _torch_internals.split_partition(n) not in attention_parts
    }
    return (chain, compute, readers) if _pays(chain, compute, code_key) else None


class SymbolFedChain(torch.nn.Module):
    """The chain, handed the lifted symbols' values (:func:`read_symbols`) after the piece's inputs."""

    def __init__(self, chain: torch.fx.GraphModule, readers: list[SymbolReader]):
        super().__init__()
        self.chain = chain
        self.readers = readers

    def forward(self, *args):
        return self.chain(*args, *read_symbols(args, self.readers))


def install(chain: torch.fx.GraphModule, compiled: dict, readers: list[SymbolReader]) -> torch.nn.Module:
    """The piece's callable: ``chain`` with each compute sub-piece replaced by its compiled callable
    (``compiled``: name -> callable; the attention sub-pieces stay FX code, which runs their one op),
    fed the lifted symbols where there are any."""
    for name, fn in compiled.items():
        setattr(chain, name, CompiledSubPiece(fn))
    _torch_internals.generate_code(chain)  # its attention sub-pieces ran on fakes: theirs exists
    return SymbolFedChain(chain, readers) if readers else chain
