"""Each piece's inputs and output, described as text from the fake values at compile time.

Kept as text so that no fake tensor outlives the compile; the inspection report shows them
(``bf16[s72, 1, 1024]``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from .._torch_internals import sym_expr

_DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "b8",
    torch.float64: "f64",
}


def describe(value: Any) -> str:
    """``bf16[s72, 1, 1024]`` for a tensor (symbols kept), ``s27`` for a SymInt."""
    if isinstance(value, torch.Tensor):
        return f"{_DTYPES.get(value.dtype, str(value.dtype).replace('torch.', ''))}[{', '.join(map(str, value.shape))}]"
    if isinstance(value, (list, tuple)):
        return ", ".join(describe(v) for v in value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(sym_expr(value))
    return repr(value)


def piece_signatures(split_gm: torch.fx.GraphModule, node_values: dict) -> dict[str, tuple[tuple[str, ...], str]]:
    """For each piece (submodule name): its described inputs and its described output."""
    out = {}
    for node in split_gm.graph.nodes:
        if node.op == "call_module":
            inputs = tuple(describe(node_values[a]) if isinstance(a, torch.fx.Node) else repr(a) for a in node.args)
            out[str(node.target)] = (inputs, describe(node_values.get(node)))
    return out
