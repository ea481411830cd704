"""Padding must be proven safe: every output row depends on the same input row alone.

A batch of 5 replays the graph captured for 8; rows 5..7 hold zeros or an earlier call's rows.
That is right only if no real row reads a padded one. This module *proves* it, node by node over
the compute pieces, from the fake values Dynamo recorded; anything it cannot prove refuses
padding for the graph (exact capture sizes only), with a reason that names the node:

* every tensor has at most one **batch dim**, whose size is the batch symbol times a constant
  (``[s0, 1, H]``, or ``[2*s0, H]`` after a batch-major reshape). ``q @ k.T`` over the batch has it
  twice: refused;
* every op that reads a batched tensor is one this module knows by name, and its dims say it keeps
  rows apart along that dim: pointwise ops (broadcast aligned on the batch dim), reductions and
  scans over other dims, matmuls that do not contract the batch dim, views and reshapes that keep
  each row's block whole, attention and norms with per-row statistics (``batch_norm`` only with
  running statistics), indexing that takes every row. An op it does not know refuses.

It also collects the **row capacities**: tensors without the batch dim that the graph reads or
writes *by batch row* (``cache[:B]``, the KV writes of ``rewrite/kv_writes.py``, graph attention). A
padded batch reads their rows up to the padded size, so a batch may pad only up to their row
count: past it, a padded write would land beyond the cache (in the next buffer when caches share
a block) and a read would index out of bounds (a device-side assert on CUDA).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import sympy
import torch
import torch.fx

from ..._torch_internals import sym_expr
from ...fx import graph_facts as facts
from ...op_names import SDPA, canonical_op_name, display_name
from ..types import Capacity
from .row_indexing import IndexingRules
from .row_ops import (
    ALONG_DIM,
    CONV_NDIM,
    MATMULS,
    METADATA,
    MOVES,
    NORMS_OVER_LAST,
    POINTWISE,
    RESHAPES,
    SPLIT_ALONG,
    Refused,
    as_dims,
    base,
    dims_arg,
    norm_dim,
    op_name,
    prefix,
)


@dataclasses.dataclass(frozen=True)
class RowAnalysis:
    refusal: str | None  # why rows may mix (the graph is not padded), None if proven independent
    capacities: tuple[Capacity, ...] = ()


# -- batch dims ---------------------------------------------------------------------------------------


class _Dims:
    """The batch dim of every value, computed from its fake value and checked to be one plain dim."""

    def __init__(self, sym):
        self.sym = sym

    def of(self, value, where: str) -> tuple[int, Any] | None:
        """(dim, coefficient) of the batch symbol in a tensor's sizes, None if it has none."""
        if not isinstance(value, torch.Tensor):
            return None
        found = [
            (d, sym_expr(s))
            for d, s in enumerate(value.shape)
            if isinstance(s, torch.SymInt) and self.sym in sym_expr(s).free_symbols
        ]
        if not found:
            return None
        if len(found) > 1:
            raise Refused(
                f"{where} has the batch size {self.sym} in dims {[d for d, _ in found]} "
                f"(shape {tuple(value.shape)}): rows meet rows"
            )
        dim, expr = found[0]
        if expr == self.sym:
            return dim, 1
        coefficient = sympy.simplify(expr / self.sym)
        if not (coefficient.is_Integer and coefficient > 0):
            raise Refused(
                f"{where} has a dim of size {expr} (shape {tuple(value.shape)}), not a whole number of batch rows"
            )
        return dim, int(coefficient)


class _Analysis(IndexingRules):
    def __init__(self, sym, known: dict, declared: frozenset = frozenset()):
        self.dims = _Dims(sym)
        self.sym = sym
        self.known = known  # node -> tuple of (tensor node, dim) it reads/writes by batch row
        self.declared = declared  # ops the user declared row-wise (``row_independent_ops``)
        self.capacities: list[Capacity] = []

    # -- helpers -------------------------------------------------------------------------------

    def batch(self, node) -> tuple[int, int] | None:
        if not isinstance(node, torch.fx.Node):
            return None
        return self.dims.of(facts.example_value(node), f"{node.name}")

    def capacity(self, tensor: torch.fx.Node, dim: int, why: str) -> None:
        size = facts.example_value(tensor).shape[dim]
        rows = sym_expr(size) if isinstance(size, torch.SymInt) else int(size)
        self.capacities.append(Capacity(tensor.name, f"dim {dim}, {why}", rows))

    def is_batch_size(self, value) -> bool:
        """Is ``value`` (a node or int) the batch size itself (``B`` in ``cache[:B]``)?"""
        value = facts.example_value(value) if isinstance(value, torch.fx.Node) else value
        return isinstance(value, torch.SymInt) and sym_expr(value) == self.sym

    # -- the proof -------------------------------------------------------------------------------

    def check(self, node: torch.fx.Node) -> None:
        if node.op not in ("call_function", "call_method"):
            return
        where = f"{display_name(node)} ({node.name})"
        if node in self.known:
            for tensor, dim in self.known[node]:
                self.capacity(tensor, dim, where)
            return
        if node.op == "call_function" and canonical_op_name(node.target) in self.declared:
            return  # the user's word for it (``row_independent_ops``): a custom op the proof cannot read
        out = facts.example_value(node)
        tensor_inputs = [i for i in node.all_input_nodes if isinstance(facts.example_value(i), torch.Tensor)]
        batched = {i: self.batch(i) for i in tensor_inputs}
        batched = {i: b for i, b in batched.items() if b is not None}
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        out_batches = [self.dims.of(o, where) for o in outs]
        name = op_name(node)
        if node.target is operator.getitem and isinstance(facts.example_value(node.args[0]), (tuple, list)):
            return  # picking one result of a multi-output op (its rows were checked there)
        if name in ("setitem", "__setitem__") and batched:
            return self.set_rows(node, batched, where)
        if not batched:
            if name in ("getitem", "narrow") and any(b is not None for b in out_batches):
                self.rows_taken(node, where)  # a tensor without the batch dim, read by batch row
            elif name in ("setitem", "__setitem__"):
                self.rows_written(node, where)
            return
        custom = canonical_op_name(node.target) if node.op == "call_function" and name is None else None
        if custom is not None:
            raise Refused(
                f"{where} is a custom op the padding proof cannot see into; if each of its output "
                f"rows reads only the same rows of its inputs, and a padded row writes nothing that real "
                f"rows read, declare it: options={{'row_independent_ops': [{custom!r}]}}"
            )
        if not outs:
            if base(name or "") in METADATA:
                return  # a size, stride or dtype: the same for every row
            raise Refused(f"{where} turns a batched tensor into a Python value (``item()`` of a sum over rows?)")
        if any(b is None for b in out_batches):
            raise Refused(f"{where} turns a batched tensor into an un-batched one (reduces over the batch)")
        if name is None:
            raise Refused(f"{where} is not an op known to keep batch rows apart")
        if name == "getattr" and node.args[1] in ("T", "mT", "H", "mH"):
            name = "T"  # ``x.T``: a transpose
        self.rule(node, base(name), batched, out_batches, where)

    def rule(self, node, name: str, batched: dict, out_batches: list, where: str) -> None:
        out = facts.example_value(node)
        first = node.args[0] if node.args else None
        first_value = facts.example_value(first) if isinstance(first, torch.fx.Node) else None
        if name in POINTWISE or (
            name in ("max", "min")
            and len(node.args) > 1
            and isinstance(facts.example_value(node.args[1]), torch.Tensor)
        ):
            if name == "where" and len(node.args) == 1:
                raise Refused(f"{where}: where(cond) lists indices across the batch")
            return self.aligned(batched, out, out_batches[0], where)
        if name in ALONG_DIM:
            position, default = ALONG_DIM[name]
            return self.not_along(node, first, first_value, batched, position, default, where)
        if name in SPLIT_ALONG:
            position, default = SPLIT_ALONG[name]
            if name == "repeat_interleave" and (len(node.args) < 2 and "dim" not in node.kwargs):
                raise Refused(f"{where}: repeat_interleave without a dim flattens the batch")
            return self.not_along(node, first, first_value, batched, position, default, where)
        if name in RESHAPES:
            return self.reshaped(first, first_value, out, out_batches[0], where)
        if name in MOVES:
            return self.same_rows(batched, out_batches, where)
        if name in ("repeat", "tile"):
            return self.repeated(node, first, out, out_batches[0], where)
        if name in ("cat", "concat", "concatenate", "stack"):
            return self.joined(node, name, batched, out, out_batches[0], where)
        if name == "getitem":
            return self.indexed(node, first, first_value, batched, where)
        if name in ("copy", "fill", "zero", "masked_fill"):
            return self.aligned(batched, out, out_batches[0], where)
        return self.layer_rule(node, name, first, first_value, batched, out, where)

    def layer_rule(self, node, name: str, first, first_value, batched: dict, out, where: str) -> None:
        """The ops of model layers: linear and matmuls, embeddings, norms, attention, convolutions."""
        if name in ("linear",):
            if any(i is not first for i in batched):
                raise Refused(f"{where}: the weight or bias has the batch dim")
            if batched[first][0] == first_value.dim() - 1:
                raise Refused(f"{where} contracts the batch dim")
            return None
        if name in MATMULS or node.target is operator.matmul:
            return self.matmul(node.args[0], node.args[1], where)
        if name in ("addmm", "baddbmm", "addbmm", "addmv"):
            self.matmul(node.args[1], node.args[2], where)
            return self.aligned(batched, out, self.dims.of(out, where), where)
        if name == "embedding":
            weight = node.args[1] if node.target is not torch.embedding else node.args[0]
            if weight in batched:
                raise Refused(f"{where}: the embedding table has the batch dim")
            return None
        if name in NORMS_OVER_LAST:
            shape = node.args[NORMS_OVER_LAST[name]] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
            count = len(shape) if isinstance(shape, (list, tuple)) else 1
            if any(i is not first for i in batched) or batched[first][0] >= first_value.dim() - count:
                raise Refused(f"{where} normalises over the batch dim")
            return None
        if name == "group_norm":
            if any(i is not first for i in batched) or batched[first][0] != 0:
                raise Refused(f"{where}: group_norm's batch dim is not dim 0")
            return None
        if name in ("batch_norm", "instance_norm"):
            return self.batch_norm(node, name, first, batched, where)
        if f"aten::{name}" == SDPA:
            return self.attention(batched, out, where)
        if name in ("index_select",):
            dim = norm_dim(dims_arg(node, 1, None), first_value.dim())
            index = node.args[2] if len(node.args) > 2 else node.kwargs.get("index")
            if first in batched and (index in batched or dim == batched[first][0]):
                raise Refused(f"{where} selects along the batch dim or by a batched index")
            return None
        if name in ("pad", "constant_pad_nd"):
            pad = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
            padded = (
                {first_value.dim() - 1 - k // 2 for k in range(len(pad))} if isinstance(pad, (list, tuple)) else None
            )
            if padded is None or batched.get(first, (None,))[0] in padded:
                raise Refused(f"{where} pads the batch dim")
            return None
        if name in CONV_NDIM:
            if any(i is not first for i in batched) or first_value.dim() != CONV_NDIM[name] or batched[first][0] != 0:
                raise Refused(f"{where}: batch not at dim 0 of a batched convolution input")
            return None
        raise Refused(f"{where} is not an op known to keep batch rows apart")

    # -- rules ----------------------------------------------------------------------------------

    def aligned(self, batched: dict, out, out_batch, where: str) -> None:
        """Broadcasting ops: every batched input's batch dim lines up with the output's."""
        if not isinstance(out, torch.Tensor):
            out = next(o for o in out if isinstance(o, torch.Tensor))
        from_right = out.dim() - out_batch[0]
        for i, (dim, coefficient) in batched.items():
            value = facts.example_value(i)
            if value.dim() - dim != from_right or coefficient != out_batch[1]:
                raise Refused(f"{where}: {i.name}'s batch dim does not line up with the output's")

    def not_along(self, node, first, first_value, batched, position, default, where: str) -> None:
        if any(i is not first for i in batched):  # e.g. a batched ``other`` in sort or a weight
            raise Refused(f"{where} reads a second batched tensor")
        dims = dims_arg(node, position, default)
        if isinstance(dims, str) or dims is None:
            raise Refused(f"{where} works over every dim, the batch dim included")
        dims = as_dims(dims, first_value.dim())
        if dims is None or batched[first][0] in dims:
            raise Refused(f"{where} combines values along the batch dim")

    def reshaped(self, first, first_value, out, out_batch, where: str) -> None:
        """A reshape keeps rows whole when the sizes before the batch dim multiply to the same number:
        then every flat position lands in the same batch row on both sides."""
        in_batch = self.batch(first)
        if in_batch is None:
            return
        before_in, before_out = prefix(first_value.shape, in_batch[0]), prefix(out.shape, out_batch[0])
        if before_in is None or before_in != before_out:
            raise Refused(f"{where} reshapes across the batch dim ({tuple(first_value.shape)} -> {tuple(out.shape)})")

    def same_rows(self, batched: dict, out_batches: list, where: str) -> None:
        coefficients = {b[1] for b in batched.values()} | {b[1] for b in out_batches}
        if len(coefficients) > 1:
            raise Refused(f"{where} changes how many values make one batch row")

    def repeated(self, node, first, out, out_batch, where: str) -> None:
        sizes = node.args[1:] if len(node.args) > 2 or not isinstance(node.args[1], (list, tuple)) else node.args[1]
        from_right = out.dim() - out_batch[0]
        factor = sizes[len(sizes) - from_right] if from_right <= len(sizes) else 1
        if not isinstance(factor, int) or factor != 1:
            raise Refused(f"{where} repeats the batch dim")

    def joined(self, node, name, batched, out, out_batch, where: str) -> None:
        tensors = node.args[0]
        if any(t not in batched for t in tensors):
            raise Refused(f"{where} joins batched and un-batched tensors")
        dims = {batched[t] for t in tensors}
        if len(dims) > 1:
            raise Refused(f"{where} joins tensors whose batch dims differ")
        if name != "stack":
            dim = norm_dim(dims_arg(node, 1, 0), out.dim())
            if dim is None or dim == out_batch[0]:
                raise Refused(f"{where} concatenates along the batch dim")

    def matmul(self, a, b, where: str) -> None:
        va, vb = facts.example_value(a), facts.example_value(b)
        ba, bb = self.batch(a), self.batch(b)
        if ba is not None and ba[0] == va.dim() - 1:
            raise Refused(f"{where} contracts the batch dim of {a.name}")
        if bb is not None and (vb.dim() == 1 or bb[0] == vb.dim() - 2):
            raise Refused(f"{where} contracts the batch dim of {b.name}")
        if ba is not None and bb is not None:
            leading = va.dim() - ba[0] > 2 and vb.dim() - bb[0] > 2
            if not leading or va.dim() - ba[0] != vb.dim() - bb[0] or ba[1] != bb[1]:
                raise Refused(f"{where} multiplies rows of {a.name} with other rows of {b.name}")

    def batch_norm(self, node, name, first, batched, where: str) -> None:
        if any(i is not first for i in batched):
            raise Refused(f"{where}: its statistics or weights have the batch dim")
        if node.target is torch.batch_norm:
            training, stats = node.args[5] if len(node.args) > 5 else None, node.args[3:5]
        elif name == "instance_norm":
            training, stats = node.args[5] if len(node.args) > 5 else node.kwargs.get("use_input_stats", True), ()
            if batched[first][0] in (0, 1):
                return None  # statistics per sample and channel
        else:
            training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
            stats = node.args[1:3]
        if training is not False or any(s is None for s in stats):
            raise Refused(
                f"{where} normalises with batch statistics (train mode, or "
                f"track_running_stats=False): every row depends on every other"
            )

    def attention(self, batched: dict, out, where: str) -> None:
        """Attention mixes along the key dim (-2) and features (-1), never along leading dims."""
        from_right = {
            value.dim() - dim for value, (dim, _) in ((facts.example_value(i), b) for i, b in batched.items())
        }
        if len(from_right) > 1 or min(from_right) <= 2:
            raise Refused(f"{where}: the batch dim is not one of attention's leading (batch/head) dims")


def analyse(nodes, sym, known: dict | None = None, declared: frozenset = frozenset()) -> RowAnalysis:
    """Prove that ``nodes`` (the compute nodes, in order) keep rows apart along ``sym``.

    ``known``: nodes built by the backend's own rewrites that are row-wise by construction, each
    with the (tensor, dim) pairs it reads or writes by batch row (they add row capacities).
    ``declared``: names of ops the user declares row-wise (``row_independent_ops``), taken as such.
    """
    analysis = _Analysis(sym, known or {}, declared)
    try:
        for node in nodes:
            analysis.check(node)
    except Refused as refused:
        return RowAnalysis(str(refused))
    return RowAnalysis(None, tuple(analysis.capacities))
