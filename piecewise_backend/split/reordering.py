"""The two reorderings that keep compute pieces whole (``splitting.py``'s module docstring says why).

* :func:`hoist`: eager nodes that only read graph inputs and feed compute (``cos[pos:pos+S]``,
  ``pos+S``) move to the top of the graph, into one eager prologue. Only pure nodes move, and only
  views or reads of memory nothing in the graph writes, so moving them cannot change a value.
* :func:`sink`: other eager nodes (the cache write, the cache slices) move down to sit just before
  the next split op, past compute nodes that neither use them nor touch the memory they touch.
"""

from __future__ import annotations

import torch
import torch.fx

from ..fx import graph_facts as facts
from ..kinds import PieceKind

COMPUTE, SPLIT, EAGER = PieceKind.COMPUTE, PieceKind.SPLIT, PieceKind.EAGER


def hoist(graph: torch.fx.Graph, kinds: dict) -> None:
    """Move pure eager nodes that read only graph inputs and feed compute (or, for scalars, only the
    output) to the top of the graph."""
    roots = facts.alias_roots(graph)
    written_roots = {roots[m] for n in graph.nodes for m in facts.mutated_inputs(n)}
    nodes = list(graph.nodes)
    if any(facts.is_barrier(n) for n in nodes):
        return
    available = {n for n in nodes if n.op == "placeholder"}
    candidates = []
    for node in nodes:
        if kinds.get(node) != EAGER or facts.mutated_inputs(node):
            continue
        pure = facts.is_sym_node(node) or all(
            roots[node] is roots[i] or roots[i] not in written_roots for i in facts.tensor_inputs(node)
        )
        if pure and all(i in available for i in node.all_input_nodes):
            available.add(node)
            candidates.append(node)
    # Keep only candidates that (transitively) feed a compute node, and Python-scalar arithmetic
    # that only the output reads (transformers' sliding-window cache returns ``cumulative_length_int
    # + 1`` from each layer: left in place, each one cut the step's graph in two).
    keep: set = set()
    for node in reversed(candidates):
        if (
            any(kinds.get(u) == COMPUTE or u in keep for u in node.users)
            or facts.is_sym_node(node)
            and all(u.op == "output" or u in keep for u in node.users)
        ):
            keep.add(node)
    anchor = [n for n in nodes if n.op == "placeholder"][-1] if available else None
    for node in candidates:
        if node in keep and anchor is not None:
            anchor.append(node)
            anchor = node


def _conflicts(moving: torch.fx.Node, other: torch.fx.Node, roots: dict) -> bool:
    """Can ``moving`` not be moved past ``other`` (which currently runs after it)?"""
    if moving in other.all_input_nodes or facts.is_barrier(other):
        return True
    moving_writes = {roots[m] for m in facts.mutated_inputs(moving)}
    other_writes = {roots[m] for m in facts.mutated_inputs(other)}
    moving_touches = {roots[i] for i in facts.tensor_inputs(moving)} | {roots[moving]}
    other_touches = {roots[i] for i in facts.tensor_inputs(other)} | {roots[other]}
    return bool(moving_writes & other_touches or other_writes & moving_touches)


def sink(graph: torch.fx.Graph, kinds: dict) -> None:
    """Move eager nodes down to just before the next split op, when nothing in between needs them."""
    roots = facts.alias_roots(graph)
    for node in reversed(list(graph.nodes)):
        if kinds.get(node) != EAGER:
            continue
        # Find the next split op, and the start of the eager run that already precedes it.
        cursor, between = node.next, []
        while cursor.op != "output" and kinds.get(cursor) != SPLIT:
            between.append(cursor)
            cursor = cursor.next
        if cursor.op == "output":
            continue
        while between and kinds.get(between[-1]) == EAGER:
            cursor = between.pop()
        if between and not any(_conflicts(node, other, roots) for other in between):
            cursor.prepend(node)
