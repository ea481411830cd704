"""What crosses a piece boundary is a tensor or a scalar, never a container of them.

``torch.split``, ``chunk``, ``unbind``, ``topk`` and ``max(dim)`` are one FX node whose value is a
tuple, read through ``getitem`` nodes. When the partition puts a ``getitem`` in another piece than
its producer (a fused QKV split whose ``k`` and ``v`` go to the attention piece; the graph Dynamo
resumes after a graph break), ``split_module`` passes the whole tuple from piece to piece: a compute
piece then returns, or takes, a tuple nested among its values, which AOTAutograd refuses
(``AssertionError: output spec mismatch``, torch 2.11 and 2.13).

So, after partitioning and before the split, every ``getitem`` of a container joins its producer's
piece, and any other reader of a container (``torch.cat(parts)``, a custom op taking a list) reads
a tuple of ``getitem`` nodes made in the producer's piece. Only the elements cross. Moving a
``getitem`` earlier cannot change a value: it selects an element that already exists (a view of it
sees every later write).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..fx import graph_facts as facts


def _is_container(node: torch.fx.Node) -> bool:
    return isinstance(facts.example_value(node), (tuple, list))


def _selects_from(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Is ``user`` ``node[i]`` for a constant ``i``?"""
    return (
        user.op == "call_function"
        and user.target is operator.getitem
        and user.args[0] is node
        and isinstance(user.args[1], int)
    )


def _elements(graph: torch.fx.Graph, node: torch.fx.Node) -> list[torch.fx.Node]:
    """A ``getitem`` node per element of ``node``'s container, inserted right after it."""
    value = facts.example_value(node)
    out, anchor = [], node
    for i, element in enumerate(value):
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (node, i))
        item.meta["example_value"] = element
        out.append(item)
        anchor = item
    return out


def keep_containers_in_their_piece(graph: torch.fx.Graph, kinds: dict, part: dict, reasons: dict) -> None:
    """Give every reader of a container-valued node the container's elements from its own piece
    (``kinds``, ``part`` and ``reasons`` are updated for the nodes that move or are made)."""
    for node in list(graph.nodes):
        if node not in part or not _is_container(node):
            continue
        for user in list(node.users):
            if user.op == "output":
                continue  # Dynamo's outputs are flat: a container never reaches them
            if not _selects_from(user, node):
                elements = _elements(graph, node)
                packed = list(elements) if isinstance(facts.example_value(node), list) else tuple(elements)
                user.args, user.kwargs = torch.fx.node.map_aggregate(
                    (user.args, user.kwargs), lambda a: packed if a is node else a
                )
                moved = elements
            else:
                moved = [user]
            for item in moved:
                part[item], kinds[item] = part[node], kinds[node]
                reasons.pop(item, None)
