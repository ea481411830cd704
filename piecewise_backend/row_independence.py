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
writes *by batch row* (``cache[:B]``, the KV writes of ``position_writes``, graph attention). A
padded batch reads their rows up to the padded size, so a batch may pad only up to their row
count: past it, a padded write would land beyond the cache (in the next buffer when caches share
a block) and a read would index out of bounds (a device-side assert on CUDA).
"""

from __future__ import annotations

import builtins
import dataclasses
import operator
from typing import Any

import sympy
import torch
import torch.fx

from . import graph_facts as facts
from .op_names import canonical_op_name, display_name


class _Refused(Exception):
    """Raised inside the analysis with the reason rows may mix."""


@dataclasses.dataclass(frozen=True)
class Capacity:
    """A tensor read or written by batch row: a padded batch may not exceed ``rows``."""

    tensor: str  # the graph input (or value) read or written by batch row
    where: str  # which dim, and the node that does it, for people
    rows: Any  # an int, or a sympy expression in the graph's symbols


@dataclasses.dataclass(frozen=True)
class RowAnalysis:
    refusal: str | None  # why rows may mix (the graph is not padded), None if proven independent
    capacities: tuple[Capacity, ...] = ()


# -- the op tables (names as Dynamo records them: torch functions, Tensor methods, operator) ------

_POINTWISE = frozenset("""
abs absolute acos acosh add addcdiv addcmul alias and_ angle asin asinh atan atan2 atanh bfloat16
bitwise_and bitwise_left_shift bitwise_not bitwise_or bitwise_right_shift bitwise_xor bool ceil celu
clamp clamp_max clamp_min clip clone conj contiguous copy cos cosh cpu cuda deg2rad detach digamma div
divide double dropout elu empty_like eq erf erfc erfinv exp exp2 expm1 eq fill float float_power floor
floor_divide floordiv fmax fmin fmod frac full_like ge gelu greater greater_equal gt half hardshrink
hardsigmoid hardswish hardtanh heaviside hypot i0 iadd iand idiv ifloordiv ilshift imod imul int inv
invert ior ipow irshift isfinite isinf isnan isub itruediv ixor le leaky_relu lerp less less_equal lgamma
log log10 log1p log2 log_sigmoid logaddexp logical_and logical_not logical_or logical_xor logit long
lshift lt masked_fill maximum minimum mish mod mul multiply nan_to_num ne neg negative not_equal not_
and not or ones_like or_ polar pos positive pow rad2deg rand_like randn_like reciprocal relu relu6 remainder
round rrelu rshift rsqrt rsub selu short sigmoid sign signbit silu sin sinc sinh softplus softshrink
softsign sqrt square sub subtract tan tanh tanhshrink threshold to true_divide truediv trunc type
type_as wait_tensor where xlogy xor zero zeros_like
""".split())

# name -> (position of the dim argument counting self as 0, default dims when absent: None = all)
_ALONG_DIM = {
    **{n: (1, None) for n in """all amax amin any argmax argmin count_nonzero logsumexp max mean median min
       mode nanmean nanmedian nansum prod std std_mean sum var var_mean aminmax""".split()},
    **{n: (1, "required") for n in """softmax log_softmax cumsum cumprod cummax cummin logcumsumexp
       sort argsort flip""".split()},
    "topk": (2, -1), "kthvalue": (2, -1), "norm": (2, None), "normalize": (2, 1), "roll": (2, None),
    "diff": (2, -1), "glu": (1, -1), "tril": (None, (-2, -1)), "triu": (None, (-2, -1)),
}
_SPLIT_ALONG = {"split": (2, 0), "chunk": (2, 0), "unbind": (1, 0), "split_with_sizes": (2, 0),
                "tensor_split": (2, 0), "narrow": (1, None), "select": (1, None), "repeat_interleave": (2, None)}
_RESHAPES = frozenset("view reshape view_as reshape_as flatten unflatten _unsafe_view view_as_complex "
                      "view_as_real".split())
_MOVES = frozenset("unsqueeze squeeze transpose permute movedim moveaxis swapaxes swapdims t T mT expand "
                   "expand_as broadcast_to".split())
_CREATION = frozenset("arange zeros ones full empty empty_strided tensor scalar_tensor eye linspace "
                      "logspace rand randn randint new_zeros new_ones new_empty new_full new_tensor "
                      "as_tensor zeros_like_static".split())
_METADATA = frozenset("size stride dim numel getattr sym_size sym_stride sym_numel sym_storage_offset "
                      "storage_offset is_contiguous _assert_tensor_metadata _assert_scalar "
                      "_set_grad_enabled _enter_autocast _exit_autocast".split())
_MATMULS = frozenset("matmul mm bmm __matmul__".split())
_NORMS_OVER_LAST = {"layer_norm": 1, "rms_norm": 1}  # position of normalized_shape
_CONV_NDIM = {"conv1d": 3, "conv2d": 4, "conv3d": 5, "conv_transpose1d": 3, "conv_transpose2d": 4,
              "conv_transpose3d": 5}
_TRUSTED_MODULES = ("torch", "operator", "builtins", "math", "_operator")
# tensor-parallel collectives that combine ranks element by element (every rank pads alike); an
# all-gather or reduce-scatter along the batch dim would not, and is not listed
_ELEMENTWISE_COLLECTIVES = frozenset({"all_reduce", "all_reduce_", "wait_tensor"})


def _op_name(node: torch.fx.Node) -> str | None:
    """The name to look an op up by, or None for a callable this module does not vouch for (a
    user's own custom op with a familiar name must not pass for the torch op)."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        namespace, _, name = canonical_op_name(target).partition("::")
        if namespace == "_c10d_functional" and name in _ELEMENTWISE_COLLECTIVES:
            return "wait_tensor"  # a sum across ranks, element by element: rows stay rows
        return name if namespace in ("aten", "prims") else None
    module = getattr(target, "__module__", None) or ""
    if target in (builtins.getattr, builtins.min, builtins.max) or module.split(".")[0] in _TRUSTED_MODULES:
        return getattr(target, "__name__", None)
    return None


def _base(name: str) -> str:
    """``add_`` -> ``add`` (the in-place form keeps rows apart exactly when the op does)."""
    return name[:-1] if name.endswith("_") and not name.endswith("__") and len(name) > 1 else name


# -- batch dims ---------------------------------------------------------------------------------------


class _Dims:
    """The batch dim of every value, computed from its fake value and checked to be one plain dim."""

    def __init__(self, sym):
        self.sym = sym

    def of(self, value, where: str) -> tuple[int, Any] | None:
        """(dim, coefficient) of the batch symbol in a tensor's sizes, None if it has none."""
        if not isinstance(value, torch.Tensor):
            return None
        found = [(d, s.node.expr) for d, s in enumerate(value.shape)
                 if isinstance(s, torch.SymInt) and self.sym in s.node.expr.free_symbols]
        if not found:
            return None
        if len(found) > 1:
            raise _Refused(f"{where} has the batch size {self.sym} in dims {[d for d, _ in found]} "
                           f"(shape {tuple(value.shape)}): rows meet rows")
        dim, expr = found[0]
        if expr == self.sym:
            return dim, 1
        coefficient = sympy.simplify(expr / self.sym)
        if not (coefficient.is_Integer and coefficient > 0):
            raise _Refused(f"{where} has a dim of size {expr} (shape {tuple(value.shape)}), not a whole number "
                           f"of batch rows")
        return dim, int(coefficient)


def _norm_dim(d, ndim: int):
    if isinstance(d, torch.fx.Node):
        d = facts.example_value(d)
    if not isinstance(d, int):
        return None
    return d % ndim if ndim else d


def _dims_arg(node: torch.fx.Node, position, default):
    """The dim argument of an op, as given (kwarg ``dim``/``dims``/``axis`` or positional)."""
    for key in ("dim", "dims", "axis"):
        if key in node.kwargs:
            return node.kwargs[key]
    if position is not None and len(node.args) > position:
        return node.args[position]
    return default


def _as_dims(value, ndim: int) -> set | None:
    """A dim argument as a set of normalised dims; None when it is not a plain int or a list of them."""
    items = value if isinstance(value, (list, tuple)) else (value,)
    out = set()
    for d in items:
        d = _norm_dim(d, ndim)
        if d is None:
            return None
        out.add(d)
    return out


def _prefix(shape, dim: int):
    """The product of the sizes before ``dim``, or None if one of them is symbolic."""
    product = 1
    for s in shape[:dim]:
        if isinstance(s, torch.SymInt):
            return None
        product *= int(s)
    return product


class _Analysis:
    def __init__(self, sym, known: dict):
        self.dims = _Dims(sym)
        self.sym = sym
        self.known = known  # node -> tuple of (tensor node, dim) it reads/writes by batch row
        self.capacities: list[Capacity] = []

    # -- helpers -------------------------------------------------------------------------------

    def batch(self, node) -> tuple[int, int] | None:
        if not isinstance(node, torch.fx.Node):
            return None
        return self.dims.of(facts.example_value(node), f"{node.name}")

    def capacity(self, tensor: torch.fx.Node, dim: int, why: str) -> None:
        size = facts.example_value(tensor).shape[dim]
        rows = size.node.expr if isinstance(size, torch.SymInt) else int(size)
        self.capacities.append(Capacity(tensor.name, f"dim {dim}, {why}", rows))

    def is_batch_size(self, value) -> bool:
        """Is ``value`` (a node or int) the batch size itself (``B`` in ``cache[:B]``)?"""
        value = facts.example_value(value) if isinstance(value, torch.fx.Node) else value
        return isinstance(value, torch.SymInt) and value.node.expr == self.sym

    # -- the proof -------------------------------------------------------------------------------

    def check(self, node: torch.fx.Node) -> None:
        if node.op not in ("call_function", "call_method"):
            return
        where = f"{display_name(node)} ({node.name})"
        if node in self.known:
            for tensor, dim in self.known[node]:
                self.capacity(tensor, dim, where)
            return
        out = facts.example_value(node)
        tensor_inputs = [i for i in node.all_input_nodes if isinstance(facts.example_value(i), torch.Tensor)]
        batched = {i: self.batch(i) for i in tensor_inputs}
        batched = {i: b for i, b in batched.items() if b is not None}
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        out_batches = [self.dims.of(o, where) for o in outs]
        name = _op_name(node)
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
        if not outs:
            if _base(name or "") in _METADATA:
                return  # a size, stride or dtype: the same for every row
            raise _Refused(f"{where} turns a batched tensor into a Python value (``item()`` of a sum over rows?)")
        if any(b is None for b in out_batches):
            raise _Refused(f"{where} turns a batched tensor into an un-batched one (reduces over the batch)")
        if name is None:
            raise _Refused(f"{where} is not an op known to keep batch rows apart")
        if name == "getattr" and node.args[1] in ("T", "mT", "H", "mH"):
            name = "T"  # ``x.T``: a transpose
        self.rule(node, _base(name), batched, out_batches, where)

    def rule(self, node, name: str, batched: dict, out_batches: list, where: str) -> None:
        out = facts.example_value(node)
        first = node.args[0] if node.args else None
        first_value = facts.example_value(first) if isinstance(first, torch.fx.Node) else None
        if name in _POINTWISE or (name in ("max", "min") and len(node.args) > 1
                                  and isinstance(facts.example_value(node.args[1]), torch.Tensor)):
            if name == "where" and len(node.args) == 1:
                raise _Refused(f"{where}: where(cond) lists indices across the batch")
            return self.aligned(batched, out, out_batches[0], where)
        if name in _ALONG_DIM:
            position, default = _ALONG_DIM[name]
            return self.not_along(node, first, first_value, batched, position, default, where)
        if name in _SPLIT_ALONG:
            position, default = _SPLIT_ALONG[name]
            if name == "repeat_interleave" and (len(node.args) < 2 and "dim" not in node.kwargs):
                raise _Refused(f"{where}: repeat_interleave without a dim flattens the batch")
            return self.not_along(node, first, first_value, batched, position, default, where)
        if name in _RESHAPES:
            return self.reshaped(first, first_value, out, out_batches[0], where)
        if name in _MOVES or name in ("contiguous", "clone", "detach"):
            return self.same_rows(batched, out_batches, where)
        if name in ("repeat", "tile"):
            return self.repeated(node, first, out, out_batches[0], where)
        if name in ("cat", "concat", "concatenate", "stack"):
            return self.joined(node, name, batched, out, out_batches[0], where)
        if name in ("linear",):
            if any(i is not first for i in batched):
                raise _Refused(f"{where}: the weight or bias has the batch dim")
            if batched[first][0] == first_value.dim() - 1:
                raise _Refused(f"{where} contracts the batch dim")
            return None
        if name in _MATMULS or node.target is operator.matmul:
            return self.matmul(node.args[0], node.args[1], where)
        if name in ("addmm", "baddbmm", "addbmm", "addmv"):
            self.matmul(node.args[1], node.args[2], where)
            return self.aligned(batched, out, out_batches[0], where)
        if name == "embedding":
            weight = node.args[1] if node.target is not torch.embedding else node.args[0]
            if weight in batched:
                raise _Refused(f"{where}: the embedding table has the batch dim")
            return None
        if name in _NORMS_OVER_LAST:
            shape = node.args[_NORMS_OVER_LAST[name]] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
            count = len(shape) if isinstance(shape, (list, tuple)) else 1
            if any(i is not first for i in batched) or batched[first][0] >= first_value.dim() - count:
                raise _Refused(f"{where} normalises over the batch dim")
            return None
        if name == "group_norm":
            if any(i is not first for i in batched) or batched[first][0] != 0:
                raise _Refused(f"{where}: group_norm's batch dim is not dim 0")
            return None
        if name in ("batch_norm", "instance_norm"):
            return self.batch_norm(node, name, first, batched, where)
        if name == "scaled_dot_product_attention":
            return self.attention(batched, out, where)
        if name in ("index_select",):
            dim = _norm_dim(_dims_arg(node, 1, None), first_value.dim())
            index = node.args[2] if len(node.args) > 2 else node.kwargs.get("index")
            if first in batched and (index in batched or dim == batched[first][0]):
                raise _Refused(f"{where} selects along the batch dim or by a batched index")
            return None
        if name in ("pad", "constant_pad_nd"):
            pad = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
            padded = {first_value.dim() - 1 - k // 2 for k in range(len(pad))} if isinstance(pad, (list, tuple)) else None
            if padded is None or batched.get(first, (None,))[0] in padded:
                raise _Refused(f"{where} pads the batch dim")
            return None
        if name in _CONV_NDIM:
            if any(i is not first for i in batched) or first_value.dim() != _CONV_NDIM[name] or batched[first][0] != 0:
                raise _Refused(f"{where}: batch not at dim 0 of a batched convolution input")
            return None
        if name == "getitem":
            return self.indexed(node, first, first_value, batched, where)
        if name in ("copy", "fill", "zero", "masked_fill"):
            return self.aligned(batched, out, out_batches[0], where)
        raise _Refused(f"{where} is not an op known to keep batch rows apart")

    # -- rules ----------------------------------------------------------------------------------

    def aligned(self, batched: dict, out, out_batch, where: str) -> None:
        """Broadcasting ops: every batched input's batch dim lines up with the output's."""
        if not isinstance(out, torch.Tensor):
            out = next(o for o in out if isinstance(o, torch.Tensor))
        from_right = out.dim() - out_batch[0]
        for i, (dim, coefficient) in batched.items():
            value = facts.example_value(i)
            if value.dim() - dim != from_right or coefficient != out_batch[1]:
                raise _Refused(f"{where}: {i.name}'s batch dim does not line up with the output's")

    def not_along(self, node, first, first_value, batched, position, default, where: str) -> None:
        if any(i is not first for i in batched):  # e.g. a batched ``other`` in sort or a weight
            raise _Refused(f"{where} reads a second batched tensor")
        dims = _dims_arg(node, position, default)
        if isinstance(dims, str) or dims is None:
            raise _Refused(f"{where} works over every dim, the batch dim included")
        dims = _as_dims(dims, first_value.dim())
        if dims is None or batched[first][0] in dims:
            raise _Refused(f"{where} combines values along the batch dim")

    def reshaped(self, first, first_value, out, out_batch, where: str) -> None:
        """A reshape keeps rows whole when the sizes before the batch dim multiply to the same number:
        then every flat position lands in the same batch row on both sides."""
        in_batch = self.batch(first)
        if in_batch is None:
            return
        before_in, before_out = _prefix(first_value.shape, in_batch[0]), _prefix(out.shape, out_batch[0])
        if before_in is None or before_in != before_out:
            raise _Refused(f"{where} reshapes across the batch dim ({tuple(first_value.shape)} -> {tuple(out.shape)})")

    def same_rows(self, batched: dict, out_batches: list, where: str) -> None:
        coefficients = {b[1] for b in batched.values()} | {b[1] for b in out_batches}
        if len(coefficients) > 1:
            raise _Refused(f"{where} changes how many values make one batch row")

    def repeated(self, node, first, out, out_batch, where: str) -> None:
        sizes = node.args[1:] if len(node.args) > 2 or not isinstance(node.args[1], (list, tuple)) else node.args[1]
        from_right = out.dim() - out_batch[0]
        factor = sizes[len(sizes) - from_right] if from_right <= len(sizes) else 1
        if not isinstance(factor, int) or factor != 1:
            raise _Refused(f"{where} repeats the batch dim")

    def joined(self, node, name, batched, out, out_batch, where: str) -> None:
        tensors = node.args[0]
        if any(t not in batched for t in tensors):
            raise _Refused(f"{where} joins batched and un-batched tensors")
        dims = {batched[t] for t in tensors}
        if len(dims) > 1:
            raise _Refused(f"{where} joins tensors whose batch dims differ")
        if name != "stack":
            dim = _norm_dim(_dims_arg(node, 1, 0), out.dim())
            if dim is None or dim == out_batch[0]:
                raise _Refused(f"{where} concatenates along the batch dim")

    def matmul(self, a, b, where: str) -> None:
        va, vb = facts.example_value(a), facts.example_value(b)
        ba, bb = self.batch(a), self.batch(b)
        if ba is not None and ba[0] == va.dim() - 1:
            raise _Refused(f"{where} contracts the batch dim of {a.name}")
        if bb is not None and (vb.dim() == 1 or bb[0] == vb.dim() - 2):
            raise _Refused(f"{where} contracts the batch dim of {b.name}")
        if ba is not None and bb is not None:
            leading = va.dim() - ba[0] > 2 and vb.dim() - bb[0] > 2
            if not leading or va.dim() - ba[0] != vb.dim() - bb[0] or ba[1] != bb[1]:
                raise _Refused(f"{where} multiplies rows of {a.name} with other rows of {b.name}")

    def batch_norm(self, node, name, first, batched, where: str) -> None:
        if any(i is not first for i in batched):
            raise _Refused(f"{where}: its statistics or weights have the batch dim")
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
            raise _Refused(f"{where} normalises with batch statistics (train mode, or "
                           f"track_running_stats=False): every row depends on every other")

    def attention(self, batched: dict, out, where: str) -> None:
        """Attention mixes along the key dim (-2) and features (-1), never along leading dims."""
        from_right = {value.dim() - dim for value, (dim, _) in ((facts.example_value(i), b) for i, b in batched.items())}
        if len(from_right) > 1 or min(from_right) <= 2:
            raise _Refused(f"{where}: the batch dim is not one of attention's leading (batch/head) dims")

    def indexed(self, node, first, first_value, batched, where: str) -> None:
        """``x[index]``: every entry that meets the batch dim must take all of it."""
        index = node.args[1]
        entries = index if isinstance(index, tuple) else (index,)
        if first not in batched:
            return self.rows_taken(node, where)
        if any(e in batched for e in entries if isinstance(e, torch.fx.Node)):
            raise _Refused(f"{where} indexes with a batched index tensor")
        batch_dim, _ = batched[first]
        for dim, entry in self.index_dims(entries, first_value.dim(), where):
            if dim != batch_dim:
                continue
            if not (isinstance(entry, slice) and entry.start in (None, 0) and entry.step in (None, 1)
                    and (entry.stop is None or self.same_size(entry.stop, first_value.shape[dim]))):
                raise _Refused(f"{where} takes part of the batch dim ({entry!r})")

    def same_size(self, stop, size) -> bool:
        value = facts.example_value(stop) if isinstance(stop, torch.fx.Node) else stop
        if isinstance(value, torch.SymInt) and isinstance(size, torch.SymInt):
            return sympy.simplify(value.node.expr - size.node.expr) == 0
        return False

    def index_dims(self, entries, ndim: int, where: str):
        """(input dim, entry) for every entry of an index that consumes a dim."""
        consuming = [e for e in entries if e is not None and e is not Ellipsis]
        widths = []
        for e in consuming:
            value = facts.example_value(e) if isinstance(e, torch.fx.Node) else None
            widths.append(value.dim() if isinstance(value, torch.Tensor) and value.dtype == torch.bool else 1)
        dim, out = 0, []
        for e in entries:
            if e is None:
                continue
            if e is Ellipsis:
                dim += ndim - sum(widths)
                continue
            value = facts.example_value(e) if isinstance(e, torch.fx.Node) else None
            width = value.dim() if isinstance(value, torch.Tensor) and value.dtype == torch.bool else 1
            for k in range(width):
                out.append((dim + k, e))
            dim += width
        return out

    def rows_taken(self, node, where: str) -> None:
        """An un-batched tensor made batched by indexing: ``cache[:B]``, ``narrow(d, 0, B)``."""
        source, value = node.args[0], facts.example_value(node.args[0])
        if node.target is operator.getitem or node.target == "__getitem__":
            entries = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            if any(isinstance(facts.example_value(e), torch.Tensor) for e in entries if isinstance(e, torch.fx.Node)):
                raise _Refused(f"{where} gathers rows by an index tensor")
            for dim, entry in self.index_dims(entries, value.dim(), where):
                if isinstance(entry, slice) and self.is_batch_size(entry.stop):
                    if entry.start not in (None, 0) or entry.step not in (None, 1):
                        raise _Refused(f"{where} takes batch rows at an offset ({entry!r})")
                    self.capacity(source, dim, where)
                    return
        elif _base(_op_name(node) or "") == "narrow":
            dim, start, length = (list(node.args[1:4]) + [None] * 3)[:3]
            if start in (0,) and self.is_batch_size(length):
                self.capacity(source, _norm_dim(dim, value.dim()), where)
                return
        raise _Refused(f"{where} makes a batch dim out of a tensor that has none")

    def rows_written(self, node, where: str) -> None:
        """``buf[:B] = value`` on a tensor without the batch dim: writes its rows up to the padded size."""
        target, index, _ = node.args
        entries = index if isinstance(index, tuple) else (index,)
        for dim, entry in self.index_dims(entries, facts.example_value(target).dim(), where):
            if isinstance(entry, slice) and self.is_batch_size(entry.stop):
                self.capacity(target, dim, where)

    def set_rows(self, node, batched, where: str) -> None:
        target, index, value = node.args
        target_value = facts.example_value(target)
        if any(e in batched for e in (index if isinstance(index, tuple) else (index,)) if isinstance(e, torch.fx.Node)):
            raise _Refused(f"{where} writes through a batched index tensor")
        entries = index if isinstance(index, tuple) else (index,)
        if target not in batched:
            raise _Refused(f"{where} writes batch rows into a tensor that has no batch dim")
        batch_dim = batched[target][0]
        kept_before = 0  # the view's dims before the batch dim: its batch dim from the right
        for dim, entry in self.index_dims(entries, target_value.dim(), where):
            if isinstance(entry, torch.fx.Node) and isinstance(facts.example_value(entry), torch.Tensor):
                raise _Refused(f"{where} writes through an index tensor")
            if dim == batch_dim and not (isinstance(entry, slice) and entry == slice(None)):
                raise _Refused(f"{where} writes part of the batch dim ({entry!r})")
            if dim < batch_dim and isinstance(entry, slice):
                kept_before += 1
        kept_before += sum(1 for e in entries if e is None)  # conservative: Nones only add leading dims
        if value in batched:
            view_ndim = target_value.dim() - sum(1 for _, e in self.index_dims(entries, target_value.dim(), where)
                                                 if not isinstance(e, slice)) + sum(1 for e in entries if e is None)
            if view_ndim - kept_before != facts.example_value(value).dim() - batched[value][0]:
                raise _Refused(f"{where}: the written value's batch dim does not line up with the target's")


def analyse(nodes, sym, known: dict | None = None) -> RowAnalysis:
    """Prove that ``nodes`` (the compute nodes, in order) keep rows apart along ``sym``.

    ``known``: nodes built by the backend's own rewrites that are row-wise by construction, each
    with the (tensor, dim) pairs it reads or writes by batch row (they add row capacities).
    """
    analysis = _Analysis(sym, known or {})
    try:
        for node in nodes:
            analysis.check(node)
    except _Refused as refused:
        return RowAnalysis(str(refused))
    return RowAnalysis(None, tuple(analysis.capacities))


def evaluate_rows(capacities, values: dict) -> int | None:
    """The fewest rows any capacity allows at these symbol values (None: no limit; 0 when one cannot
    be evaluated, which allows no padding)."""
    limit = None
    for capacity in capacities:
        rows = capacity.rows
        if not isinstance(rows, int):
            rows = rows.xreplace(values)
            rows = int(rows) if not getattr(rows, "free_symbols", None) else 0
        limit = rows if limit is None else min(limit, rows)
    return limit


