"""Decode attention over a growing prefix of a KV-cache buffer, made graph-safe (``graph_attention``).

``sdpa(q, k_cache[:B, :, :pos + 1], v_cache[:B, :, :pos + 1])`` reads a prefix whose length changes
every step, which is why attention is split out and run eagerly. On the H200 machine that eager
SDPA costs ~30 µs of host time per layer (selection, allocations, two kernels), plus a copy of its
output into the next graph: most of a small model's step. The same attention can read its length
from device memory: ``piecewise::prefix_attention(q, k_cache, v_cache, length)`` runs on CUDA
the split-key Triton kernel of ``ops/kernel.py`` (flash-decoding with a device length), or,
without Triton, the memory-efficient kernel in its variable-length form with ``seqlen_k =
length``. Both stop at the live prefix (their cost follows the live length, not the buffer's) and
launch the same way at every step. It can be captured, so the decode step becomes one graph.

It is on by default: it won at every batch in one interleaved run (the numbers: ``benchmarks/README.md``,
"Measurement history"). ``graph_attention=False``
gives the eager-attention split back (SDPA's own kernels between the pieces).

Rewritten: SDPA calls whose query has one position, with no dropout or causal flag (a ``scale``
and ``enable_gqa`` are taken, and an ``attn_mask`` that is ``mask[:B, :, :, :stop]`` of a
parameter/buffer with the keys' ``stop``: a padding mask kept in a buffer; ``_mask_view``), and
whose keys and values are ``buffer[:B, :, :stop]`` (or
``buffer[:, :, :stop]`` of a buffer with exactly the query's batch of rows) of contiguous
parameters/buffers with as many heads as the query, or a divisor of them (``enable_gqa=True``, or
heads repeated by ``repeat_interleave``/``repeat_kv``: ``repeated_heads.py``), and fewer than 2**31
key rows (the kernel's offsets are int32), ``stop`` being a per-step int plus a constant. The
length is checked on the host (``1 <= length <= buffer size``).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from .. import _torch_internals
from ..fx import graph_facts as facts
from ..fx.graph_facts import grows_by_cat
from ..op_names import SDPA, canonical_op_name
from ..ops.prefix_attention import PREFIX_ATTENTION
from .graph_edit import Builder, Idiom, static_getitem
from .repeated_heads import repeated_heads


@dataclasses.dataclass(frozen=True)
class AttentionSite:
    node: torch.fx.Node  # the SDPA call
    query: torch.fx.Node
    buffers: tuple  # (k buffer placeholder, v buffer placeholder)
    views: tuple  # the nodes the call read the caches through, outermost first (erased when unused)
    length: tuple  # (placeholder of the per-step int, constant added to it)
    size: int  # the buffers' length along the sliced dim
    scale: float | None = None  # SDPA's ``scale`` (None: 1 / sqrt(head_dim))
    mask: torch.fx.Node | None = None  # the buffer SDPA's ``attn_mask`` is a prefix of (``_mask_view``)


def _sliced_buffer(node, static_names: set, dims: int):
    """(buffer, index) if ``node`` is ``buffer[s0, ..., s{dims-1}]``, every entry a slice, of a
    parameter/buffer; None otherwise."""
    sliced = static_getitem(node, static_names)
    if sliced is None or not isinstance(node.args[1], tuple):
        return None
    buffer, index = sliced
    if len(index) != dims or not all(isinstance(s, slice) for s in index):
        return None
    return buffer, index


def _prefix_view(node, static_names: set, placeholders: dict, steps: frozenset):
    """(buffer, stop, rows) if ``node`` is ``buffer[:rows, :, :stop]`` with a per-step ``stop``; ``rows``
    is the buffer's own row count for a view of every row (``buffer[:, :, :stop]``: a cache sized to
    the batch)."""
    sliced = _sliced_buffer(node, static_names, 3)
    if sliced is None:
        return None
    buffer, (rows, heads, positions) = sliced
    if (
        rows.start is not None
        or rows.step is not None
        or heads != slice(None)
        or positions.start is not None
        or positions.step is not None
        or not isinstance(positions.stop, torch.fx.Node)
    ):
        return None
    if not facts.is_per_step(positions.stop, steps):
        return None
    return buffer, positions.stop, rows.stop if rows.stop is not None else facts.example_value(buffer).shape[0]


def _same_size(rows, batch) -> bool:
    """Is the views' row count (a node, an int or a SymInt) the query's batch size?"""
    value = facts.example_value(rows) if isinstance(rows, torch.fx.Node) else rows
    # as expressions (with the shape env's replacements: a batch Dynamo specialised is its number),
    # compared structurally: no guard is added
    return _torch_internals.sym_expr(value) == _torch_internals.sym_expr(batch)


def _length(stop: torch.fx.Node, placeholders: dict):
    """``stop`` as (per-step placeholder, constant): ``pos`` or ``pos + 1``; None otherwise."""
    if stop in placeholders:
        return stop, 0
    if stop.op == "call_function" and stop.target is operator.add and len(stop.args) == 2:
        a, b = stop.args
        if a in placeholders and isinstance(b, int):
            return a, b
        if b in placeholders and isinstance(a, int):
            return b, a
    return None


def _grown_by_cat(arg, roots: dict, hops: int = 6) -> bool:
    """Are these keys/values a ``torch.cat``-grown cache, perhaps through views or ``repeat_kv``?"""
    for _ in range(hops):
        if not isinstance(arg, torch.fx.Node):
            return False
        if grows_by_cat(arg, roots):
            return True
        tensors = [i for i in arg.all_input_nodes if isinstance(facts.example_value(i), torch.Tensor)]
        arg = tensors[0] if len(tensors) == 1 else None
    return False


def _heads_fit(q, shapes, repeats: set, gqa: bool) -> bool:
    """Do the caches' head counts serve the query's: as they are, repeated the one way for both
    (``repeat_interleave``/``repeat_kv``), or grouped by ``enable_gqa``?"""
    if len(repeats) > 1 or shapes[0] != shapes[1]:
        return False
    if repeats != {1}:  # repeat_interleave / repeat_kv: as many heads as the query once repeated
        return shapes[0][1] * repeats.pop() == q.shape[1]
    return shapes[0][1] == q.shape[1] or gqa and q.shape[1] % shapes[0][1] == 0


def _site_or_reason(node, static_names: set, placeholders: dict, steps: frozenset, roots: dict) -> AttentionSite | str:
    """The site to rewrite, or why this SDPA call stays eager (for people: the inspection report)."""
    query = node.args[0]
    q = facts.example_value(query)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return "its query is not [batch, heads, positions, head_dim]"
    if _torch_internals.sym_expr(q.shape[2]) != 1:
        return f"its query has {q.shape[2]} positions, not one (a prefill)"
    if any(_grown_by_cat(a, roots) for a in node.args[1:3]):
        return (
            "its keys/values grow by torch.cat every step (a dynamic cache): the cat runs eagerly beside it, "
            "so the compute pieces replay at every KV length"
        )
    extra = [k for k, v in node.kwargs.items() if k != "attn_mask" and not _taken(k, v)]
    if len(node.args) not in (3, 4) or extra:  # the kernel takes q, k, v, a mask, a scale and GQA
        return (
            f"it passes {', '.join(extra) or 'more than q, k, v, attn_mask'} (the graph-safe kernel takes "
            f"q, k, v, attn_mask, scale and enable_gqa alone)"
        )
    mask_arg = node.args[3] if len(node.args) == 4 else node.kwargs.get("attn_mask")
    kv = [repeated_heads(a) or (a, 1, ()) for a in node.args[1:]]  # GQA written out: read the cache itself
    views = [_prefix_view(inner, static_names, placeholders, steps) for inner, _, _ in kv]
    if None in views or views[0][1] is not views[1][1]:
        return "its keys/values are not cache[:B, :, :t + c] of a parameter/buffer at a per-step t"
    if not all(_same_size(v[2], q.shape[0]) for v in views):
        return "the caches' rows it reads are not the query's batch"
    length = _length(views[0][1], placeholders)
    buffers = (views[0][0], views[1][0])
    values = [facts.example_value(b) for b in buffers]
    shapes = [v.shape for v in values]
    if length is None:
        return "its KV length is not a per-step int plus a constant"
    if not _heads_fit(q, shapes, {groups for _, groups, _ in kv}, node.kwargs.get("enable_gqa", False)):
        return "keys and values have other head counts than the query, and no enable_gqa=True that fits them"
    if not all(v.is_contiguous() for v in values):  # the kernel reads the cache in place
        return "a cache is not contiguous"
    if shapes[0][0] * shapes[0][1] * shapes[0][2] >= 2**31:  # key offsets are int32 in the kernel
        return "a cache has 2**31 key rows or more"
    mask = None
    if mask_arg is not None:
        mask = _mask_view(mask_arg, static_names, placeholders, length, q, int(shapes[0][2]))
        if isinstance(mask, str):
            return mask
    read = tuple(n for inner, _, chain in kv for n in (*chain, inner))  # outermost first: erased in this order
    return AttentionSite(
        node,
        query,
        buffers,
        read + ((mask_arg,) if mask else ()),
        length,
        int(shapes[0][2]),
        node.kwargs.get("scale"),
        mask,
    )


def _mask_view(node, static_names: set, placeholders: dict, length: tuple, q, size: int):
    """The buffer an ``attn_mask`` of ``mask[:B, :, :, :stop]`` reads (``stop``: the keys' ``length``,
    a per-step int plus a constant), or why it stays eager. The buffer: a parameter/buffer [rows,
    heads or 1, 1, the caches' length], bool or the query's dtype; the rows read are the query's
    batch (``[:B]``, or every row of a buffer of that many), or one row for all."""
    why = (
        "its attn_mask is not mask[:B, :, :, :t + c] of a parameter/buffer [B or 1, heads or 1, 1, cache "
        "length] read up to the keys' length (a mask built at each step stays eager)"
    )
    sliced = _sliced_buffer(node, static_names, 4)
    if sliced is None:
        return why
    buffer, (rows, heads, queries, positions) = sliced
    value = facts.example_value(buffer)
    if (
        heads != slice(None)
        or queries != slice(None)
        or rows.start is not None
        or rows.step is not None
        or positions.start is not None
        or positions.step is not None
        or not isinstance(positions.stop, torch.fx.Node)
        or _length(positions.stop, placeholders) != length
    ):
        return why
    if (
        value.dim() != 4
        or value.shape[2] != 1
        or value.shape[1] not in (1, q.shape[1])
        or value.shape[3] != size
        or not (value.dtype == torch.bool or value.dtype == q.dtype)
    ):
        return why
    broadcast = rows.stop is None and value.shape[0] == 1
    if not (broadcast or _same_size(value.shape[0] if rows.stop is None else rows.stop, q.shape[0])):
        return why
    return buffer


def _taken(name: str, value) -> bool:
    """Is this SDPA keyword one the graph-safe kernel does too?"""
    return (
        (name == "is_causal" and value is False)
        or (name == "enable_gqa" and isinstance(value, bool))
        or (name == "scale" and (value is None or isinstance(value, (int, float))))
        or (name == "dropout_p" and isinstance(value, (int, float)) and value == 0)
    )  # transformers passes 0.0


def classify_attention(graph: torch.fx.Graph, static_names: set, steps: frozenset) -> dict:
    """Every SDPA call of ``graph`` by node name: its :class:`AttentionSite`, or why it stays eager."""
    placeholders = {n: i for i, n in enumerate(facts.placeholders(graph))}
    roots = facts.alias_roots(graph)
    out = {}
    for node in graph.nodes:
        if node.op == "call_function" and canonical_op_name(node.target) == SDPA:
            out[node.name] = _site_or_reason(node, static_names, placeholders, steps, roots)
    return out


def find_attention_sites(graph: torch.fx.Graph, static_names: set, steps: frozenset) -> list[AttentionSite]:
    return [s for s in classify_attention(graph, static_names, steps).values() if isinstance(s, AttentionSite)]


PATH = "piecewise_attention_path"  # node meta: why an SDPA call is not rewritten (the split copies meta)


def mark_attention_paths(graph: torch.fx.Graph, static_names: set, steps: frozenset, off: str | None) -> None:
    """Note on each SDPA call that the rewrite will not take why it stays eager (``node.meta[PATH]``),
    for the inspection report. ``off``: why the rewrite does not run at all, if it does not."""
    sites = classify_attention(graph, static_names, steps)
    for node in graph.nodes:
        site = sites.get(node.name)
        if site is not None and (off or not isinstance(site, AttentionSite)):
            node.meta[PATH] = f"eager: {off or site}"


def rewrite_attention(site: AttentionSite, length_value: torch.fx.Node, add) -> torch.fx.Node:
    """Replace the SDPA call with ``prefix_attention`` reading ``length_value``; ``add`` builds nodes."""
    node = add("call_function", PREFIX_ATTENTION, site.query, *site.buffers, length_value, site.scale, site.mask)
    site.node.replace_all_uses_with(node)
    graph = site.node.graph
    graph.erase_node(site.node)
    for view in dict.fromkeys(site.views):
        if not view.users:
            graph.erase_node(view)
    return node


def _rewrite(site: AttentionSite, context) -> dict:
    """The SDPA call replaced, reading its KV length from the step scalars (one length node for
    every layer: Inductor kept 16 adds as 16 kernels); it reads ``cache[:B]`` (and the mask's rows)."""
    add = Builder(site.node.graph, site.node, context.fake_mode, context.shared)
    position, constant = site.length
    length = add.once("call_function", operator.getitem, context.scalars, context.slot_of[position])
    if constant:
        length = add.once("call_function", operator.add, length, constant)
    attention = rewrite_attention(site, length, add)
    mask = ((site.mask, 0),) if site.mask is not None and facts.example_value(site.mask).shape[0] != 1 else ()
    return {attention: tuple((buffer, 0) for buffer in site.buffers) + mask}


GRAPH_ATTENTION = Idiom(
    "graph attention",
    lambda writes, attention: attention,
    find_attention_sites,
    lambda site, slots: slots.need(*site.length, 1, site.size, f"the attention over {site.buffers[0].name}"),
    _rewrite,
)
