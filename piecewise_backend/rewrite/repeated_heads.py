"""GQA written out: keys/values whose heads were repeated for the query, seen through to the cache.

Models that predate ``enable_gqa`` repeat each cache head for the query heads that share it, as
``keys.repeat_interleave(groups, dim=1)`` or transformers' ``repeat_kv``
(``keys[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)``). Both are a copy of
the keys that attention reads once; the graph-safe decode kernel reads the cache head a query head
maps to directly (``head // groups``), so over a growing prefix these calls take the graph path
like ``enable_gqa=True``, and the copy goes away.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .._torch_internals import sym_expr
from ..fx import graph_facts as facts


def repeated_heads(node) -> tuple[torch.fx.Node, int, tuple] | None:
    """``(inner, groups, nodes)`` if ``node`` is ``inner`` [B, H, T, D] with each head repeated
    ``groups`` times along dim 1 (``nodes``: the repeat's own nodes, outermost first); else None."""
    if not isinstance(node, torch.fx.Node):
        return None
    return _repeat_interleave(node) or _repeat_kv(node)


def _repeat_interleave(node: torch.fx.Node):
    if not (
        node.op == "call_method"
        and node.target == "repeat_interleave"
        or node.op == "call_function"
        and node.target is torch.repeat_interleave
    ):
        return None
    args = list(node.args) + [None] * 3
    inner, repeats = args[0], node.kwargs.get("repeats", args[1])
    dim = node.kwargs.get("dim", args[2])
    if not isinstance(inner, torch.fx.Node) or not isinstance(repeats, int) or dim not in (1, -3):
        return None
    return (inner, repeats, (node,)) if _four_dims(inner) else None


def _repeat_kv(node: torch.fx.Node):
    """``inner[:, :, None].expand(b, h, g, t, d).reshape(b, h * g, t, d)`` (or ``unsqueeze(2)``)."""
    if not (node.op == "call_method" and node.target in ("reshape", "view")):
        return None
    expand = node.args[0]
    if not (isinstance(expand, torch.fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return None
    unsqueezed = expand.args[0]
    inner = _unsqueezed_at_2(unsqueezed)
    if inner is None or not _four_dims(inner):
        return None
    shape, wide = facts.example_value(inner).shape, facts.example_value(node).shape
    heads = wide[1]
    if len(wide) != 4 or not isinstance(heads, int) or heads % shape[1]:
        return None
    groups = heads // shape[1]
    same = [sym_expr(a) == sym_expr(b) for a, b in zip((shape[0], shape[2], shape[3]), (wide[0], wide[2], wide[3]))]
    return (inner, groups, (node, expand, unsqueezed)) if all(same) else None


def _unsqueezed_at_2(node) -> torch.fx.Node | None:
    """``x`` if ``node`` is ``x[:, :, None]`` (trailing full slices allowed) or ``x.unsqueeze(2)``."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_method" and node.target == "unsqueeze" and node.args[1:] == (2,):
        return node.args[0]
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], tuple):
        index = node.args[1]
        full = slice(None)
        if len(index) >= 3 and index[:2] == (full, full) and index[2] is None and all(i == full for i in index[3:]):
            return node.args[0]
    return None


def _four_dims(node: torch.fx.Node) -> bool:
    value = facts.example_value(node)
    return isinstance(value, torch.Tensor) and value.dim() == 4 and isinstance(value.shape[1], int)
