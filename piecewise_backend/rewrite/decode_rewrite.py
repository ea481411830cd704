"""The decode rewrite: one pass over Dynamo's graph that makes a decode step graph-safe.

A decode step's per-step Python ints (the KV position ``pos``) would force everything that uses
them to run eagerly, or a recapture every step. This pass finds the uses it knows, adds one graph
input, the step scalars (``step_scalars.py``), and rewrites each use to read its int from there:

1. KV-cache writes at ``pos`` become ``index_put_`` in the compute pieces (``kv_writes.py``), masked
   unless every tensor input has fixed sizes;
2. decode attention over ``cache[:B, :, :pos + 1]`` becomes the graph-safe ``prefix_attention``
   (``graph_attention.py``);
3. RoPE-style reads ``cos[pos:pos + S]`` become in-graph gathers (``rope_reads.py``), and position
   ranges ``arange(pos, pos + S)`` in-graph ranges (``step_ranges.py``);
4. the eager attention's remaining cache slices become one ``as_strided`` each (``prefix_views.py``).

It returns a copy of the graph (Dynamo reads its own graph's inputs after the backend returns) and
what the rest of the backend needs to know: the step scalars to refresh per call, the buffers
whose writes moved into graphs, and the nodes that read or write by batch row (their row counts cap
padding, ``row_independence.py``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from .. import _torch_internals
from ..fx import graph_facts as facts
from .graph_attention import GRAPH_ATTENTION
from .graph_edit import Builder, RewriteContext, SharedNodes
from .kv_writes import KV_WRITES
from .prefix_views import find_prefix_views, rewrite_prefix_view
from .rope_reads import ROPE_READS
from .step_ranges import STEP_RANGES
from .step_scalars import PLACEHOLDER, Slot, Slots, example_tensor


@dataclasses.dataclass(frozen=True)
class Rewrite:
    graph_module: torch.fx.GraphModule  # a copy of the input with the uses rewritten
    slots: tuple[Slot, ...]  # the step scalars it reads (after the enable flag)
    device: torch.device  # where the step-scalar tensor lives (the first rewritten buffer's)
    writes_masked: bool  # the rewritten writes honour the enable flag (kv_writes.py)
    buffers: frozenset  # names of the buffers whose writes now run in compute pieces
    # the nodes the rewrites built that read or write a buffer by batch row (the KV writes' gathers
    # and puts, masked to the caller's rows; graph attention), each with its (buffer, dim) pairs:
    # row-wise by construction, but a padded batch may not exceed those buffers' rows
    row_access: dict
    attention: int = 0  # SDPA calls replaced by graph-safe ``prefix_attention``
    prefix_views: int = 0  # eager cache slices taken with ``as_strided``


#: The idioms the rewrite knows, in the order their sites are rewritten (``graph_edit.Idiom``): a new
#: decode idiom is a module that defines one, and its entry here.
IDIOMS = (KV_WRITES, ROPE_READS, STEP_RANGES, GRAPH_ATTENTION)


def _find(graph: torch.fx.Graph, static_names: set[str], steps: frozenset, writes: bool, attention: bool) -> dict:
    """Every idiom's sites (an idiom these options do not ask for: none)."""
    return {
        idiom: idiom.find(graph, static_names, steps) if idiom.wanted(writes, attention) else [] for idiom in IDIOMS
    }


def _bounds(graph: torch.fx.Graph, sites: dict) -> Slots:
    """One slot per (per-step input, constant) the rewritten nodes read, with the range they allow."""
    slots = Slots(graph)
    for idiom, found in sites.items():
        for site in found:
            idiom.bounds(site, slots)
    return slots


def _add_scalars_input(graph: torch.fx.Graph, example: torch.Tensor, fake_mode) -> torch.fx.Node:
    with graph.inserting_after(facts.placeholders(graph)[-1]):
        node = graph.placeholder(PLACEHOLDER)
    with _torch_internals.fake_propagation(fake_mode):
        node.meta["example_value"] = fake_mode.from_tensor(example, static_shapes=True)
    return node


def _fixed_sizes(graph: torch.fx.Graph) -> bool:
    """Does every tensor input have fixed sizes? Then the graph has no dynamic batch: it is never
    padded nor captured up front on made-up inputs, and its KV writes need no mask (``kv_writes.py``)."""
    values = (facts.example_value(n) for n in facts.placeholders(graph))
    return not any(facts.value_symbols(tuple(v.shape)) for v in values if isinstance(v, torch.Tensor))


def _rewrite_sites(sites: dict, context: RewriteContext) -> dict:
    """Rewrite every site; returns the row access of the nodes built (see :class:`Rewrite`)."""
    row_access = {}
    for idiom, found in sites.items():
        for site in found:
            row_access.update(idiom.rewrite(site, context))
    return row_access


def _drop_orphaned_scalars(graph: torch.fx.Graph) -> None:
    """Scalar arithmetic (``pos + 1``) left without users by the rewrites: it would be an eager piece
    of its own, doing nothing."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and facts.is_sym_node(node):
            graph.erase_node(node)


def rewrite_decode(
    gm: torch.fx.GraphModule, static_names: set[str], writes: bool = True, attention: bool = False
) -> Rewrite | None:
    """A copy of ``gm`` with the qualifying KV writes (``writes``) and decode attention calls
    (``attention``) rewritten; None if there are none.

    The copy has one more graph input, :data:`PLACEHOLDER`, after the others: the caller passes
    the step scalars (``runtime/step_scalars.py``) after ``args``.
    """
    steps = facts.step_symbols(gm.graph)
    found = _find(gm.graph, static_names, steps, writes, attention)
    if not (found[KV_WRITES] or found[GRAPH_ATTENTION]):
        return None
    gm = _torch_internals.copy_graph_module(gm)
    graph = gm.graph
    sites = _find(graph, static_names, steps, writes, attention)  # the same sites, in the copy
    kv_writes, attention_sites = sites[KV_WRITES], sites[GRAPH_ATTENTION]
    slots = _bounds(graph, sites)
    first = kv_writes[0].buffer if kv_writes else attention_sites[0].buffers[0]
    buffer_value = facts.example_value(first)
    masked = not _fixed_sizes(graph)
    fake_mode = buffer_value.fake_mode
    node = _add_scalars_input(graph, example_tensor(slots.slots, buffer_value.device), fake_mode)
    row_access = _rewrite_sites(sites, RewriteContext(node, slots.index, fake_mode, SharedNodes(graph), masked))
    views = find_prefix_views(graph, static_names, steps)  # the eager attention's cache slices, made cheaper
    for view in views:
        rewrite_prefix_view(view, steps, Builder(graph, view, fake_mode))
    _drop_orphaned_scalars(graph)
    graph.lint()
    gm.recompile()
    return Rewrite(
        gm,
        tuple(slots.slots),
        buffer_value.device,
        masked,
        frozenset(s.buffer.name for s in kv_writes),
        row_access,
        len(attention_sites),
        len(views),
    )
