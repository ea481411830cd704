"""Writes into the caller's tensors that a captured graph can make itself.

A compute piece that writes a graph input must write the caller's tensor: the input is used in
place, at the address the graph was captured with, never through the runner's copy. That holds
for parameters and buffers (``mark_static_address`` too) and, here, for any input written in
place: its address joins the weight set's (``runtime/capture/weight_sets.py``), so a new tensor gets
graphs of its own. Two kinds of write are safe to capture and cost an eager launch each otherwise:

* **index writes** of a whole input (``index_copy_``, ``index_put_``, ``scatter_``, ``masked_fill_``, ``x[idx] = v``
  with a tensor index): the position is data the graph reads at replay. This is how Hugging Face's
  ``StaticCache`` fills its cache: ``keys.index_copy_(2, cache_position, k)``.
* **whole-tensor updates of a tensor of fixed size** (``StaticCache``'s ``cumulative_length.add_(1)``):
  no batch row to pad, no position.

Writes into views (``cache[:B, :, p] = k``, ``cache[:B].index_copy_``, ``view.copy_(k)``) stay eager: captured
as they are they would forbid padding, so ``rewrite/kv_writes.py`` turns the per-step ones into
masked writes instead. Nothing that needs a per-step Python int is captured here.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..fx import graph_facts as facts

_INDEX_WRITES = {
    "index_copy_",
    "index_put_",
    "index_add_",
    "index_fill_",
    "scatter_",
    "scatter_add_",
    "scatter_reduce_",
    "masked_fill_",
    "masked_scatter_",
}


def _name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    overload = getattr(node.target, "overloadpacket", None)
    return getattr(overload or node.target, "__name__", "")


def _tensor_index(index) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.fx.Node) and isinstance(facts.example_value(i), torch.Tensor) for i in items)


def is_graph_safe_write(node: torch.fx.Node, written: torch.fx.Node, root: torch.fx.Node, steps: frozenset) -> bool:
    """May a compute piece make ``node``'s write into ``written`` (a view of input ``root``)?

    Only writes of the input itself, not of a view: a write into ``cache[:B]`` of a larger buffer
    would, padded, write rows the caller did not pass (it stays eager, or ``kv_writes`` masks it).
    A write of a whole input with batch rows forbids padding (``plan/``); one without does not.
    """
    if written is not root or facts.uses_symbols(node, steps):
        return False
    name = _name(node)
    if name in _INDEX_WRITES:
        return True
    if (name == "__setitem__" or node.target is operator.setitem) and len(node.args) > 1:
        return _tensor_index(node.args[1])
    value = facts.example_value(root)
    return isinstance(value, torch.Tensor) and not any(isinstance(s, torch.SymInt) for s in value.shape)


def graph_safe_writes(graph: torch.fx.Graph, in_place: frozenset, steps: frozenset) -> dict:
    """Every node whose writes into inputs may be captured: node -> names of the inputs it writes.

    ``in_place``: names of the inputs that may be written this way (empty: none).
    """
    if not in_place:
        return {}
    roots = facts.alias_roots(graph)
    out = {}
    for node in graph.nodes:
        written = facts.mutated_inputs(node)
        targets = {roots[m] for m in written}
        if (
            written
            and all(r.op == "placeholder" and r.name in in_place for r in targets)
            and all(is_graph_safe_write(node, m, roots[m], steps) for m in written)
        ):
            out[node] = {r.name for r in targets}
    return out


def written_in_place(graph: torch.fx.Graph, steps: frozenset) -> frozenset:
    """Names of the graph inputs some graph-safe write targets: to be used in place (fixed address)."""
    placeholders = frozenset(n.name for n in facts.placeholders(graph))
    return frozenset(name for names in graph_safe_writes(graph, placeholders, steps).values() for name in names)


def only_whole_writes(graph: torch.fx.Graph, safe_writes: dict) -> frozenset:
    """Names of the inputs that only graph-safe writes of the whole input write (padding may ignore
    those without batch rows: a padded row has nothing of theirs to write)."""
    roots = facts.alias_roots(graph)
    other = {roots[m].name for n in graph.nodes if n not in safe_writes for m in facts.mutated_inputs(n)}
    return frozenset(name for names in safe_writes.values() for name in names) - other
