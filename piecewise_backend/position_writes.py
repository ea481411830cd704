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

The graph-safe form, ``cache[:B].index_copy_(2, cache_position, k)`` (full mode), gets the same
rewrite with ``cache_position`` itself as the index. It already replays in the graph, but through
a view of a graph input, which Inductor can only do by copying ``cache[:B]`` out and back each step
(the whole cache at batch 32); ``index_put_`` on the buffer writes the new rows in place. And being
masked, it lets full mode pad and capture up front.

Only writes of these exact shapes are rewritten (a parameter/buffer; plain slices, one that starts
at a per-step Python int and is as long as the value, the others full or prefixes; or
``index_copy_`` on a full/prefix slice of the buffer); any other write to the same buffer leaves
all of that buffer's writes as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator

import torch
import torch.fx

from . import _torch_internals
from . import graph_facts as facts
from .graph_attention import find_attention_sites, rewrite_attention
from .prefix_views import find_prefix_views, rewrite_prefix_view

PLACEHOLDER = "piecewise_step_scalars"
_ENABLE = 0  # slot 0: 1 = write, 0 = write every element back unchanged (up-front capture)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One step scalar: which graph input feeds it and what it must satisfy."""

    arg: int  # position of the SymInt graph input
    name: str
    low: int  # value must be >= low ...
    high: int  # ... and <= high
    what: str  # the write it guards, for the error message
    offset: int = 0  # the slot holds the input plus this (an attention length: pos + 1)


@dataclasses.dataclass(frozen=True)
class _Site:
    node: torch.fx.Node  # the write: a setitem, or an index_copy_
    buffer: torch.fx.Node
    value: torch.fx.Node  # what it writes
    # per indexed dim: ("full", size) | ("prefix", int or placeholder) | ("step", placeholder, n)
    # | ("index", index tensor node)
    dims: tuple


def _dim(s, d: int, buffer_value: torch.Tensor, steps: frozenset, placeholders: dict):
    """A full or prefix slice of dim ``d`` in our supported form, or None."""
    if not isinstance(s, slice) or s.step is not None or s.start is not None:
        return None
    if s.stop is None:
        return ("full", int(buffer_value.shape[d]))
    if isinstance(s.stop, int) or (s.stop in placeholders and not facts.is_per_step(s.stop, steps)):
        return ("prefix", s.stop)
    return None


def _slice_dims(buffer_value: torch.Tensor, value, index, steps: frozenset, placeholders: dict):
    """The indexed dims of ``buffer[index] = value`` in our supported form, or None."""
    index = index if isinstance(index, tuple) else (index,)
    if not index or len(index) > buffer_value.dim() or not isinstance(value, torch.Tensor) \
            or value.dim() != buffer_value.dim():
        return None
    dims, step_dims = [], 0
    for d, s in enumerate(index):
        start = s.start if isinstance(s, slice) else None
        if isinstance(start, torch.fx.Node) and facts.is_per_step(start, steps):
            n = value.shape[d]
            if s.step is not None or start not in placeholders or not isinstance(n, int):
                return None
            dims.append(("step", start, n))
            step_dims += 1
        else:
            dims.append(_dim(s, d, buffer_value, steps, placeholders))
    return tuple(dims) if step_dims == 1 and None not in dims else None


def _index_copy_dims(view: torch.fx.Node, buffer: torch.fx.Node, args: tuple, steps: frozenset,
                     placeholders: dict):
    """The indexed dims of ``buffer[slices].index_copy_(dim, index, value)`` in our form, or None."""
    if len(args) != 4 or not isinstance(args[1], int) or not isinstance(args[2], torch.fx.Node):
        return None
    buffer_value, value = facts.example_value(buffer), facts.example_value(args[3])
    index = facts.example_value(args[2])
    if not isinstance(value, torch.Tensor) or value.dim() != buffer_value.dim() \
            or not isinstance(index, torch.Tensor) or index.dim() != 1:
        return None
    if view is buffer:
        slices = ()
    elif view.op == "call_function" and view.target is operator.getitem and view.args[0] is buffer:
        slices = view.args[1] if isinstance(view.args[1], tuple) else (view.args[1],)
    else:
        return None
    dim = args[1] % buffer_value.dim()
    slices = slices + (slice(None),) * (dim + 1 - len(slices))
    dims = [_dim(s, d, buffer_value, steps, placeholders) for d, s in enumerate(slices)]
    if None in dims or dims[dim][0] != "full":
        return None
    dims[dim] = ("index", args[2])
    return tuple(dims)


def find_sites(graph: torch.fx.Graph, static_inputs: set[str], steps: frozenset) -> list[_Site]:
    """The writes to rewrite: every write to a buffer must qualify, or none of that buffer's do."""
    placeholders = {n: i for i, n in enumerate(facts.placeholders(graph))}
    roots = facts.alias_roots(graph)
    sites: dict = {}
    disqualified: set = set()
    for node in graph.nodes:
        for written in facts.mutated_inputs(node):
            buffer = roots[written]
            dims = value = None
            if buffer.op == "placeholder" and buffer.name in static_inputs and not node.users:
                if node.op == "call_function" and node.target is operator.setitem and written is buffer:
                    _, index, value = node.args
                    dims = _slice_dims(facts.example_value(buffer), facts.example_value(value)
                                       if isinstance(value, torch.fx.Node) else None, index, steps, placeholders)
                elif node.op == "call_method" and node.target == "index_copy_" and not node.kwargs:
                    value = node.args[-1]
                    dims = _index_copy_dims(written, buffer, node.args, steps, placeholders)
            if dims is None:
                disqualified.add(buffer)
            else:
                sites.setdefault(buffer, []).append(_Site(node, buffer, value, dims))
    return [s for buffer, group in sites.items() if buffer not in disqualified for s in group]


class StepScalars:
    """The device tensor the rewritten writes read their positions and real sizes from."""

    def __init__(self, slots: list[_Slot], device: torch.device):
        self.slots = slots
        with torch.inference_mode(False):  # a normal tensor: filled in place under any grad mode
            self.tensor = torch.ones(1 + len(slots), dtype=torch.int64, device=device)
            self._views = [self.tensor[j] for j in range(1 + len(slots))]
        self._last: list = [None] * len(slots)

    def refresh(self, args: tuple) -> tuple:
        """Check this call's positions, write the changed ones to the device; ``args`` + the tensor.

        All are checked before any is written: a refused call leaves the device tensor as it was.
        """
        values = [args[slot.arg] + slot.offset for slot in self.slots]
        if values != self._last:
            for slot, value in zip(self.slots, values):
                if not slot.low <= value <= slot.high:
                    name = slot.name + (f" + {slot.offset}" if slot.offset else "")
                    raise IndexError(f"piecewise: {slot.what} needs {slot.low} <= {name} <= {slot.high}; got "
                                     f"{name} = {value}. It would reach outside the buffer (eager PyTorch "
                                     f"raises a shape error here too): make the buffer larger or stop before "
                                     f"its end.")
            for j, (value, old) in enumerate(zip(values, self._last)):
                if value != old:
                    self._views[1 + j].fill_(value)
            self._last = values
        return (*args, self.tensor)

    @contextlib.contextmanager
    def writes_disabled(self):
        """Rewritten writes put back what they read (for runs on made-up inputs)."""
        self._views[_ENABLE].fill_(0)
        try:
            yield
        finally:
            self._views[_ENABLE].fill_(1)


class _Builder:
    """Appends nodes before ``anchor``, each with its fake value (the split pass reads them)."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node, fake_mode):
        self.graph, self.anchor, self.fake_mode = graph, anchor, fake_mode

    def __call__(self, op: str, target, *args, **kwargs) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, args, kwargs)
        values = torch.fx.node.map_arg((args, kwargs), facts.example_value)
        with _torch_internals.fake_propagation(self.fake_mode):
            if op == "call_method":
                value = getattr(values[0][0], target)(*values[0][1:], **values[1])
            else:
                value = target(*values[0], **values[1])
        node.meta["example_value"] = value
        return node


def _indices(site: _Site, scalars: torch.fx.Node, slot_of: dict, add, masked: bool):
    """The index tensors that address ``site``'s elements of its buffer, and (when ``masked``) the
    mask of those a write may change: enabled, and within the caller's rows."""
    buffer_value = facts.example_value(site.buffer)
    device, ndim = buffer_value.device, buffer_value.dim()
    mask = add("call_function", operator.ne, add("call_function", operator.getitem, scalars, _ENABLE), 0) \
        if masked else None
    indices, last = [], len(site.dims) - 1
    for d, dim in enumerate(site.dims):
        shape = [1] * (last + 1)
        shape[d] = -1
        if dim[0] == "index":  # index_copy_'s own index tensor
            indices.append(add("call_method", "view", dim[1], shape))
            continue
        size = dim[1] if dim[0] != "step" else dim[2]
        rows = add("call_function", torch.arange, size, device=device)
        if dim[0] == "step":
            start = add("call_function", operator.getitem, scalars, slot_of[(dim[1], 0)])
            rows = add("call_function", operator.add, rows, start)
        elif dim[0] == "prefix" and isinstance(dim[1], torch.fx.Node) and masked:
            limit = add("call_function", operator.getitem, scalars, slot_of[(dim[1], 0)])
            keep = add("call_function", operator.lt, rows, limit)
            full_shape = [1] * ndim
            full_shape[d] = -1
            mask = add("call_function", operator.and_, mask, add("call_method", "view", keep, full_shape))
        indices.append(add("call_method", "view", rows, shape))
    return tuple(indices), mask


def _rewrite_site(site: _Site, scalars: torch.fx.Node, slot_of: dict, fake_mode) -> dict:
    """Rewrite one write; returns its gather and its put, each with the (buffer, dim) pairs it reads or
    writes by batch row (its prefix dims that stop at a graph value: ``cache[:B]``)."""
    graph = site.node.graph
    buffer_value = facts.example_value(site.buffer)
    value = site.value
    add = _Builder(graph, site.node, fake_mode)
    indices, mask = _indices(site, scalars, slot_of, add, masked=True)
    old = add("call_function", operator.getitem, site.buffer, indices)
    if facts.example_value(value).dtype != buffer_value.dtype:
        value = add("call_method", "to", value, buffer_value.dtype)
    new = add("call_function", torch.where, mask, value, old)
    put = add("call_method", "index_put_", site.buffer, indices, new)
    view = site.node.args[0]
    graph.erase_node(site.node)
    if view is not site.buffer and not view.users:  # index_copy_'s view of the buffer, now unused
        graph.erase_node(view)
    rows = tuple((site.buffer, d) for d, dim in enumerate(site.dims)
                 if dim[0] == "prefix" and isinstance(dim[1], torch.fx.Node))
    return {old: rows, put: rows}


def find_reads(graph: torch.fx.Graph, static_inputs: set[str], steps: frozenset) -> list[_Site]:
    """Slices of never-written buffers at a per-step position (``cos[pos:pos + S]``), whose users
    only read them: an in-graph gather gives the same values, and the eager slice and its copy into
    every graph that reads it go away."""
    placeholders = {n: i for i, n in enumerate(facts.placeholders(graph))}
    roots = facts.alias_roots(graph)
    written = {roots[m] for n in graph.nodes for m in facts.mutated_inputs(n)}
    sites = []
    for node in graph.nodes:
        if not (node.op == "call_function" and node.target is operator.getitem and node.users):
            continue
        buffer, index = node.args
        if not (isinstance(buffer, torch.fx.Node) and buffer.op == "placeholder" and buffer.name in static_inputs
                and buffer not in written and not any(facts.mutated_inputs(u) for u in node.users)):
            continue
        dims = _slice_dims(facts.example_value(buffer), facts.example_value(node), index, steps, placeholders)
        if dims is not None:
            sites.append(_Site(node, buffer, None, dims))
    return sites


def _drop_orphaned_scalars(graph: torch.fx.Graph) -> None:
    """Scalar arithmetic (``pos + 1``) left without users by the rewrites: it would be an eager piece
    of its own, doing nothing."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and facts.is_sym_node(node):
            graph.erase_node(node)


def _rewrite_read(site: _Site, scalars: torch.fx.Node, slot_of: dict, fake_mode) -> None:
    add = _Builder(site.node.graph, site.node, fake_mode)
    indices, _ = _indices(site, scalars, slot_of, add, masked=False)
    site.node.replace_all_uses_with(add("call_function", operator.getitem, site.buffer, indices))
    site.node.graph.erase_node(site.node)


@dataclasses.dataclass
class Rewrite:
    graph_module: torch.fx.GraphModule  # a copy of the input with the writes rewritten
    scalars: StepScalars
    buffers: frozenset  # names of the buffers whose writes now run in compute pieces
    # the nodes the rewrites built that read or write a buffer by batch row (the KV writes' gathers
    # and puts, masked to the caller's rows; graph attention), each with its (buffer, dim) pairs:
    # row-wise by construction, but a padded batch may not exceed those buffers' rows
    row_access: dict
    attention: int = 0  # SDPA calls replaced by graph-safe ``prefix_attention`` (graph_attention.py)
    prefix_views: int = 0  # eager cache slices taken with ``as_strided`` (prefix_views.py)


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A graph module over a copy of ``gm``'s graph (nodes keep their meta).

    Dynamo reads its own graph's placeholders after the backend returns, so a backend that adds
    an input must add it to a copy.
    """
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


class _Slots:
    """Step scalars by (graph input, constant added), with the tightest bounds any user needs."""

    def __init__(self, graph: torch.fx.Graph):
        self.position = {n: i for i, n in enumerate(facts.placeholders(graph))}
        self.slots: list[_Slot] = []
        self.index: dict = {}  # (placeholder, offset) -> index in the device tensor (0 is the enable flag)

    def need(self, node: torch.fx.Node, offset: int, low: int, high: int, what: str) -> None:
        key = (node, offset)
        if key in self.index:
            j = self.index[key] - 1
            old = self.slots[j]
            self.slots[j] = dataclasses.replace(old, low=max(old.low, low), high=min(old.high, high),
                                                what=old.what if old.high <= high else what)
        else:
            self.slots.append(_Slot(self.position[node], node.name, low, high, what, offset))
            self.index[key] = len(self.slots)


def rewrite_writes(gm: torch.fx.GraphModule, static_inputs: set[str], writes: bool = True,
                   attention: bool = False) -> Rewrite | None:
    """A copy of ``gm`` with the qualifying KV writes (``writes``) and decode attention calls
    (``attention``, see graph_attention.py) rewritten; None if there are none.

    The copy has one more graph input, :data:`PLACEHOLDER`, after the others: the caller passes
    ``rewrite.scalars.refresh(args)`` instead of ``args``.
    """
    steps = facts.step_symbols(gm.graph)

    def sites_of(graph):
        return (find_sites(graph, static_inputs, steps) if writes else [],
                find_attention_sites(graph, static_inputs, steps) if attention else [],
                find_reads(graph, static_inputs, steps) if writes or attention else [])

    if not any(sites_of(gm.graph)[:2]):
        return None
    gm = _copy(gm)
    graph = gm.graph
    sites, attention_sites, reads = sites_of(graph)
    slots = _Slots(graph)
    for site in reads:
        for d, dim in enumerate(site.dims):
            if dim[0] == "step":
                slots.need(dim[1], 0, 0, int(facts.example_value(site.buffer).shape[d]) - dim[2],
                           f"the read of {site.buffer.name} at dim {d}")
    for site in sites:
        shape = facts.example_value(site.buffer).shape
        for d, dim in enumerate(site.dims):
            what = f"the write into {site.buffer.name} at dim {d}"
            if dim[0] == "step":
                slots.need(dim[1], 0, 0, int(shape[d]) - dim[2], what)
            elif dim[0] == "prefix" and isinstance(dim[1], torch.fx.Node):
                slots.need(dim[1], 0, 0, int(shape[d]), what)
    for site in attention_sites:
        slots.need(*site.length, 1, site.size, f"the attention over {site.buffers[0].name}")
    first = sites[0].buffer if sites else attention_sites[0].buffers[0]
    buffer_value = facts.example_value(first)
    scalars = StepScalars(slots.slots, buffer_value.device)
    fake_mode = buffer_value.fake_mode
    with graph.inserting_after(facts.placeholders(graph)[-1]):
        node = graph.placeholder(PLACEHOLDER)
    with _torch_internals.fake_propagation(fake_mode):
        node.meta["example_value"] = fake_mode.from_tensor(scalars.tensor, static_shapes=True)
    row_access = {}
    for site in sites:
        row_access.update(_rewrite_site(site, node, slots.index, fake_mode))
    for site in reads:
        _rewrite_read(site, node, slots.index, fake_mode)
    for site in attention_sites:
        add = _Builder(graph, site.node, fake_mode)
        attention = rewrite_attention(site, add("call_function", operator.getitem, node, slots.index[site.length]), add)
        row_access[attention] = tuple((buffer, 0) for buffer in site.buffers)  # it reads ``cache[:B]``
    views = find_prefix_views(graph, static_inputs, steps)  # the eager attention's cache slices, made cheaper
    for view in views:
        rewrite_prefix_view(view, steps, _Builder(graph, view, fake_mode))
    _drop_orphaned_scalars(graph)
    graph.lint()
    gm.recompile()
    return Rewrite(gm, scalars, frozenset(s.buffer.name for s in sites), row_access, len(attention_sites),
                   len(views))
