"""Facts about the nodes of a Dynamo graph that decide where each node may run.

Three questions, answered from the fake values Dynamo stores in ``node.meta["example_value"]``:

* **Which symbols are per-step scalars?** A SymInt graph input whose symbol appears in no input
  tensor's shape (a Python-int KV position ``pos``) changes every decode step. Batch symbols appear
  in input shapes (``input_ids: [s0, 1]``). A compute piece that used a step scalar would need a new
  CUDA graph every step, so nodes that *need* one (their own value's shape/strides/offset, or the
  shapes of what they read, mention it) must run eagerly.
* **Which nodes mutate what?** In-place ops on graph inputs (a KV cache write) must run eagerly:
  a captured graph writes into the buffers it was captured with, not the caller's tensor.
* **What aliases what?** A view shares its input's storage; we follow views back to a *root* so
  that reordering never moves a read across a write of the same memory.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx

from .. import _torch_internals

_INPLACE_OPERATORS = {
    operator.setitem,
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.ilshift,
    operator.irshift,
}

# Ops that change global state that split_module tracks as regions; never reorder across them.
_BARRIER_NAMES = {"_set_grad_enabled", "set_grad_enabled", "_enter_autocast", "_exit_autocast"}


def example_value(node: torch.fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def _sym_expr_symbols(value) -> set:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return set(_torch_internals.sym_expr(value).free_symbols)
    return set()


def value_symbols(value, *, with_offset: bool = True) -> set:
    """Free symbols of a fake value: a SymInt, or a tensor's sizes, strides (and storage offset)."""
    if isinstance(value, (list, tuple)):
        out: set = set()
        for v in value:
            out |= value_symbols(v, with_offset=with_offset)
        return out
    if isinstance(value, torch.Tensor):
        out = set()
        for s in (*value.shape, *value.stride()):
            out |= _sym_expr_symbols(s)
        if with_offset:
            out |= _sym_expr_symbols(value.storage_offset())
        return out
    return _sym_expr_symbols(value)


def placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def python_scalar_inputs(graph: torch.fx.Graph) -> frozenset:
    """Indices of the inputs that are Python floats passed as 0-dim CPU tensors (``dynamic=True``).

    They are host values, not device data: a CUDA graph keeps the value it was captured with, so
    the shape key holds their values (``plan.ShapeKey``), and they do not make a CUDA graph "mixed
    device" (a float ``eps`` would otherwise turn every graph of a ``dynamic=True`` model off).
    """
    out = set()
    for i, node in enumerate(placeholders(graph)):
        value = example_value(node)
        if (
            _torch_internals.is_python_scalar_input(node)
            and isinstance(value, torch.Tensor)
            and value.dim() == 0
            and value.device.type == "cpu"
        ):
            out.add(i)
    return frozenset(out)


def step_symbols(graph: torch.fx.Graph) -> frozenset:
    """Symbols of SymInt inputs that no input tensor's shape mentions: per-step scalars."""
    shape_syms: set = set()
    scalar_syms: set = set()
    for node in placeholders(graph):
        value = example_value(node)
        if isinstance(value, torch.Tensor):
            shape_syms |= value_symbols(value, with_offset=False)
        else:
            scalar_syms |= _sym_expr_symbols(value)
    return frozenset(scalar_syms - shape_syms)


def data_dependent_symbols(graph: torch.fx.Graph) -> frozenset:
    """Symbols the graph's data decide, not its inputs' shapes: ``k = n.item()`` (under
    ``capture_scalar_outputs``), a ``nonzero`` count. A captured graph would replay the value of its
    capture whatever the data says (an ``.item()`` of a CPU tensor does not even fail the capture),
    and the shape key cannot hold them (they are known only once the graph runs), so nodes that make
    or need them run eagerly, as nodes that need a step scalar do."""
    given: set = set()
    made: set = set()
    for node in graph.nodes:
        (given if node.op == "placeholder" else made).update(value_symbols(example_value(node)))
    return frozenset(made - given)


def is_per_step(node: torch.fx.Node, steps: frozenset) -> bool:
    """Does ``node``'s own value (a SymInt such as a KV length) change every decode step?"""
    return bool(value_symbols(example_value(node)) & steps)


def uses_symbols(node: torch.fx.Node, symbols: frozenset) -> bool:
    """True if running ``node`` needs one of ``symbols`` (step scalars, data-dependent sizes): in its
    own value, or in the shapes it reads.

    What it reads counts by shape and strides only: a tensor computed from ``pos`` by value (the
    attention output) or a view at a ``pos``-dependent offset (a RoPE row) can feed a compute piece.
    """
    if not symbols:
        return False
    if is_per_step(node, symbols):
        return True
    return any(value_symbols(example_value(i), with_offset=False) & symbols for i in node.all_input_nodes)


def is_barrier(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") in _BARRIER_NAMES


# Functions whose schema does not say they write an argument, but which do: batch norm in train
# mode updates its running statistics in place. name -> (position of ``training``, positions written).
_HIDDEN_WRITES = {
    "batch_norm": {"torch.nn.functional": (5, (1, 2)), "torch": (5, (3, 4))},
    "instance_norm": {"torch.nn.functional": (5, (1, 2)), "torch": (5, (3, 4))},
}


def _hidden_writes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The running statistics a train-mode ``batch_norm``/``instance_norm`` call updates."""
    name = getattr(node.target, "__name__", "")
    module = getattr(node.target, "__module__", "") or ""
    forms = _HIDDEN_WRITES.get(name, {})
    form = forms.get(module) or forms.get("torch" if module.startswith("torch._C") else module)
    if form is None:
        return []
    training_at, written_at = form
    training = (
        node.args[training_at]
        if len(node.args) > training_at
        else node.kwargs.get("use_input_stats" if name == "instance_norm" else "training", name == "instance_norm")
    )
    if training is False:
        return []
    return [node.args[i] for i in written_at if i < len(node.args) and isinstance(node.args[i], torch.fx.Node)]


def mutated_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The input nodes ``node`` writes in place (empty for pure ops)."""
    if node.op == "call_method":
        name = str(node.target)
        if name == "__setitem__" or (name.endswith("_") and not name.startswith("_")):
            return [a for a in node.args[:1] if isinstance(a, torch.fx.Node)]
    elif node.op == "call_function":
        target = node.target
        out = node.kwargs.get("out")
        if isinstance(out, torch.fx.Node):
            return [out]
        if isinstance(out, (tuple, list)):
            return [o for o in out if isinstance(o, torch.fx.Node)]
        if target in _INPLACE_OPERATORS:
            first = node.args[0] if node.args else None
            if isinstance(first, torch.fx.Node) and isinstance(example_value(first), torch.Tensor):
                return [first]
            return []
        if _torch_internals.is_op_overload(target) or _torch_internals.is_op_packet(target):
            # Dynamo records ``torch.ops.ns.name(...)`` as the packet on torch 2.11 (the overload on
            # 2.13): an argument any overload writes is written
            overloads = (
                [getattr(target, o) for o in target.overloads()] if _torch_internals.is_op_packet(target) else [target]
            )
            written = {}
            for overload in overloads:
                for i, arg in enumerate(_torch_internals.op_schema_arguments(overload)):
                    if arg.alias_info is not None and arg.alias_info.is_write:
                        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                        if isinstance(value, torch.fx.Node):
                            written[value] = None
            return list(written)
        hidden = _hidden_writes(node)
        if hidden:
            return hidden
        name = getattr(target, "__name__", "")
        not_in_place = getattr(target, "__module__", "") in ("_operator", "operator")  # and_, or_: a & b, a | b
        if name.endswith("_") and not name.startswith("_") and not not_in_place and node.args:
            first = node.args[0]
            if isinstance(first, torch.fx.Node) and isinstance(example_value(first), torch.Tensor):
                return [first]
    return []


def _storage_refs(value) -> set:
    if isinstance(value, (list, tuple)):
        return set().union(*(_storage_refs(v) for v in value)) if value else set()
    if isinstance(value, torch.Tensor):
        ref = _torch_internals.storage_ref(value)
        return {ref} if ref is not None else set()
    return set()


def alias_roots(graph: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """Map each tensor node to the node that owns its memory (itself unless it is a view).

    Each node's storages are looked up once (a storage reference costs ~2 µs: done per consumer,
    a 28-layer graph's analyses spent ~0.4 s of a warm start here)."""
    roots: dict[torch.fx.Node, torch.fx.Node] = {}
    refs_of: dict[torch.fx.Node, set] = {}
    for node in graph.nodes:
        roots[node] = node
        refs = refs_of[node] = _storage_refs(example_value(node))
        if not refs:
            continue
        for inp in node.all_input_nodes:
            if refs & refs_of[inp]:
                roots[node] = roots[inp]
                break
    return roots


def written_inputs(graph: torch.fx.Graph) -> frozenset:
    """Names of the graph inputs some node writes in place (through any view of them)."""
    roots = alias_roots(graph)
    return frozenset(roots[m].name for n in graph.nodes for m in mutated_inputs(n) if roots[m].op == "placeholder")


def is_sym_node(node: torch.fx.Node) -> bool:
    return isinstance(example_value(node), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def tensor_inputs(node: torch.fx.Node) -> Iterable[torch.fx.Node]:
    return (i for i in node.all_input_nodes if isinstance(example_value(i), torch.Tensor))


_CATS = {torch.cat, torch.concat, torch.ops.aten.cat.default}


def grows_by_cat(node: torch.fx.Node, roots: dict) -> bool:
    """``torch.cat([past, new], dim)`` with ``past`` (a view of) a graph input and a symbolic size at ``dim``."""
    if node.op != "call_function" or node.target not in _CATS or not node.args:
        return False
    parts = node.args[0]
    if not isinstance(parts, (list, tuple)):
        return False
    from_input = any(isinstance(p, torch.fx.Node) and roots.get(p, p).op == "placeholder" for p in parts)
    value = example_value(node)
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    return (
        from_input
        and isinstance(value, torch.Tensor)
        and isinstance(dim, int)
        and isinstance(value.shape[dim], torch.SymInt)
        and not _torch_internals.sym_expr(value.shape[dim]).is_number
    )
