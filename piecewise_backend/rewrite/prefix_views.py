"""Cache prefix views read by attention, taken with one ``as_strided`` instead of slice indexing.

Why: the eager attention pieces slice the caches at every step, ``k_cache[:B, :, :pos + 1]`` and
the same for values, in every layer: 32 views per step of a 16-layer model. Indexing with a tuple
of slices costs ~5 µs of host time on the H200 machine (the tuple parsed, one slice op per dim);
``torch.as_strided`` with the same sizes and the buffer's own strides is one op and gives the same
view (same storage, offset and strides: a slice from 0 keeps them). On CPU it is 1.1 µs vs 2.2 µs.

Rewritten: ``buffer[s0, s1, ...]`` of a contiguous parameter/buffer placeholder where every index
is a slice from 0 (or None) with unit step, at least one stop is a per-step value (so the view runs
eagerly), and every user is scaled-dot-product attention (a read). Indexing clamps a stop past the buffer's size; the view
keeps that (Dynamo already guards ``pos + 1 <= size`` in the graphs it traces, so this is a second
line): a constant stop is clamped here, a per-step one (``pos + 1``) by ``min`` at run time
(builtin ``min``, 0.1 µs, where ``torch.sym_min`` costs 0.8: safe because a node that uses a
per-step value always runs eagerly, never traced), and a batch-size stop on dim 0 needs none (past
the buffer, ``as_strided`` itself raises: the view would leave the storage). Other stops are
left alone.
"""

from __future__ import annotations

import torch
import torch.fx

from ..fx import graph_facts as facts
from ..op_names import SDPA, canonical_op_name
from .graph_edit import static_getitem

_READERS = frozenset({SDPA})


def _from_zero(s) -> bool:
    return (
        isinstance(s, slice)
        and s.start in (None, 0)
        and s.step in (None, 1)
        and (s.stop is None or isinstance(s.stop, torch.fx.Node) or (isinstance(s.stop, int) and s.stop >= 0))
    )


def _stops_supported(index: tuple, steps: frozenset) -> bool:
    """At least one per-step stop (such a view always runs eagerly: views a compute piece takes
    cost nothing per step, inside its graph, and are left to Inductor); other graph-value stops
    only on dim 0."""
    nodes = [(d, s.stop) for d, s in enumerate(index) if isinstance(s.stop, torch.fx.Node)]
    return any(facts.is_per_step(stop, steps) for _, stop in nodes) and all(
        facts.is_per_step(stop, steps) or (d == 0 and stop.op == "placeholder") for d, stop in nodes
    )


def find_prefix_views(graph: torch.fx.Graph, static_names: set[str], steps: frozenset) -> list[torch.fx.Node]:
    views = []
    for node in graph.nodes:
        sliced = static_getitem(node, static_names) if node.users else None
        if sliced is None:
            continue
        buffer, index = sliced
        value = facts.example_value(buffer)
        if not (
            isinstance(value, torch.Tensor)
            and value.is_contiguous()
            and 0 < len(index) <= value.dim()
            and all(map(_from_zero, index))
            and _stops_supported(index, steps)
        ):
            continue
        if all(u.op == "call_function" and canonical_op_name(u.target) in _READERS for u in node.users):
            views.append(node)
    return views


def rewrite_prefix_view(view: torch.fx.Node, steps: frozenset, add) -> torch.fx.Node:
    """Replace ``view`` with ``as_strided``; ``add`` builds nodes (with fake values) before it."""
    buffer, index = view.args
    index = index if isinstance(index, tuple) else (index,)
    value = facts.example_value(buffer)
    sizes = []
    for d, size in enumerate(int(n) for n in value.shape):
        stop = index[d].stop if d < len(index) else None
        if stop is None:
            sizes.append(size)
        elif isinstance(stop, int):
            sizes.append(min(stop, size))
        elif not facts.is_per_step(stop, steps):
            sizes.append(stop)  # the batch size on dim 0: past the buffer, as_strided raises
        else:
            clamped = add("call_function", torch.sym_min, stop, size)  # its value without a guard
            clamped.target = min  # what runs: eagerly, on ints
            sizes.append(clamped)
    strided = add("call_function", torch.as_strided, buffer, sizes, tuple(value.stride()))
    view.replace_all_uses_with(strided)
    view.graph.erase_node(view)
    return strided
