"""The op tables of the row-independence proof: which ops keep batch rows apart, and along what.

Names are as Dynamo records them (torch functions, Tensor methods, ``operator``), with the in-place
form folded into the op (``add_`` -> ``add``). A name missing here makes the proof refuse padding;
adding one is a claim about that op's semantics, so each table says what it claims.
"""

from __future__ import annotations

import builtins

import torch
import torch.fx

from ... import _torch_internals
from ...fx import graph_facts as facts
from ...op_names import canonical_op_name


class Refused(Exception):
    """Raised inside the analysis with the reason rows may mix."""


# pointwise: each output element reads the inputs' elements at its own index (broadcast aligned)
POINTWISE = frozenset(
    """
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
""".split()
)

# name -> (position of the dim argument counting self as 0, default dims when absent: None = all)
ALONG_DIM = {
    **{
        n: (1, None)
        for n in """all amax amin any argmax argmin count_nonzero logsumexp max mean median min
       mode nanmean nanmedian nansum prod std std_mean sum var var_mean aminmax""".split()
    },
    **{
        n: (1, "required")
        for n in """softmax log_softmax cumsum cumprod cummax cummin logcumsumexp
       sort argsort flip""".split()
    },
    "topk": (2, -1),
    "kthvalue": (2, -1),
    "norm": (2, None),
    "normalize": (2, 1),
    "roll": (2, None),
    "diff": (2, -1),
    "glu": (1, -1),
    "tril": (None, (-2, -1)),
    "triu": (None, (-2, -1)),
}
SPLIT_ALONG = {
    "split": (2, 0),
    "chunk": (2, 0),
    "unbind": (1, 0),
    "split_with_sizes": (2, 0),
    "tensor_split": (2, 0),
    "narrow": (1, None),
    "select": (1, None),
    "repeat_interleave": (2, None),
}
RESHAPES = frozenset(
    "view reshape view_as reshape_as flatten unflatten _unsafe_view view_as_complex view_as_real".split()
)
MOVES = frozenset(
    "unsqueeze squeeze transpose permute movedim moveaxis swapaxes swapdims t T mT expand "
    "expand_as broadcast_to numpy_T".split()
)  # numpy_T: how torch 2.14's Dynamo records x.T
METADATA = frozenset(
    "size stride dim numel getattr sym_size sym_stride sym_numel sym_storage_offset "
    "storage_offset is_contiguous _assert_tensor_metadata _assert_scalar "
    "_set_grad_enabled _enter_autocast _exit_autocast".split()
)
MATMULS = frozenset("matmul mm bmm __matmul__".split())
NORMS_OVER_LAST = {"layer_norm": 1, "rms_norm": 1}  # position of normalized_shape
CONV_NDIM = {"conv1d": 3, "conv2d": 4, "conv3d": 5, "conv_transpose1d": 3, "conv_transpose2d": 4, "conv_transpose3d": 5}
TRUSTED_MODULES = ("torch", "operator", "builtins", "math", "_operator")
# tensor-parallel collectives that combine ranks element by element (every rank pads alike); an
# all-gather or reduce-scatter along the batch dim would not, and is not listed
ELEMENTWISE_COLLECTIVES = frozenset({"all_reduce", "all_reduce_", "wait_tensor"})


def op_name(node: torch.fx.Node) -> str | None:
    """The name to look an op up by, or None for a callable this module does not vouch for (a
    user's own custom op with a familiar name must not pass for the torch op)."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return None
    target = node.target
    if _torch_internals.is_op_overload(target) or _torch_internals.is_op_packet(target):
        namespace, _, name = canonical_op_name(target).partition("::")
        if namespace == "_c10d_functional" and name in ELEMENTWISE_COLLECTIVES:
            return "wait_tensor"  # a sum across ranks, element by element: rows stay rows
        return name if namespace in ("aten", "prims") else None
    module = getattr(target, "__module__", None) or ""
    if target in (builtins.getattr, builtins.min, builtins.max) or module.split(".")[0] in TRUSTED_MODULES:
        return getattr(target, "__name__", None)
    return None


def base(name: str) -> str:
    """``add_`` -> ``add`` (the in-place form keeps rows apart exactly when the op does)."""
    return name[:-1] if name.endswith("_") and not name.endswith("__") and len(name) > 1 else name


def norm_dim(d, ndim: int):
    if isinstance(d, torch.fx.Node):
        d = facts.example_value(d)
    if not isinstance(d, int):
        return None
    return d % ndim if ndim else d


def dims_arg(node: torch.fx.Node, position, default):
    """The dim argument of an op, as given (kwarg ``dim``/``dims``/``axis`` or positional)."""
    for key in ("dim", "dims", "axis"):
        if key in node.kwargs:
            return node.kwargs[key]
    if position is not None and len(node.args) > position:
        return node.args[position]
    return default


def as_dims(value, ndim: int) -> set | None:
    """A dim argument as a set of normalised dims; None when it is not a plain int or a list of them."""
    items = value if isinstance(value, (list, tuple)) else (value,)
    out = set()
    for d in items:
        d = norm_dim(d, ndim)
        if d is None:
            return None
        out.add(d)
    return out


def prefix(shape, dim: int):
    """The product of the sizes before ``dim``, or None if one of them is symbolic."""
    product = 1
    for s in shape[:dim]:
        if isinstance(s, torch.SymInt):
            return None
        product *= int(s)
    return product
