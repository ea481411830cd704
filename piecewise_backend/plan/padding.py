"""Padding a batch up to a capture size: where it is safe, and which dims to pad.

A batch of 5 replays the graph captured for 8: the runner copies the 5 real rows into the first 5
rows of the captured input buffers, replays, and hands back the first 5 rows of each output. Rows
5..7 compute garbage that nobody reads. That is only right when

* every row's result provably depends on that row alone along the padded dim: ``row_independence``
  proves it op by op (a positive rule: an op it does not know refuses padding);
* the pieces write nothing the caller owns at the caller's positions (full mode may capture a write
  into a buffer: padded rows would write rows the caller did not pass), unless the write is one
  of the decode rewrite's masked ones (``rewrite/kv_writes.py``);
* the padded size appears in each piece's inputs and outputs as one plain dim (``[s0, 1, H]``,
  not ``[2*s0, H]``), so "the first B rows" is a slice;
* and, per call, the padded size is no larger than the rows of any tensor the graph reads or
  writes by batch row (``cache[:B]``): the *row capacity*, checked by the capture policy.

Anything else and the graph is captured at exact capture sizes only, with the reason in its stats.
Padded input buffers start zeroed and later hold only real rows of earlier calls, so an index
tensor's padded rows are always valid indices (garbage there could trip a device-side assert).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from .._torch_internals import sym_expr
from .rows.row_independence import analyse
from .types import PiecePadding


def _padded_dims(value: Any, sym) -> list[int] | None:
    """Dims of ``value`` whose size is exactly ``sym``; None if ``sym`` appears in a size otherwise."""
    dims = []
    for d, size in enumerate(value.shape):
        if isinstance(size, torch.SymInt) and sym in sym_expr(size).free_symbols:
            if sym_expr(size) != sym:
                return None
            dims.append(d)
    return dims


def piece_padding(name: str, fake_args: list, fake_out: Any, sym) -> PiecePadding | str:
    """The padding of one compute piece, or why it cannot be padded."""
    arg_dims, scalars = {}, {}
    for i, value in enumerate(fake_args):
        if isinstance(value, torch.SymInt):
            if sym in sym_expr(value).free_symbols:
                scalars[i] = sym_expr(value)
        elif isinstance(value, torch.Tensor):
            dims = _padded_dims(value, sym)
            if dims is None or len(dims) > 1:
                return f"{name}: input {i} has shape {tuple(value.shape)}, not one plain batch dim"
            if dims:
                arg_dims[i] = dims[0]
    out_dims = []
    for j, value in enumerate(fake_out if isinstance(fake_out, (tuple, list)) else (fake_out,)):
        if isinstance(value, torch.Tensor):
            dims = _padded_dims(value, sym)
            if dims is None or len(dims) > 1:
                return f"{name}: output {j} has shape {tuple(value.shape)}, not one plain batch dim"
            out_dims.append(dims[0] if dims else None)
        else:
            if (
                isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) and sym in sym_expr(value).free_symbols
            ):  # a graph keeps the padded size's value
                return f"{name}: output {j} is a number computed from the batch size ({sym_expr(value)})"
            out_dims.append(None)
    return PiecePadding(arg_dims, tuple(out_dims), scalars)


def plan_padding(
    sym,
    compute_nodes,
    pieces: dict,
    input_writes: dict,
    row_access: dict | None = None,
    declared: frozenset = frozenset(),
) -> tuple[dict | None, str | None, tuple]:
    """Padding of every compute piece and the row capacities, or (None, reason, ()) when the graph
    cannot be padded.

    ``pieces`` maps piece name -> (fake args, fake output); ``input_writes`` maps piece name -> the
    graph inputs it writes at the caller's positions; ``row_access``: the rewrites' own nodes that
    read or write buffers by batch row (see ``row_independence.analyse``); ``declared``: the ops the
    user declares row-wise (``row_independent_ops``).
    """
    for name, written in input_writes.items():
        if written:
            return None, f"{name} writes {', '.join(written)}: padded rows would write rows the caller did not pass", ()
    rows = analyse(compute_nodes, sym, row_access, declared)
    if rows.refusal:
        return None, rows.refusal, ()
    out = {}
    for name, (fake_args, fake_out) in pieces.items():
        plan = piece_padding(name, fake_args, fake_out, sym)
        if isinstance(plan, str):
            return None, plan, ()
        out[name] = plan
    return out, None, rows.capacities
