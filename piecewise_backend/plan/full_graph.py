"""Full graphs: whether a call may be captured whole (``cudagraph_mode("full")``), and how it pads.

A full graph runs the split graph as it is, splitting ops included, inside one CUDA graph. The
caller vouches, per call, that those ops are graph-safe then (a serving engine's decode step reads
its metadata from buffers at fixed addresses). What compile time decides for it:

* **whether at all**: never for a graph with an op tagged ``torch.Tag.cudagraph_unsafe`` (its author
  says it must not be captured, in any call);
* **which inputs are used in place**: parameters and buffers, Python scalars, and every input some
  node writes (a write must reach the caller's tensor, not a copy). Other inputs are copied into
  buffers the full graph owns, as compute pieces do;
* **padding**: a batch pads up to a capture size only when the row-independence proof holds over the
  *whole* graph, eager nodes and splitting ops included (``rows/``): splitting ops now run at the
  padded size. A custom op the proof cannot see into refuses it, named, unless the user declares it
  row-wise (``row_independent_ops``). Refused, each size is captured exactly.
"""

from __future__ import annotations

import torch

from ..config import PiecewiseConfig
from ..fx import graph_facts as facts
from ..op_names import is_random_op
from ..split.splitting import SplitGraph
from .inputs import GraphInputs
from .padding import piece_padding
from .rows.row_independence import analyse
from .types import FullGraphPlan, ShapeKey

_WHOLE = "the whole graph"


def full_graph_plan(
    config: PiecewiseConfig, inputs: GraphInputs, split: SplitGraph, key: ShapeKey, compute_draws_random: bool
) -> FullGraphPlan:
    names = inputs.names
    written = frozenset(i for i, name in enumerate(names) if name in split.written_inputs)
    in_place = inputs.static_inputs | inputs.python_scalars | written
    nodes = [n for n in inputs.graph_module.graph.nodes if n.op in ("call_function", "call_method")]
    draws_random = compute_draws_random or any(n.op == "call_function" and is_random_op(n.target) for n in nodes)
    refusal, returns_inputs = _returned_inputs(inputs, in_place)
    if split.unsafe_ops:
        refusal = (
            f"it holds {', '.join(split.unsafe_ops)}, tagged torch.Tag.cudagraph_unsafe: its author says it "
            f"must never be captured, so calls under cudagraph_mode('full') run piecewise"
        )
    padding, note, capacities = _full_padding(config, inputs, split, key, nodes, in_place)
    return FullGraphPlan(refusal, padding, note, capacities, in_place, draws_random, returns_inputs)


def _returned_inputs(inputs: GraphInputs, in_place: frozenset) -> tuple[str | None, frozenset]:
    """(why no full graph: the graph returns a view of an input it would copy, or None; the output
    positions that are views of inputs used in place, handed back as they are, never cloned)."""
    graph = inputs.graph_module.graph
    roots = facts.alias_roots(graph)
    index = {name: i for i, name in enumerate(inputs.names)}
    kept = set()
    for j, value in enumerate(_output_nodes(graph)):
        root = roots.get(value) if isinstance(value, torch.fx.Node) else None
        if root is None or root.op != "placeholder":
            continue
        if index[root.name] not in in_place:
            return (
                f"it returns a view of its input {root.name}, which a full graph would copy: it would hand "
                f"back a view of its copy"
            ), frozenset()
        kept.add(j)
    return None, frozenset(kept)


def _full_padding(
    config: PiecewiseConfig, inputs: GraphInputs, split: SplitGraph, key: ShapeKey, nodes: list, in_place: frozenset
) -> tuple:
    """(padding or None, note for people, row capacities) of the whole graph."""
    if key.pad_position is None:
        return None, "no dynamic batch size: one shape, captured as is", ()
    sym = key.symbols[key.pad_position]
    if not config.padding:
        return None, "off (padding=False): only exact capture sizes get full graphs", ()
    refusal = _writes_batch_rows(inputs, split, sym) or _in_place_with_batch_rows(inputs, in_place, sym)
    if refusal is None:
        rows = analyse(
            nodes,
            sym,
            inputs.rewrite.row_access if inputs.rewrite is not None else {},
            frozenset(config.row_independent_ops),
        )
        refusal = rows.refusal
    padding = None
    if refusal is None:
        padding = piece_padding(_WHOLE, inputs.fake_inputs, _graph_outputs(inputs.graph_module.graph), sym)
        refusal, padding = (padding, None) if isinstance(padding, str) else (None, padding)
    if refusal is not None:
        return None, f"off for {sym}: {refusal}; each size is captured as it is", ()
    return padding, f"{sym} padded up to the next capture size", rows.capacities


def _output_nodes(graph: torch.fx.Graph) -> tuple:
    output = next(n for n in graph.nodes if n.op == "output")
    return tuple(output.args[0]) if isinstance(output.args[0], (tuple, list)) else (output.args[0],)


def _graph_outputs(graph: torch.fx.Graph) -> tuple:
    return tuple(facts.example_value(v) if isinstance(v, torch.fx.Node) else v for v in _output_nodes(graph))


def _writes_batch_rows(inputs: GraphInputs, split: SplitGraph, sym) -> str | None:
    """Why padding is refused when a node writes a caller's tensor at the caller's rows (the decode
    rewrite's masked writes excepted, and whole writes of a tensor without batch rows)."""
    fakes = dict(zip(inputs.names, inputs.fake_inputs))
    for name in sorted(split.written_inputs - inputs.masked_buffers):
        if name in split.whole_writes and sym not in facts.value_symbols(fakes[name], with_offset=False):
            continue
        return f"the graph writes input {name}: padded rows would write rows the caller did not pass"
    return None


def _in_place_with_batch_rows(inputs: GraphInputs, in_place: frozenset, sym) -> str | None:
    for i in sorted(in_place):
        value = inputs.fake_inputs[i]
        if isinstance(value, torch.Tensor) and sym in facts.value_symbols(value, with_offset=False):
            return (
                f"{inputs.names[i]} {tuple(value.shape)} is used in place and has the batch size {sym} in its "
                f"shape: a padded batch would have rows it does not"
            )
    return None
