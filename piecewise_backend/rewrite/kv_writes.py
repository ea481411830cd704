"""KV-cache writes at a per-step position, moved into the captured graphs.

``cache[:B, :, pos:pos + S] = k`` writes a fixed-address buffer at an offset that changes every
decode step. As written it cannot be captured (a graph would write the captured step's offset
forever), so it used to run eagerly: two small copy kernels per layer, launched from Python, which
on the H200 machine cost ~9 µs of host time each: a third of a 16-layer step's host time.

vLLM's answer is a device-side slot mapping. This module is ours, done automatically on the
graph: each such write becomes ``cache.index_put_(indices, where(mask, k, old))`` whose position
is read from a small device tensor, the *step scalars*, that the compiled graph refreshes once per
call (one ``fill_`` launch, and none for values that did not change). The write then sits in
the compute piece that made ``k``, Inductor fuses it into that piece's kernels, and it replays
with the graph.

The mask keeps the rewrite exactly as safe as the eager write:

* a batch padded from 5 to 8 rows writes rows 5..7 back with their old contents (the slots hold
  the caller's real sizes), so padding stays allowed;
* up-front capture (which runs compute pieces on made-up inputs) sets the *enable* slot to 0, so
  it writes every element back unchanged;
* positions are checked on the host against the buffer's size before anything runs, with an
  error that says which write and why (a device-side index error would kill the CUDA context).

A graph whose tensors all have fixed sizes (no dynamic batch: nothing is padded, nothing is
captured up front, every run is a real call's) writes *unmasked*, ``cache.index_put_(indices, k)``:
the write is then idempotent like the eager one, and it costs one kernel fused with the one that
made ``k``, where the masked form costs two (Inductor computes values that read the buffer they are
written to in a kernel of their own, then scatters them; seen on the H200, torch 2.11). Its step
scalars then refuse ``writes_disabled`` rather than let made-up inputs write.

The graph-safe form, ``cache[:B].index_copy_(2, cache_position, k)`` (full mode), gets the same
rewrite with ``cache_position`` itself as the index. It already replays in the graph, but through
a view of a graph input, which Inductor can only do by copying ``cache[:B]`` out and back each step
(the whole cache at batch 32); ``index_put_`` on the buffer writes the new rows in place. And being
masked, it lets full mode pad and capture up front.

Only writes of these exact shapes are rewritten: into a parameter/buffer, or into an input whose
every write has one of them (a cache the caller passes: ``kv_written_inputs``); through plain
slices, one that starts at a per-step Python int and is as long as the value, the others full or
prefixes, written by setitem or by ``copy_`` into that view, or by ``index_copy_`` on a full/prefix
slice of the buffer. Any other write to the same buffer leaves all of that buffer's writes as they
were.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .._torch_internals import sym_expr
from ..fx import graph_facts as facts
from .graph_edit import Builder, Dim, Idiom, SharedNodes, Site, indices, slice_dim, slice_dims, step_dims_bounds


def _index_copy_dims(view: torch.fx.Node, buffer: torch.fx.Node, args: tuple, steps: frozenset, placeholders: dict):
    """The indexed dims of ``buffer[slices].index_copy_(dim, index, value)`` in our form, or None."""
    if len(args) != 4 or not isinstance(args[1], int) or not isinstance(args[2], torch.fx.Node):
        return None
    buffer_value, value = facts.example_value(buffer), facts.example_value(args[3])
    index = facts.example_value(args[2])
    if (
        not isinstance(value, torch.Tensor)
        or value.dim() != buffer_value.dim()
        or not isinstance(index, torch.Tensor)
        or index.dim() != 1
    ):
        return None
    if view is buffer:
        slices = ()
    elif view.op == "call_function" and view.target is operator.getitem and view.args[0] is buffer:
        slices = view.args[1] if isinstance(view.args[1], tuple) else (view.args[1],)
    else:
        return None
    dim = args[1] % buffer_value.dim()
    slices = slices + (slice(None),) * (dim + 1 - len(slices))
    dims = [slice_dim(s, d, buffer_value, steps, placeholders) for d, s in enumerate(slices)]
    if None in dims or dims[dim][0] != Dim.FULL:
        return None
    dims[dim] = (Dim.INDEX, args[2])
    return tuple(dims)


def _write_dims(
    node: torch.fx.Node, written: torch.fx.Node, buffer: torch.fx.Node, steps: frozenset, placeholders: dict
):
    """(dims, value) of a write in one of our forms, else (None, None)."""
    if node.op == "call_function" and node.target is operator.setitem and written is buffer:
        _, index, value = node.args
        value_fake = facts.example_value(value) if isinstance(value, torch.fx.Node) else None
        return slice_dims(facts.example_value(buffer), value_fake, index, steps, placeholders), value
    if node.op == "call_method" and node.target == "index_copy_" and not node.kwargs:
        return _index_copy_dims(written, buffer, node.args, steps, placeholders), node.args[-1]
    if node.op == "call_method" and node.target == "copy_" and len(node.args) == 2 and not node.kwargs:
        return _copy_dims(written, buffer, node.args[1], steps, placeholders), node.args[1]
    return None, None


def _shape(value: torch.Tensor) -> list:
    """Sizes as expressions: compared without guarding on the symbols."""
    return [sym_expr(s) for s in value.shape]


def _copy_dims(view: torch.fx.Node, buffer: torch.fx.Node, value, steps: frozenset, placeholders: dict):
    """The indexed dims of ``buffer[index].copy_(value)`` in our form, or None. ``copy_`` broadcasts,
    so the view must have exactly the value's shape (a write as long as the value)."""
    if not (
        isinstance(value, torch.fx.Node)
        and view.op == "call_function"
        and view.target is operator.getitem
        and view.args[0] is buffer
    ):
        return None
    view_value, value_value = facts.example_value(view), facts.example_value(value)
    if not isinstance(value_value, torch.Tensor) or _shape(view_value) != _shape(value_value):
        return None
    return slice_dims(facts.example_value(buffer), value_value, view.args[1], steps, placeholders)


def find_kv_writes(graph: torch.fx.Graph, static_names: set[str], steps: frozenset) -> list[Site]:
    """The writes to rewrite: every write to a buffer must qualify, or none of that buffer's do."""
    placeholders = {n: i for i, n in enumerate(facts.placeholders(graph))}
    roots = facts.alias_roots(graph)
    sites: dict = {}
    disqualified: set = set()
    for node in graph.nodes:
        for written in facts.mutated_inputs(node):
            buffer = roots[written]
            dims = value = None
            if buffer.op == "placeholder" and buffer.name in static_names and not node.users:
                dims, value = _write_dims(node, written, buffer, steps, placeholders)
            if dims is None:
                disqualified.add(buffer)
            else:
                sites.setdefault(buffer, []).append(Site(node, buffer, value, dims))
    return [s for buffer, group in sites.items() if buffer not in disqualified for s in group]


def kv_written_inputs(graph: torch.fx.Graph, steps: frozenset) -> frozenset[str]:
    """Names of the graph inputs whose every write is one of ours: a cache the caller passes in,
    written like a buffer (``cache[:B].index_copy_(2, pos, k)``, ``cache[:, :, t:t+1] = k``). Used
    at their own address like the parameters/buffers (``backend._rewrite``), their writes get the
    same masked rewrite, so they replay in the graph, padded or not."""
    placeholders = frozenset(n.name for n in facts.placeholders(graph))
    return frozenset(site.buffer.name for site in find_kv_writes(graph, placeholders, steps))


def rewrite_kv_write(
    site: Site, scalars: torch.fx.Node, slot_of: dict, fake_mode, shared: SharedNodes, masked: bool = True
) -> dict:
    """Rewrite one write (its index tensors reused from ``shared``); returns the nodes that read or
    write the buffer (the masked form's gather and put, the unmasked form's put), each with the
    (buffer, dim) pairs it reads or writes by batch row (its prefix dims that stop at a graph value:
    ``cache[:B]``). ``masked=False``: the unmasked form (see the module docstring), unless the write
    stops at the caller's rows, which is always masked."""
    graph = site.node.graph
    buffer_value = facts.example_value(site.buffer)
    value = site.value
    rows = tuple(
        (site.buffer, d)
        for d, dim in enumerate(site.dims)
        if dim[0] == Dim.PREFIX and isinstance(dim[1], torch.fx.Node)
    )
    add = Builder(graph, site.node, fake_mode, shared)
    where, mask = indices(site, scalars, slot_of, add, masked=masked or bool(rows))
    if facts.example_value(value).dtype != buffer_value.dtype:
        value = add("call_method", "to", value, buffer_value.dtype)
    reads = {}
    if mask is not None:
        old = add("call_function", operator.getitem, site.buffer, where)
        value = add("call_function", torch.where, mask, value, old)
        reads[old] = rows
    put = add("call_method", "index_put_", site.buffer, where, value)
    view = site.node.args[0]
    graph.erase_node(site.node)
    if view is not site.buffer and not view.users:  # index_copy_'s view of the buffer, now unused
        graph.erase_node(view)
    return {**reads, put: rows}


KV_WRITES = Idiom(
    "KV writes",
    lambda writes, attention: writes,
    find_kv_writes,
    lambda site, slots: step_dims_bounds(site, slots, "the write into"),
    lambda site, c: rewrite_kv_write(site, c.scalars, c.slot_of, c.fake_mode, c.shared, c.masked),
)
