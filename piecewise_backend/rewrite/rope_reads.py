"""Per-step reads of never-written buffers (the RoPE row ``cos[pos:pos + S]``), moved into graphs.

The eager slice would run every step, at a new address, and be copied into every layer's graph
that reads it. Rewritten as a gather whose position comes from the step scalars, it runs inside the
first compute piece that needs it. (Without the rewrite, ``graph_attention=False`` and
``capture_kv_writes=False``, the same row is still served well by two general mechanisms: the split
hoists the slice into one eager prologue, ``splitting._hoist``, and the runners copy it into one
shared captured buffer per step, ``staging.py``.)
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..fx import graph_facts as facts
from .graph_edit import Builder, Idiom, SharedNodes, Site, indices, slice_dims, static_getitem, step_dims_bounds


def find_reads(graph: torch.fx.Graph, static_names: set[str], steps: frozenset) -> list[Site]:
    """Slices of never-written buffers at a per-step position, whose users only read them: an
    in-graph gather gives the same values."""
    placeholders = {n: i for i, n in enumerate(facts.placeholders(graph))}
    roots = facts.alias_roots(graph)
    written = {roots[m] for n in graph.nodes for m in facts.mutated_inputs(n)}
    sites = []
    for node in graph.nodes:
        sliced = static_getitem(node, static_names) if node.users else None
        if sliced is None:
            continue
        buffer, index = sliced
        if buffer in written or any(facts.mutated_inputs(u) for u in node.users):
            continue
        dims = slice_dims(facts.example_value(buffer), facts.example_value(node), index, steps, placeholders)
        if dims is not None:
            sites.append(Site(node, buffer, None, dims))
    return sites


def rewrite_read(site: Site, scalars: torch.fx.Node, slot_of: dict, fake_mode, shared: SharedNodes) -> None:
    add = Builder(site.node.graph, site.node, fake_mode, shared)
    where, _ = indices(site, scalars, slot_of, add, masked=False)
    site.node.replace_all_uses_with(add("call_function", operator.getitem, site.buffer, where))
    site.node.graph.erase_node(site.node)


def _rewrite(site: Site, context) -> dict:
    rewrite_read(site, context.scalars, context.slot_of, context.fake_mode, context.shared)
    return {}


ROPE_READS = Idiom(
    "RoPE reads",
    lambda writes, attention: writes or attention,
    find_reads,
    lambda site, slots: step_dims_bounds(site, slots, "the read of"),
    _rewrite,
)
