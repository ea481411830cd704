"""What the decode rewrites share: the idiom protocol, the slices they recognise, the nodes they build.

Each decode idiom (a KV write, graph-safe attention, a RoPE read, a step range) is one
:class:`Idiom`: *find* its sites in the graph, state the *bounds* its step scalars must keep, and
*rewrite* one site. ``decode_rewrite.py`` loops over them; a new idiom is a module and one entry
in its ``IDIOMS``.

A *site* is a slice of a parameter/buffer at a per-step position (``cache[:B, :, pos:pos + 1]``,
``cos[pos:pos + S]``): its indexed dims in a small closed form. :func:`indices` turns a site into the
index tensors that address the same elements, reading the position from the step scalars; the KV
writes (``kv_writes.py``) and the RoPE reads (``rope_reads.py``) are both built on it.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from collections.abc import Callable

import torch
import torch.fx

from .. import _torch_internals
from .._torch_internals import sym_expr
from ..fx import graph_facts as facts
from .step_scalars import ENABLE


@dataclasses.dataclass(frozen=True)
class RewriteContext:
    """What rewriting one site needs: the step-scalar input and where each per-step int sits in it."""

    scalars: torch.fx.Node  # the graph input the rewrite adds (``step_scalars.PLACEHOLDER``)
    slot_of: dict  # per-step placeholder -> its index in the step-scalar tensor
    fake_mode: object  # Dynamo's fake mode (new nodes get fake values)
    shared: SharedNodes  # index tensors and lengths built once for every layer
    masked: bool  # KV writes honour the enable flag and the caller's rows (not a fixed-size graph)


@dataclasses.dataclass(frozen=True)
class Idiom:
    """One decode idiom the rewrite knows.

    Attributes:
        name: for people (the rewrite's log line).
        wanted: ``(writes, attention) -> bool``: are its sites looked for under these options
            (``capture_kv_writes``, ``graph_attention``)?
        find: ``(graph, static_names, steps) -> [site]``.
        bounds: ``(site, slots)``: what its step scalars must satisfy (``step_scalars.Slots.need``).
        rewrite: ``(site, context) -> {node: ((buffer, dim), ...)}``: rewrite one site; the nodes
            it built that read or write a buffer by batch row (they cap padding).
    """

    name: str
    wanted: Callable[[bool, bool], bool]
    find: Callable
    bounds: Callable
    rewrite: Callable


def static_getitem(node, static_names) -> tuple[torch.fx.Node, tuple] | None:
    """(buffer, index as a tuple) if ``node`` is ``buffer[index]`` of a parameter/buffer placeholder
    (a name in ``static_names``); None otherwise. The reads', the attention's and the prefix views'
    sites start from this match."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    buffer, index = node.args
    if not (isinstance(buffer, torch.fx.Node) and buffer.op == "placeholder" and buffer.name in static_names):
        return None
    return buffer, index if isinstance(index, tuple) else (index,)


def step_dims_bounds(site: Site, slots, what: str) -> None:
    """A site's per-step dims stay inside its buffer (``pos + n <= size``); a write's prefix that
    stops at a graph value too (a read's prefix is a slice: it needs no bound)."""
    shape = facts.example_value(site.buffer).shape
    for d, dim in enumerate(site.dims):
        if dim[0] == Dim.STEP:
            slots.need(dim[1], 0, 0, int(shape[d]) - dim[2], f"{what} {site.buffer.name} at dim {d}")
        elif dim[0] == Dim.PREFIX and isinstance(dim[1], torch.fx.Node) and site.value is not None:
            slots.need(dim[1], 0, 0, int(shape[d]), f"{what} {site.buffer.name} at dim {d}")


class Dim(enum.Enum):
    """How a site indexes one dim of its buffer."""

    FULL = "full"  # ``:``, the whole dim (with its size)
    PREFIX = "prefix"  # ``:stop``, stop an int or a graph input (``cache[:B]``)
    STEP = "step"  # ``pos:pos + n``, pos a per-step input
    INDEX = "index"  # ``index_copy_``'s own index tensor


@dataclasses.dataclass(frozen=True)
class Site:
    node: torch.fx.Node  # the write (a setitem or an index_copy_), or the read (a getitem)
    buffer: torch.fx.Node
    value: torch.fx.Node | None  # what a write writes
    # per indexed dim: (FULL, size: int or SymInt) | (PREFIX, int or placeholder) | (STEP, placeholder, n) |
    # (INDEX, node)
    dims: tuple


def slice_dim(s, d: int, buffer_value: torch.Tensor, steps: frozenset, placeholders: dict):
    """A full or prefix slice of dim ``d`` in our supported form, or None."""
    if not isinstance(s, slice) or s.step is not None or s.start is not None:
        return None
    if s.stop is None:  # the size as it is: int() would turn a dynamic size (a static cache's batch) into a
        return (Dim.FULL, buffer_value.shape[d])  # guard on its value, a recompile per batch size
    if isinstance(s.stop, int) or (s.stop in placeholders and not facts.is_per_step(s.stop, steps)):
        return (Dim.PREFIX, s.stop)
    return None


def slice_dims(buffer_value: torch.Tensor, value, index, steps: frozenset, placeholders: dict):
    """The indexed dims of ``buffer[index]`` (read as ``value``, or written from it) in our supported
    form: exactly one dim starts at a per-step input and is as long as ``value``; or None."""
    index = index if isinstance(index, tuple) else (index,)
    if (
        not index
        or len(index) > buffer_value.dim()
        or not isinstance(value, torch.Tensor)
        or value.dim() != buffer_value.dim()
    ):
        return None
    dims, step_dims = [], 0
    for d, s in enumerate(index):
        start = s.start if isinstance(s, slice) else None
        if isinstance(start, torch.fx.Node) and facts.is_per_step(start, steps):
            n = value.shape[d]
            if s.step is not None or start not in placeholders or not isinstance(n, int):
                return None
            dims.append((Dim.STEP, start, n))
            step_dims += 1
        else:
            dims.append(slice_dim(s, d, buffer_value, steps, placeholders))
    return tuple(dims) if step_dims == 1 and None not in dims else None


class SharedNodes:
    """Nodes built once per graph and reused by every later site that would build the same one (the
    KV writes' and reads' index tensors, the attention's KV length).

    Every layer's KV writes address the same rows at the same position: built per write, the index
    tensors (``arange``, ``+ pos``, the mask) became four tiny kernels per layer on the H200 (a
    16-layer decode step: 60 of its 343 launches; the one-graph limit has 244), which Inductor
    cannot merge across layers, let alone across the pieces of a layer chain. Built once, they are
    computed once per step and handed to the layers as inputs.

    A node is reused only by a site after the one it was built for (``position``: the graph's order
    before the rewrite), so it is always defined before its uses.
    """

    def __init__(self, graph: torch.fx.Graph):
        self.position = {node: i for i, node in enumerate(graph.nodes)}
        self._built: dict = {}  # (op, target, args, kwargs) -> (node, position of the site it was built for)

    def get(self, key, anchor: torch.fx.Node) -> torch.fx.Node | None:
        found = self._built.get(key)
        return found[0] if found is not None and found[1] <= self.position[anchor] else None

    def put(self, key, anchor: torch.fx.Node, node: torch.fx.Node) -> None:
        self._built.setdefault(key, (node, self.position[anchor]))


def _key(op: str, target, args: tuple, kwargs: dict):
    """A hashable key of a node to build, or None (a symbolic size: SymInts do not hash)."""

    def frozen(a):
        return tuple(map(frozen, a)) if isinstance(a, (list, tuple)) else a

    key = (op, target, frozen(args), tuple(sorted(kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


class Builder:
    """Appends nodes before ``anchor``, each with its fake value (the split pass reads them);
    :meth:`once` reuses a node ``shared`` already holds."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node, fake_mode, shared: SharedNodes | None = None):
        self.graph, self.anchor, self.fake_mode, self.shared = graph, anchor, fake_mode, shared

    def once(self, op: str, target, *args, **kwargs) -> torch.fx.Node:
        """Like calling the builder, but a node an earlier site built with the same inputs is reused."""
        return self.once_as(_key(op, target, args, kwargs), op, target, *args, **kwargs)

    def once_as(self, key, op: str, target, *args, **kwargs) -> torch.fx.Node:
        """:meth:`once` under ``key`` (None: always build)."""
        if self.shared is None or key is None:
            return self(op, target, *args, **kwargs)
        node = self.shared.get(key, self.anchor)
        if node is None:
            node = self(op, target, *args, **kwargs)
            self.shared.put(key, self.anchor, node)
        return node

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


def indices(site: Site, scalars: torch.fx.Node, slot_of: dict, add: Builder, masked: bool):
    """The index tensors that address ``site``'s elements of its buffer, and (when ``masked``) the
    mask of those a write may change: enabled, and within the caller's rows."""
    buffer_value = facts.example_value(site.buffer)
    device, ndim = buffer_value.device, buffer_value.dim()
    mask = (
        add.once("call_function", operator.ne, add.once("call_function", operator.getitem, scalars, ENABLE), 0)
        if masked
        else None
    )
    out, last = [], len(site.dims) - 1
    for d, dim in enumerate(site.dims):
        shape = [1] * (last + 1)
        shape[d] = -1
        if dim[0] == Dim.INDEX:  # index_copy_'s own index tensor
            out.append(add.once("call_method", "view", dim[1], shape))
            continue
        size = dim[1] if dim[0] != Dim.STEP else dim[2]
        if dim[0] == Dim.FULL and not isinstance(size, int):  # a dynamic full dim: its size read from the buffer
            size = add.once_as(("size", sym_expr(size)), "call_method", "size", site.buffer, d)  # any buffer's
        rows = add.once("call_function", torch.arange, size, device=device)
        if dim[0] == Dim.STEP:
            start = add.once("call_function", operator.getitem, scalars, slot_of[dim[1]])
            rows = add.once("call_function", operator.add, rows, start)
        elif dim[0] == Dim.PREFIX and isinstance(dim[1], torch.fx.Node) and masked:
            limit = add.once("call_function", operator.getitem, scalars, slot_of[dim[1]])
            keep = add.once("call_function", operator.lt, rows, limit)
            full_shape = [1] * ndim
            full_shape[d] = -1
            mask = add.once("call_function", operator.and_, mask, add.once("call_method", "view", keep, full_shape))
        out.append(add.once("call_method", "view", rows, shape))
    return tuple(out), mask
