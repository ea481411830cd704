"""Where attention and the nodes next to it run: in a graph, or eagerly beside the attention op.

The backend splits at attention because a decode step's KV length changes every call: a graph
that baked it in would be wrong, or recaptured every step. Two common idioms need the opposite
answer from the plain rule, and this module decides both before the split:

* **Fixed-shape attention stays in its piece.** Hugging Face's ``StaticCache`` (and any model
  that attends over a whole preallocated cache with a mask) calls SDPA on shapes that never
  change: ``q [B, H, 1, D]`` against ``k, v [B, H, T_max, D]``, the mask marking the live
  positions. Nothing per step is in its shapes, so it is graph-safe as written; splitting it out
  would cost an eager kernel launch and an output copy per layer for nothing. With it inside,
  a static-cache decode step is one graph per batch size.
* **What is sized by the KV length runs with its attention.** ``DynamicCache`` (and every
  ``past = torch.cat([past, k], dim=-2)`` model) makes a new tensor per step whose length is a
  symbol; a sliding window crops it; ``repeat_kv`` expands it; the mask is built for that length.
  In a compute piece each would put the length into the piece's shape key: one capture per KV
  length, and no replay ever (what HF ``generate()`` got before). Beside the attention op, in the
  eager piece, the compute pieces never see the KV length and replay at every step; those ops run
  eagerly, as they do in eager, a few kernels per layer. The same holds for a fixed-shape attention
  whose mask is gathered from an input that grows (transformers 5.17's full sliding window reads
  its window's columns of ``attention_mask [B, past + 1]``): the gather runs eagerly, the attention
  stays in its piece.
"""

from __future__ import annotations

import torch
import torch.fx

from .._torch_internals import sym_expr
from ..fx import graph_facts as facts
from ..fx.graph_facts import grows_by_cat
from ..op_names import SDPA, canonical_op_name, display_name


def _fixed_but_batch(value) -> bool:
    """Is every dim of ``value`` but the first (the batch, captured per size) a plain number?"""
    return isinstance(value, torch.Tensor) and all(
        sym_expr(s).is_number if isinstance(s, torch.SymInt) else True for s in value.shape[1:]
    )


def is_fixed_shape_attention(node: torch.fx.Node) -> bool:
    """A decode SDPA call (one query position) whose query, keys, values and mask have fixed sizes
    except the batch: graph-safe as written.

    Only decode: a prefill's attention stays split even at a fixed length, so that its layers stay
    separate pieces that Inductor compiles once for all (a model's first call is a fixed-size prefill).
    """
    if node.op != "call_function" or canonical_op_name(node.target) != SDPA:
        return False
    values = [facts.example_value(a) for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    return (
        len(tensors) >= 3
        and tensors[0].dim() == 4
        and sym_expr(tensors[0].shape[2]) == 1
        and all(_fixed_but_batch(v) for v in tensors)
    )


def query_symbols(graph: torch.fx.Graph, is_attention) -> set:
    """Symbols in the sizes of attention's queries: the batch, and a prefill's length. Whatever else
    attention reads is sized by the KV length (its keys, values, mask, and the inputs they are built
    from, such as Hugging Face's ``attention_mask [B, past + 1]``)."""
    out: set = set()
    for node in graph.nodes:
        if is_attention(node) and node.args and isinstance(node.args[0], torch.fx.Node):
            out |= facts.value_symbols(facts.example_value(node.args[0]), with_offset=False)
    return out


def _symbols(node: torch.fx.Node) -> set:
    """The symbols in ``node``'s sizes and in the ints it reads (``arange(1) + past_length``).

    Integer symbols only: a float symbol (``eps`` in ``h * rsqrt(var + eps)``, a SymFloat since Dynamo
    makes one of a module's float attributes under ``dynamic=True``) is a value, not a length;
    counted as one, it sent a whole RMSNorm-QKV chain beside the attention."""
    out = facts.value_symbols(facts.example_value(node), with_offset=False)
    for arg in node.all_input_nodes:
        if facts.is_sym_node(arg):
            out |= facts.value_symbols(facts.example_value(arg))
    return {s for s in out if s.is_integer}


def beside_attention(graph: torch.fx.Graph, is_compute, is_attention) -> dict:
    """Compute nodes sized by a KV length that only attention (or the graph's output) reads, directly
    or through each other: the cache's ``cat``, its crop to a sliding window, views, ``repeat_kv``, the
    mask built for that length. Node -> why it runs eagerly, beside its attention. ``is_attention``
    may hold attention that stays in a compute piece (fixed shape): the KV length stops at it."""
    queries = query_symbols(graph, is_attention)
    if not any(is_attention(n) for n in graph.nodes):
        return {}
    roots = facts.alias_roots(graph)
    lengths: dict = {}  # compute node -> the KV-length symbols its value depends on
    for node in graph.nodes:
        if is_compute(node) and not is_attention(node):  # a fixed-shape attention's output is not KV-sized
            found = _symbols(node) - queries
            for arg in node.all_input_nodes:
                found |= lengths.get(arg, set())
            if found:
                lengths[node] = found
    keep: dict = {}
    for node in reversed(list(graph.nodes)):
        # read by attention as keys, values or mask (never as its query), by the output, or by another such node
        if (
            node in lengths
            and node.users
            and all(u.op == "output" or u in keep or is_attention(u) and u.args[0] is not node for u in node.users)
        ):
            what = "grows a cache by cat" if grows_by_cat(node, roots) else "depends on a KV length"
            keep[node] = (
                f"{display_name(node)}: {what} ({', '.join(sorted(map(str, lengths[node])))}), read only "
                f"by attention: runs beside it so that compute pieces never see the KV length"
            )
    return keep
