"""Naming the ops of a Dynamo graph, so users can say where to split with plain strings.

A Dynamo graph records an op as whatever Python object the model called: the builtin
``torch._C._nn.scaled_dot_product_attention`` (which *is* ``F.scaled_dot_product_attention``), an
``OpOverloadPacket`` such as ``torch.ops.aten.scaled_dot_product_attention``, or an ``OpOverload``
such as ``torch.ops.mylib.paged_attention.default`` (what a ``torch.library.custom_op`` records).
Users should not have to know which: they write ``"aten::scaled_dot_product_attention"`` or
``"mylib::paged_attention"`` and every form of that op matches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _torch_internals

#: SDPA as the dispatcher names it (``F.scaled_dot_product_attention`` records as it): the one
#: spelling of its name in the package.
SDPA = "aten::scaled_dot_product_attention"

#: Split here by default: every form of SDPA a model may call, public or backend-specific.
DEFAULT_SPLITTING_OPS: tuple[str, ...] = (
    SDPA,
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
)

#: The graph-safe decode attention the decode rewrite puts in graphs (``rewrite/graph_attention.py``).
GRAPH_ATTENTION_OP = "piecewise::prefix_attention"

# Python-level callables that are the same op as an aten op (Dynamo records the callable).
_PYTHON_ALIASES: dict[object, str] = {
    F.scaled_dot_product_attention: SDPA,
    _torch_internals.C_SDPA: SDPA,
}


def canonical_op_name(target: object) -> str | None:
    """``"ns::name"`` for an FX ``call_function`` target that is a dispatcher op, else None."""
    if target in _PYTHON_ALIASES:
        return _PYTHON_ALIASES[target]
    if _torch_internals.is_op_overload(target):
        return _torch_internals.op_schema_name(target)  # "ns::name" without the overload
    if _torch_internals.is_op_packet(target):
        return target._qualified_op_name
    if _torch_internals.is_higher_order_op(target):
        return None
    return None


_CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)  # present in torch 2.11 to 2.14


def is_cudagraph_unsafe(target: object) -> bool:
    """Does the op carry ``torch.Tag.cudagraph_unsafe``, torch's own mark for an op that must not be
    captured (Inductor's graph partition splits there)? Such an op is a splitting op whether or not
    the user named it: its author said so where it was defined."""
    if _CUDAGRAPH_UNSAFE is None:
        return False
    if _torch_internals.is_op_packet(target):
        return any(_CUDAGRAPH_UNSAFE in getattr(target, o).tags for o in target.overloads())
    return _torch_internals.is_op_overload(target) and _CUDAGRAPH_UNSAFE in target.tags


def is_random_op(target: object) -> bool:
    """Does the op draw from torch's random generator (``torch.Tag.nondeterministic_seeded``: ``rand``,
    ``dropout``, ``multinomial``...)?"""
    seeded = torch.Tag.nondeterministic_seeded
    if _torch_internals.is_op_packet(target):
        return any(seeded in getattr(target, o).tags for o in target.overloads())
    return _torch_internals.is_op_overload(target) and seeded in target.tags


def display_name(node: torch.fx.Node) -> str:
    """A short human name for a node's op, for tables and error messages."""
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        return f"module {node.target}"
    name = canonical_op_name(node.target)
    if name is not None:
        return name
    return getattr(node.target, "__name__", str(node.target))


def _op_exists(name: str) -> bool:
    ns, _, rest = name.partition("::")
    op_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, ns), op_name)
    except (AttributeError, RuntimeError):
        return False
    return not overload or overload in packet.overloads()


def validate_op_names(names: tuple[str, ...], option: str) -> tuple[str, ...]:
    """Check ``"ns::op"`` strings name registered ops; return them without overload suffixes.

    Raises ValueError naming the bad entry, the accepted form and the defaults.
    """
    out = []
    for name in names:
        if not isinstance(name, str) or "::" not in name:
            raise ValueError(
                f"{option}: {name!r} is not an op name. Use the dispatcher name 'namespace::op' "
                f"(e.g. 'mylib::paged_attention' for torch.library.custom_op('mylib::paged_attention')). "
                f"Defaults: {', '.join(DEFAULT_SPLITTING_OPS)}"
            )
        if not _op_exists(name):
            raise ValueError(
                f"{option}: no op named {name!r} is registered with torch. Register it first "
                f"(torch.library.custom_op / TORCH_LIBRARY) or fix the spelling. "
                f"Defaults: {', '.join(DEFAULT_SPLITTING_OPS)}"
            )
        out.append(name.split(".")[0])
    return tuple(dict.fromkeys(out))


def while_running(op) -> str:
    """What a capture that failed was running (the op whose call raised, or None), and for a custom op
    the two fixes; empty if no op raised (``_torch_internals.OpsInFlight`` watches)."""
    if op is None:
        return ""
    name = canonical_op_name(op) or str(op)
    if name.split("::")[0] in ("aten", "prims"):
        return f" while running {name}"
    return (
        f" while running {name}, a custom op: if it must not be captured (host code, state outside its "
        f"arguments), name it in extra_splitting_ops=[{name!r}] or tag it where it is defined: "
        f"torch.library.custom_op(..., tags=(torch.Tag.cudagraph_unsafe,))"
    )
