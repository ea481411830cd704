"""Padding a batch up to a capture size: where it is safe, and which dims to pad.

A batch of 5 replays the graph captured for 8: the runner copies the 5 real rows into the first 5
rows of the captured input buffers, replays, and hands back the first 5 rows of each output. Rows
5..7 compute garbage that nobody reads. That is only right when

* every row's result depends on that row alone along the padded dim (token-wise ops, matmuls with
  weights, attention within a sequence). A node whose inputs are batched and whose output is not
  (``x.sum(0)``, ``x[-1]``, ``x.T @ x``), or a scan/sort/softmax along the batch dim, mixes the
  garbage rows into real ones;
* the pieces write nothing the caller owns (full mode may capture a KV-cache write: padded rows
  would write cache rows the caller did not pass);
* the padded size appears in each piece's inputs and outputs as one plain dim (``[s0, 1, H]``,
  not ``[2*s0, H]``), so "the first B rows" is a slice.

Anything else and the graph is captured at exact capture sizes only, with the reason in its stats.
Padded input buffers start zeroed and later hold only real rows of earlier calls, so an index
tensor's padded rows are always valid indices (garbage there could trip a device-side assert).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

from . import graph_facts as facts
from .op_names import display_name

# Ops that combine values along a dim while keeping its size: wrong if that dim is the padded one.
_ALONG_DIM_OPS = {
    "softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum", "cumprod", "cummax", "cummin",
    "logcumsumexp", "sort", "argsort", "flip", "roll", "topk", "kthvalue", "median", "mode", "diff",
}


@dataclasses.dataclass(frozen=True)
class PiecePadding:
    """How to pad one compute piece.

    Attributes:
        arg_dims: tensor arg index -> the dim that holds the padded size.
        out_dims: for each output (flattened), the dim to slice back, or None.
        scalar_exprs: SymInt arg index -> its sympy expression (re-evaluated at the padded size).
        arg_strides: padded tensor arg index -> its strides as expressions (what the compiled piece
            expects, evaluated at the padded size for the buffer the runner allocates).
    """

    arg_dims: dict
    out_dims: tuple
    scalar_exprs: dict
    arg_strides: dict


def _padded_dims(value: Any, sym) -> list[int] | None:
    """Dims of ``value`` whose size is exactly ``sym``; None if ``sym`` appears in a size otherwise."""
    dims = []
    for d, size in enumerate(value.shape):
        if isinstance(size, torch.SymInt) and sym in size.node.expr.free_symbols:
            if size.node.expr != sym:
                return None
            dims.append(d)
    return dims


def _dim_arg(node: torch.fx.Node):
    if "dim" in node.kwargs:
        return node.kwargs["dim"]
    if "dims" in node.kwargs:
        return node.kwargs["dims"]
    return node.args[1] if len(node.args) > 1 else None


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    name = getattr(node.target, "__name__", "")
    return name.split(".")[0]


def row_mixing(nodes, sym) -> str | None:
    """Why these (compute) nodes would mix padded rows into real ones, or None if they do not."""
    for node in nodes:
        if node.op not in ("call_function", "call_method") or facts.is_sym_node(node):
            continue
        inputs = [facts.example_value(i) for i in node.all_input_nodes]
        batched = [v for v in inputs if isinstance(v, torch.Tensor) and _batch_dims(v, sym)]
        if not batched:
            continue
        out = facts.example_value(node)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        if outs and not any(_batch_dims(o, sym) for o in outs):
            return f"{display_name(node)} turns a batched tensor into an un-batched one (reduces over the batch)"
        if _op_name(node) in _ALONG_DIM_OPS:
            dim = _dim_arg(node)
            ndim = batched[0].dim()
            dims = dim if isinstance(dim, (tuple, list)) else (dim,)
            if dim is None or any(not isinstance(d, int) or d % max(ndim, 1) in _batch_dims(batched[0], sym) for d in dims):
                return f"{display_name(node)} combines values along the batch dim"
    return None


def _batch_dims(value: torch.Tensor, sym) -> set:
    return {d for d, s in enumerate(value.shape) if isinstance(s, torch.SymInt) and sym in s.node.expr.free_symbols}


def piece_padding(name: str, fake_args: list, fake_out: Any, sym) -> PiecePadding | str:
    """The padding of one compute piece, or why it cannot be padded."""
    arg_dims, scalars, strides = {}, {}, {}
    for i, value in enumerate(fake_args):
        if isinstance(value, torch.SymInt):
            if sym in value.node.expr.free_symbols:
                scalars[i] = value.node.expr
        elif isinstance(value, torch.Tensor):
            dims = _padded_dims(value, sym)
            if dims is None or len(dims) > 1:
                return f"{name}: input {i} has shape {tuple(value.shape)}, not one plain batch dim"
            if dims:
                arg_dims[i] = dims[0]
                strides[i] = tuple(s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in value.stride())
    out_dims = []
    for j, value in enumerate(fake_out if isinstance(fake_out, (tuple, list)) else (fake_out,)):
        if isinstance(value, torch.Tensor):
            dims = _padded_dims(value, sym)
            if dims is None or len(dims) > 1:
                return f"{name}: output {j} has shape {tuple(value.shape)}, not one plain batch dim"
            out_dims.append(dims[0] if dims else None)
        else:
            out_dims.append(None)
    return PiecePadding(arg_dims, tuple(out_dims), scalars, strides)


def plan_padding(sym, compute_nodes, pieces: dict, input_writes: dict) -> tuple[dict | None, str | None]:
    """Padding of every compute piece, or (None, reason) when the graph cannot be padded.

    ``pieces`` maps piece name -> (fake args, fake output); ``input_writes`` maps piece name -> the
    graph inputs it writes.
    """
    for name, written in input_writes.items():
        if written:
            return None, f"{name} writes {', '.join(written)}: padded rows would write rows the caller did not pass"
    reason = row_mixing(compute_nodes, sym)
    if reason:
        return None, reason
    out = {}
    for name, (fake_args, fake_out) in pieces.items():
        plan = piece_padding(name, fake_args, fake_out, sym)
        if isinstance(plan, str):
            return None, plan
        out[name] = plan
    return out, None


def evaluate(expr, values: dict) -> int:
    """An int from a sympy size expression, given every symbol's value."""
    result = expr.xreplace(values) if hasattr(expr, "xreplace") else expr
    if getattr(result, "free_symbols", None):
        raise ValueError(f"cannot evaluate {expr}: no value for {sorted(map(str, result.free_symbols))}")
    return int(result)
