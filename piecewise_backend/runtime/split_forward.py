"""The split graph's own forward, as cheap per call as it can be: what every call runs.

``torch.fx`` generates a forward for the split graph that names every input before the calls and
clears the names after them. For the common decode shape (one piece called on graph inputs) a
direct call does the same for less (:func:`one_piece_forward`).
"""

from __future__ import annotations

import operator

import torch


def one_piece_forward(gm: torch.fx.GraphModule):
    """For a split graph that is one piece called on graph inputs (a decode step in one graph):
    a forward that calls that piece's runner with its args picked from the call's, or None.

    Why: the generated forward names every input (~190 for a 16-layer model) before the one call
    and clears the names after it; on the H200 machine that was ~5 µs of a decode step's host time.
    """
    placeholders = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    body = [n for n in gm.graph.nodes if n.op != "placeholder"]
    if len(body) != 2 or body[0].op != "call_module" or body[0].kwargs or body[1].op != "output":
        return None
    call, result = body[0], body[1].args[0]
    if result is not call and result != (call,) or not all(a in placeholders for a in call.args):
        return None
    piece = gm.__dict__[call.target]  # the runner (or eager forward) that CompiledGraph._wrap_pieces installed
    order = [placeholders[a] for a in call.args]
    if len(order) < 2:
        return None
    pick = operator.itemgetter(*order)
    if result is call:
        return lambda *args: piece(*pick(args))
    return lambda *args: (piece(*pick(args)),)
