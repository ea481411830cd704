"""Sizes as Dynamo's symbols, and their values in a real call.

Compute pieces are compiled once for symbolic shapes (``s0`` for the batch); capture, padding and
up-front capture need concrete sizes at some batch: the values of the symbols in a real call
(:func:`symbol_values`), an expression evaluated at chosen values (:func:`evaluate`,
:func:`strides_at`), or a zero tensor shaped like a fake one (:func:`materialize`).
"""

from __future__ import annotations

from typing import Any

import torch

from .._torch_internals import is_symbol, sym_expr


def evaluate(expr, values: dict) -> int:
    """An int from a sympy size expression (or an int), given every symbol's value."""
    result = expr.xreplace(values) if hasattr(expr, "xreplace") else expr
    if getattr(result, "free_symbols", None):
        raise ValueError(f"cannot evaluate {expr}: no value for {sorted(map(str, result.free_symbols))}")
    return int(result)


def symbol_values(fake_inputs: list, args: tuple) -> dict:
    """Every symbol that is a whole input dim or a SymInt input, mapped to its value in ``args``."""
    values = {}
    for fake, real in zip(fake_inputs, args):
        if is_symbol(fake):
            values[sym_expr(fake)] = int(real)
        elif isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor):
            for size, n in zip(fake.shape, real.shape):
                if is_symbol(size):
                    values[sym_expr(size)] = n
    return values


def strides_at(fake: torch.Tensor, values: dict) -> tuple | None:
    """A fake tensor's strides at these symbol values, or None where a symbol has no value."""
    try:
        return tuple(evaluate(sym_expr(s), values) for s in fake.stride())
    except ValueError:
        return None


def materialize(fake: Any, values: dict, device: torch.device | None = None) -> Any:
    """A real zero-filled stand-in for a fake value, its sizes evaluated at ``values``."""
    if isinstance(fake, (tuple, list)):
        return type(fake)(materialize(f, values, device) for f in fake)
    if isinstance(fake, torch.Tensor):
        size = [evaluate(sym_expr(s), values) for s in fake.shape]
        stride = [evaluate(sym_expr(s), values) for s in fake.stride()]
        out = torch.empty_strided(size, stride, dtype=fake.dtype, device=device or fake.device)
        return out.zero_()
    if isinstance(fake, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return evaluate(sym_expr(fake), values)
    return fake
