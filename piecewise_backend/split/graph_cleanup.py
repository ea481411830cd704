"""What nothing needs, removed: values no node reads before the split, scalar inputs no piece reads after it.

Both keep pieces from carrying work or inputs that only cost: a dead value would be computed (or
kept eager) for nothing, an unused step scalar would make a compute piece's signature depend on the
per-step position it never reads.
"""

from __future__ import annotations

import torch
import torch.fx

from ..fx import graph_facts as facts
from ..op_names import canonical_op_name, is_random_op


def drop_unused_scalar_inputs(split_gm: torch.fx.GraphModule, names: set[str], steps: frozenset) -> None:
    """Remove per-step SymInt inputs a compute piece does not use.

    ``split_module`` hands a piece the symbols that appear in its inputs' metadata, e.g. ``pos``
    for a RoPE row whose storage offset is ``16 * pos``. An unused ``pos`` input would still make
    Inductor treat the piece as dynamic in it (and guard on it); the piece never needs it. Other
    symbols stay even when no node reads them: they are sizes of the piece's tensors, and Inductor
    may need them as inputs (a train-mode ``batch_norm`` computes its variance correction from the
    batch size: without ``s0`` among the inputs, Inductor failed with ``RuntimeError: s0``).
    """
    for call in [n for n in split_gm.graph.nodes if n.op == "call_module" and n.target in names]:
        submod = getattr(split_gm, str(call.target))
        phs = [n for n in submod.graph.nodes if n.op == "placeholder"]
        keep = []
        for ph, arg in zip(phs, call.args):
            value = facts.example_value(arg) if isinstance(arg, torch.fx.Node) else arg
            per_step = bool(facts.value_symbols(value) & steps)
            if (
                ph.users
                or not per_step
                or isinstance(value, torch.Tensor)
                or value is None
                and isinstance(arg, torch.fx.Node)
            ):
                keep.append(arg)
            else:
                submod.graph.erase_node(ph)
        if len(keep) != len(call.args):
            call.args = tuple(keep)
            submod.recompile()
    split_gm.recompile()  # no dead-code elimination: eager pieces may exist only for their writes


_RANDOM_WORDS = (
    "rand",
    "dropout",
    "bernoulli",
    "normal",
    "multinomial",
    "poisson",
    "exponential",
    "cauchy",
    "geometric",
    "uniform",
    "seed",
)  # a dead draw still moves the generator: kept


def _is_dead_and_pure(node: torch.fx.Node) -> bool:
    """Nothing reads it and dropping it changes nothing: no write, no side effect, no random draw."""
    if node.op not in ("call_function", "call_method") or node.users or node.is_impure():
        return False
    op = canonical_op_name(node.target) if node.op == "call_function" else None
    if op is not None and not op.startswith("aten::"):
        return False  # a custom op: it may act where its schema does not say (a collective, a print)
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
    return not (
        facts.mutated_inputs(node)
        or facts.is_barrier(node)
        or is_random_op(node.target)
        or any(word in name.lower() for word in _RANDOM_WORDS)
    )


def drop_dead_values(graph: torch.fx.Graph) -> None:
    """Values nothing reads: Hugging Face's ``cache.keys.numel()`` checks, or transformers 5.17's mask
    for an attention kind no layer has (Gemma 3 with sliding layers only). Each would hand its inputs,
    and their sizes, to a compute piece for nothing: a cache's length in the piece's shape key, a
    capture per decode step and no replay."""
    for node in reversed(list(graph.nodes)):
        if _is_dead_and_pure(node):
            graph.erase_node(node)
