"""The process groups a graph's collectives run on: the compile-time half of rank agreement.

Read from the graph, the ``group_name`` argument of each ``_c10d_functional`` op (what
``torch.distributed._functional_collectives`` traces to, and what Dynamo makes of
``dist.all_reduce``). The plan hands the names to run time, whose ``runtime/distributed.py`` makes
capture and weight-set decisions agreed across those groups.
"""

from __future__ import annotations

import torch.fx

from .. import _torch_internals


def collective_groups(graph: torch.fx.Graph) -> list[str]:
    """Names of the process groups the graph's functional collectives run on, in first-use order."""
    names: dict[str, None] = {}
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function":
            continue
        if _torch_internals.is_op_packet(target):  # Dynamo records the packet
            target = getattr(target, "default", None)
        if not _torch_internals.is_op_overload(target) or target.namespace != "_c10d_functional":
            continue
        for i, arg in enumerate(_torch_internals.op_schema_arguments(target)):
            if arg.name == "group_name":
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                if isinstance(value, str):
                    names[value] = None
    return list(names)
