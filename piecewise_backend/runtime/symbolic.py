"""Sizes as the graph's symbols, and their values in a real call.

Compute pieces are compiled once for symbolic shapes (``s0`` for the batch); the plan describes
their tensors with sizes that are ints or sympy expressions in those symbols (``plan.types.TensorSpec``).
Capture, padding and up-front capture need concrete sizes at some batch: the values of the symbols
in a real call (:func:`symbol_values`), an expression evaluated at chosen values (:func:`evaluate`,
:func:`strides_at`, :func:`rows_at`), or a zero tensor shaped like a described one (:func:`materialize`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..plan.types import SymSpec, TensorSpec


def evaluate(expr, values: dict) -> int:
    """An int from a sympy size expression (or an int), given every symbol's value."""
    result = expr.xreplace(values) if hasattr(expr, "xreplace") else expr
    if getattr(result, "free_symbols", None):
        raise ValueError(f"cannot evaluate {expr}: no value for {sorted(map(str, result.free_symbols))}")
    return int(result)


def rows_at(capacities, values: dict) -> int | None:
    """The fewest rows any of the plan's ``Capacity`` values allows at these symbol values (None: no
    limit; 0 when one cannot be evaluated, which allows no padding)."""
    limit = None
    for capacity in capacities:
        rows = capacity.rows
        if not isinstance(rows, int):
            rows = rows.xreplace(values)
            rows = int(rows) if not getattr(rows, "free_symbols", None) else 0
        limit = rows if limit is None else min(limit, rows)
    return limit


def row_limit(capacities: tuple, symbols: tuple) -> Callable[[tuple], int | None] | None:
    """``key -> rows``: the most rows a padded batch may have at a shape key (None: no cap)."""
    return (lambda key: rows_at(capacities, dict(zip(symbols, key)))) if capacities else None


def spec_symbols(specs) -> set:
    """Every symbol the described inputs' sizes, strides and SymInts are written in."""
    out = set()
    for spec in specs:
        if isinstance(spec, TensorSpec):
            for size in (*spec.shape, *spec.strides):
                out |= set(getattr(size, "free_symbols", ()))
        elif isinstance(spec, SymSpec):
            out |= set(getattr(spec.expr, "free_symbols", ()))
    return out


def _is_symbol(size) -> bool:
    return getattr(size, "is_Symbol", False)


def symbol_values(specs, args: tuple) -> dict:
    """Every symbol that is a whole input dim or a SymInt input, mapped to its value in ``args``."""
    values = {}
    for spec, real in zip(specs, args):
        if isinstance(spec, SymSpec):
            if _is_symbol(spec.expr):
                values[spec.expr] = int(real)
        elif isinstance(spec, TensorSpec) and isinstance(real, torch.Tensor):
            for size, n in zip(spec.shape, real.shape):
                if _is_symbol(size):
                    values[size] = n
    return values


def strides_at(spec: TensorSpec, values: dict) -> tuple | None:
    """A described tensor's strides at these symbol values, or None where a symbol has no value."""
    try:
        return tuple(evaluate(s, values) for s in spec.strides)
    except ValueError:
        return None


def materialize(spec: Any, values: dict, device: torch.device | None = None) -> Any:
    """A real zero-filled stand-in for a described value, its sizes evaluated at ``values``."""
    if isinstance(spec, (tuple, list)):
        return type(spec)(materialize(s, values, device) for s in spec)
    if isinstance(spec, TensorSpec):
        size = [evaluate(s, values) for s in spec.shape]
        stride = [evaluate(s, values) for s in spec.strides]
        return torch.empty_strided(size, stride, dtype=spec.dtype, device=device or spec.device).zero_()
    if isinstance(spec, SymSpec):
        return evaluate(spec.expr, values)
    return spec
