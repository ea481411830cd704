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
import operator

import torch
import torch.fx

from .. import _torch_internals
from ..fx import graph_facts as facts
from .graph_attention import AttentionSite, find_attention_sites, rewrite_attention
from .graph_edit import Builder, Dim, SharedNodes, Site
from .kv_writes import find_kv_writes, rewrite_kv_write
from .prefix_views import find_prefix_views, rewrite_prefix_view
from .rope_reads import find_reads, rewrite_read
from .step_ranges import UNBOUNDED, RangeSite, find_step_ranges, rewrite_step_range
from .step_scalars import PLACEHOLDER, Slots, StepScalars


@dataclasses.dataclass(frozen=True)
class Rewrite:
    graph_module: torch.fx.GraphModule  # a copy of the input with the uses rewritten
    scalars: StepScalars
    buffers: frozenset  # names of the buffers whose writes now run in compute pieces
    # the nodes the rewrites built that read or write a buffer by batch row (the KV writes' gathers
    # and puts, masked to the caller's rows; graph attention), each with its (buffer, dim) pairs:
    # row-wise by construction, but a padded batch may not exceed those buffers' rows
    row_access: dict
    attention: int = 0  # SDPA calls replaced by graph-safe ``prefix_attention``
    prefix_views: int = 0  # eager cache slices taken with ``as_strided``


@dataclasses.dataclass
class _Sites:
    writes: list[Site]
    attention: list[AttentionSite]
    reads: list[Site]
    ranges: list[RangeSite]

    @classmethod
    def find(cls, graph: torch.fx.Graph, static_names: set[str], steps: frozenset, writes: bool,
             attention: bool) -> "_Sites":
        return cls(find_kv_writes(graph, static_names, steps) if writes else [],
                   find_attention_sites(graph, static_names, steps) if attention else [],
                   find_reads(graph, static_names, steps) if writes or attention else [],
                   find_step_ranges(graph, steps) if writes or attention else [])


def _bounds(graph: torch.fx.Graph, sites: _Sites) -> Slots:
    """One slot per (per-step input, constant) the rewritten nodes read, with the range they allow."""
    slots = Slots(graph)
    for site in sites.reads:
        for d, dim in enumerate(site.dims):
            if dim[0] == Dim.STEP:
                slots.need(dim[1], 0, 0, int(facts.example_value(site.buffer).shape[d]) - dim[2],
                           f"the read of {site.buffer.name} at dim {d}")
    for site in sites.writes:
        shape = facts.example_value(site.buffer).shape
        for d, dim in enumerate(site.dims):
            what = f"the write into {site.buffer.name} at dim {d}"
            if dim[0] == Dim.STEP:
                slots.need(dim[1], 0, 0, int(shape[d]) - dim[2], what)
            elif dim[0] == Dim.PREFIX and isinstance(dim[1], torch.fx.Node):
                slots.need(dim[1], 0, 0, int(shape[d]), what)
    for site in sites.attention:
        slots.need(*site.length, 1, site.size, f"the attention over {site.buffers[0].name}")
    for site in sites.ranges:
        slots.need(site.start, 0, *UNBOUNDED, f"the range from {site.start.name}")
    return slots


def _add_scalars_input(graph: torch.fx.Graph, scalars: StepScalars, fake_mode) -> torch.fx.Node:
    with graph.inserting_after(facts.placeholders(graph)[-1]):
        node = graph.placeholder(PLACEHOLDER)
    with _torch_internals.fake_propagation(fake_mode):
        node.meta["example_value"] = fake_mode.from_tensor(scalars.tensor, static_shapes=True)
    return node


def _fixed_sizes(graph: torch.fx.Graph) -> bool:
    """Does every tensor input have fixed sizes? Then the graph has no dynamic batch: it is never
    padded nor captured up front on made-up inputs, and its KV writes need no mask (``kv_writes.py``)."""
    values = (facts.example_value(n) for n in facts.placeholders(graph))
    return not any(facts.value_symbols(tuple(v.shape)) for v in values if isinstance(v, torch.Tensor))


def _rewrite_sites(graph: torch.fx.Graph, sites: _Sites, scalars: torch.fx.Node, slot_of: dict, fake_mode,
                   masked: bool) -> dict:
    """Rewrite every site (the KV writes ``masked`` or not); returns the row access of the nodes built
    (see :class:`Rewrite`)."""
    row_access = {}
    shared = SharedNodes(graph)  # index tensors and lengths, built once for every layer
    for site in sites.writes:
        row_access.update(rewrite_kv_write(site, scalars, slot_of, fake_mode, shared, masked))
    for site in sites.reads:
        rewrite_read(site, scalars, slot_of, fake_mode, shared)
    for site in sites.ranges:
        rewrite_step_range(site, scalars, slot_of, fake_mode)
    for site in sites.attention:
        add = Builder(graph, site.node, fake_mode, shared)
        position, constant = site.length  # one length node for every layer (Inductor kept 16 adds as 16 kernels)
        length = add.once("call_function", operator.getitem, scalars, slot_of[position])
        attention = rewrite_attention(site, add.once("call_function", operator.add, length, constant) if constant
                                      else length, add)
        row_access[attention] = tuple((buffer, 0) for buffer in site.buffers) + (  # it reads ``cache[:B]``
            ((site.mask, 0),) if site.mask is not None and facts.example_value(site.mask).shape[0] != 1 else ())
    return row_access


def _drop_orphaned_scalars(graph: torch.fx.Graph) -> None:
    """Scalar arithmetic (``pos + 1``) left without users by the rewrites: it would be an eager piece
    of its own, doing nothing."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and facts.is_sym_node(node):
            graph.erase_node(node)


def rewrite_decode(gm: torch.fx.GraphModule, static_names: set[str], writes: bool = True,
                   attention: bool = False) -> Rewrite | None:
    """A copy of ``gm`` with the qualifying KV writes (``writes``) and decode attention calls
    (``attention``) rewritten; None if there are none.

    The copy has one more graph input, :data:`PLACEHOLDER`, after the others: the caller passes
    ``rewrite.scalars.refresh(args)`` instead of ``args``.
    """
    steps = facts.step_symbols(gm.graph)
    found = _Sites.find(gm.graph, static_names, steps, writes, attention)
    if not (found.writes or found.attention):
        return None
    gm = _torch_internals.copy_graph_module(gm)
    graph = gm.graph
    sites = _Sites.find(graph, static_names, steps, writes, attention)  # the same sites, in the copy
    slots = _bounds(graph, sites)
    first = sites.writes[0].buffer if sites.writes else sites.attention[0].buffers[0]
    buffer_value = facts.example_value(first)
    masked = not _fixed_sizes(graph)
    scalars = StepScalars(slots.slots, buffer_value.device, writes_masked=masked)
    fake_mode = buffer_value.fake_mode
    node = _add_scalars_input(graph, scalars, fake_mode)
    row_access = _rewrite_sites(graph, sites, node, slots.index, fake_mode, masked)
    views = find_prefix_views(graph, static_names, steps)  # the eager attention's cache slices, made cheaper
    for view in views:
        rewrite_prefix_view(view, steps, Builder(graph, view, fake_mode))
    _drop_orphaned_scalars(graph)
    graph.lint()
    gm.recompile()
    return Rewrite(gm, scalars, frozenset(s.buffer.name for s in sites.writes), row_access, len(sites.attention),
                   len(views))
