"""Inputs several compute pieces read: copy them into a captured buffer once per step, not per piece.

A RoPE row ``cos[pos:pos+S]`` is made by the eager prologue at a new address every step and read by
every layer's compute piece; copied into each piece's own buffer that is 2 copies per layer per
step (32 of the 49 copies of a 16-layer decode step). Captured to read *one* buffer, it needs one
copy per step: the first piece to replay copies it, the others see the same source address in the
same step and skip.

Skipping is only right if nothing writes the source between those pieces. So a value is staged only
if it is a graph input, or a view of one, that no node of the graph writes in place (checked on the
fake values: same storage); a value an eager piece computes, or a view of the KV cache, is not.
"""

from __future__ import annotations

import collections

import torch
import torch.fx

from .._torch_internals import storage_ref


def _storage(value):
    return storage_ref(value) if isinstance(value, torch.Tensor) else None


def stage_keys(
    split_gm: torch.fx.GraphModule,
    node_values: dict,
    compute_names: set[str],
    written_inputs: frozenset,
    static_inputs: set[str],
) -> dict[str, dict[int, str]]:
    """For each compute piece: arg index -> stage key (the split-graph node it reads), for the args
    that are staged (read by two or more compute pieces, unwritten graph inputs or views of them)."""
    unwritten = {
        _storage(node_values[n]) for n in split_gm.graph.nodes if n.op == "placeholder" and n.name not in written_inputs
    }
    unwritten.discard(None)
    static = {n.name for n in split_gm.graph.nodes if n.op == "placeholder" and n.name in static_inputs}
    calls = [n for n in split_gm.graph.nodes if n.op == "call_module" and str(n.target) in compute_names]
    readers = collections.Counter(a for call in calls for a in dict.fromkeys(call.all_input_nodes))
    out: dict[str, dict[int, str]] = {}
    for call in calls:
        keys = {}
        for i, arg in enumerate(call.args):
            if (
                isinstance(arg, torch.fx.Node)
                and readers[arg] > 1
                and arg.name not in static
                and _storage(node_values.get(arg)) in unwritten
            ):
                keys[i] = arg.name
        out[str(call.target)] = keys
    return out
