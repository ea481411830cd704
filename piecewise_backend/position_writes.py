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
    if isinstance(s.stop, int) or (s.stop in placeholders
                                   and not facts.value_symbols(facts.example_value(s.stop)) & steps):
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
        if isinstance(start, torch.fx.Node) and facts.value_symbols(facts.example_value(start)) & steps:
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
        values = [args[slot.arg] for slot in self.slots]
        if values != self._last:
            for slot, value in zip(self.slots, values):
                if not slot.low <= value <= slot.high:
                    raise IndexError(f"piecewise: {slot.what} needs {slot.low} <= {slot.name} <= {slot.high}; got "
                                     f"{slot.name} = {value}. The write would fall outside the buffer (eager "
                                     f"PyTorch raises a shape error here too): make the buffer larger or stop "
                                     f"before its end.")
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


def _rewrite_site(site: _Site, scalars: torch.fx.Node, slot_of: dict, fake_mode) -> torch.fx.Node:
    graph = site.node.graph
    buffer_value = facts.example_value(site.buffer)
    value = site.value
    add = _Builder(graph, site.node, fake_mode)
    device, ndim = buffer_value.device, buffer_value.dim()
    indices, mask = [], add("call_function", operator.ne, add("call_function", operator.getitem, scalars, _ENABLE), 0)
    last = len(site.dims) - 1
    for d, dim in enumerate(site.dims):
        shape = [1] * (last + 1)
        shape[d] = -1
        if dim[0] == "index":  # index_copy_'s own index tensor
            indices.append(add("call_method", "view", dim[1], shape))
            continue
        size = dim[1] if dim[0] != "step" else dim[2]
        rows = add("call_function", torch.arange, size, device=device)
        if dim[0] == "step":
            start = add("call_function", operator.getitem, scalars, slot_of[dim[1]])
            rows = add("call_function", operator.add, rows, start)
        elif dim[0] == "prefix" and isinstance(dim[1], torch.fx.Node):
            limit = add("call_function", operator.getitem, scalars, slot_of[dim[1]])
            keep = add("call_function", operator.lt, rows, limit)
            full_shape = [1] * ndim
            full_shape[d] = -1
            mask = add("call_function", operator.and_, mask, add("call_method", "view", keep, full_shape))
        indices.append(add("call_method", "view", rows, shape))
    indices = tuple(indices)
    old = add("call_function", operator.getitem, site.buffer, indices)
    if facts.example_value(value).dtype != buffer_value.dtype:
        value = add("call_method", "to", value, buffer_value.dtype)
    new = add("call_function", torch.where, mask, value, old)
    put = add("call_method", "index_put_", site.buffer, indices, new)
    view = site.node.args[0]
    graph.erase_node(site.node)
    if view is not site.buffer and not view.users:  # index_copy_'s view of the buffer, now unused
        graph.erase_node(view)
    return put


@dataclasses.dataclass
class Rewrite:
    graph_module: torch.fx.GraphModule  # a copy of the input with the writes rewritten
    scalars: StepScalars
    buffers: frozenset  # names of the buffers whose writes now run in compute pieces
    nodes: frozenset  # the index_put_ nodes (masked: they never mix padded rows into real ones)


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A graph module over a copy of ``gm``'s graph (nodes keep their meta).

    Dynamo reads its own graph's placeholders after the backend returns, so a backend that adds
    an input must add it to a copy.
    """
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def rewrite_writes(gm: torch.fx.GraphModule, static_inputs: set[str]) -> Rewrite | None:
    """A copy of ``gm`` with the qualifying writes rewritten; None if there are none.

    The copy has one more graph input, :data:`PLACEHOLDER`, after the others: the caller passes
    ``rewrite.scalars.refresh(args)`` instead of ``args``.
    """
    steps = facts.step_symbols(gm.graph)
    if not find_sites(gm.graph, static_inputs, steps):
        return None
    gm = _copy(gm)
    graph = gm.graph
    sites = find_sites(graph, static_inputs, steps)
    placeholders = facts.placeholders(graph)
    position = {n: i for i, n in enumerate(placeholders)}
    slots, slot_of = [], {}
    for site in sites:
        shape = facts.example_value(site.buffer).shape
        for d, dim in enumerate(site.dims):
            what = f"the write into {site.buffer.name} at dim {d}"
            if dim[0] == "step":
                bound = (dim[1], 0, int(shape[d]) - dim[2])
            elif dim[0] == "prefix" and isinstance(dim[1], torch.fx.Node):
                bound = (dim[1], 0, int(shape[d]))
            else:
                continue
            node, low, high = bound
            if node in slot_of:
                j = slot_of[node] - 1
                old = slots[j]
                slots[j] = dataclasses.replace(old, low=max(old.low, low), high=min(old.high, high),
                                               what=old.what if old.high <= high else what)
            else:
                slots.append(_Slot(position[node], node.name, low, high, what))
                slot_of[node] = len(slots)  # slot 0 is the enable flag
    buffer_value = facts.example_value(sites[0].buffer)
    scalars = StepScalars(slots, buffer_value.device)
    fake_mode = buffer_value.fake_mode
    with graph.inserting_after(placeholders[-1]):
        node = graph.placeholder(PLACEHOLDER)
    with _torch_internals.fake_propagation(fake_mode):
        node.meta["example_value"] = fake_mode.from_tensor(scalars.tensor, static_shapes=True)
    puts = [_rewrite_site(site, node, slot_of, fake_mode) for site in sites]
    graph.lint()
    gm.recompile()
    return Rewrite(gm, scalars, frozenset(s.buffer.name for s in sites), frozenset(puts))
