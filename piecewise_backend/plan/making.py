"""Deciding the plan: from what the compile stages found, everything a compiled graph does per call.

The plan's types are in ``types.py``; this is the stage that fills them (``backend.build`` calls
:func:`make_plan` after the compile stage), once per compiled graph.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping

import torch
import torch.fx

from .._torch_internals import sym_expr
from ..config import PiecewiseConfig
from ..fx import graph_facts as facts
from ..kinds import PieceKind
from ..op_names import SDPA, canonical_op_name
from ..ops.prefix_attention import PREFIX_ATTENTION
from ..rewrite.graph_attention import PATH as ATTENTION_PATH
from ..split.splitting import SplitGraph
from .collectives import collective_groups
from .emulation import emulating
from .full_graph import full_graph_plan
from .inputs import GraphInputs
from .padding import plan_padding
from .sdpa_choice import choose as choose_sdpa
from .signatures import piece_signatures
from .staging import stage_keys
from .types import (
    FxProgram,
    GraphPlan,
    PaddingPlan,
    PiecePlan,
    PlanReport,
    RuntimeSettings,
    ShapeKey,
    describe,
    graph_device,
)


def graphs_disabled_reason(
    config: PiecewiseConfig, fake_inputs, names: list | None = None, python_scalars: frozenset = frozenset()
) -> str | None:
    """Why this graph never captures, by its options and inputs (None: it may). Asked once, by stage
    1 (``backend._rewrite``), which hands the answer on in ``GraphInputs.graphs_off``. ``names``: the
    inputs' names, to say which tensors keep a CUDA graph's inputs off the GPU (e.g. a 0-dim CPU
    counter a cache object holds). ``python_scalars``: indices of Python floats passed as CPU
    scalars (host values, keyed by value)."""
    if not config.cudagraphs:
        return "cudagraphs=False in options"
    fake_inputs = [v for i, v in enumerate(fake_inputs) if i not in python_scalars]
    devices = {v.device.type for v in fake_inputs if isinstance(v, torch.Tensor)}
    if devices == {"cpu"} and emulating():
        return None
    if devices != {"cuda"}:
        reason = f"graphs need CUDA tensors; inputs are on {', '.join(sorted(devices)) or 'no device'}"
        if "cuda" in devices and names is not None:
            names = [n for i, n in enumerate(names) if i not in python_scalars]
            off = [
                f"{name} {tuple(v.shape)} on {v.device.type}"
                for name, v in zip(names, fake_inputs)
                if isinstance(v, torch.Tensor) and v.device.type != "cuda"
            ]
            reason += (
                f" ({', '.join(off[:3])}{f' and {len(off) - 3} more' if len(off) > 3 else ''}): a "
                f"graph would keep their values of the capture; keep them on the GPU, or pass Python ints"
            )
        return reason
    return None


def _missing_symbols_reason(missing: set) -> str | None:
    if missing:
        return f"compute pieces depend on symbols not read from any input ({', '.join(map(str, missing))})"
    return None


def _shape_key(fake_inputs: tuple, needed: set) -> tuple[ShapeKey, set]:
    """Where to read each needed symbol at call time, and the needed symbols no input provides.

    The batch is the first input tensor's dynamic leading dim: Dynamo passes symbols as SymInt inputs
    too (often before the tensors), so the key's own order does not say which symbol is the batch.
    A dynamic dim further in (a cache's or a mask's KV length) is not rows: taken for the batch, a
    window cache's fixed length (5) was refused padding and, not being a capture size, ran un-graphed
    at every step. Without a dynamic leading dim every shape is captured as it comes.
    """
    sources, symbols = [], []
    for i, value in enumerate(fake_inputs):
        candidates = (
            [(None, value)]
            if isinstance(value, torch.SymInt)
            else (list(enumerate(value.shape)) if isinstance(value, torch.Tensor) else [])
        )
        for dim, size in candidates:
            sym = sym_expr(size)
            if isinstance(size, torch.SymInt) and sym.is_Symbol and sym in needed and sym not in symbols:
                symbols.append(sym)
                sources.append((i, dim))
    leading = (value.shape[0] for value in fake_inputs if isinstance(value, torch.Tensor) and value.dim() > 0)
    pad_position = next(
        (
            symbols.index(sym_expr(size))
            for size in leading
            if isinstance(size, torch.SymInt) and sym_expr(size) in symbols
        ),
        None,
    )
    return ShapeKey(tuple(sources), tuple(symbols), pad_position), needed - set(symbols)


def _padding(
    config: PiecewiseConfig,
    split: SplitGraph,
    compiled: Mapping,
    fake_outputs: Mapping,
    key: ShapeKey,
    unmasked: Mapping,
    inputs: GraphInputs,
) -> PaddingPlan:
    """The KV writes moved into compute pieces are masked to the caller's rows, so they neither
    forbid padding nor count as mixing rows (the rewrite's ``row_access`` names them): only each
    piece's ``unmasked`` writes do. They do read and write their caches by batch row, so a padded
    batch may not exceed those caches' rows: the capacities."""
    if key.pad_position is None:
        return PaddingPlan({}, None, (), "no dynamic batch size: one shape, captured as is")
    row_access = inputs.rewrite.row_access if inputs.rewrite is not None else {}
    batch_sized = {
        name: facts.value_symbols(v, with_offset=False)  # only whole writes need them
        for name, v in zip(inputs.names, inputs.fake_inputs)
        if name in split.whole_writes
    }
    sym = key.symbols[key.pad_position]
    in_place_rows = _in_place_batch_rows(split, inputs, sym)
    # a whole-tensor write of a tensor without batch rows (a step counter) leaves padded rows nothing to write
    unmasked = {
        piece: tuple(w for w in written if w not in split.whole_writes or sym in batch_sized[w])
        for piece, written in unmasked.items()
    }
    pieces = {name: (c.fake_args, fake_outputs[name]) for name, c in compiled.items()}
    per_piece, refusal, capacities = plan_padding(
        sym, split.compute_nodes, pieces, unmasked, row_access, frozenset(config.row_independent_ops)
    )
    refusal = refusal or in_place_rows
    if not config.padding:
        return PaddingPlan({}, refusal, capacities, "off (padding=False): only exact capture sizes get graphs")
    if refusal:
        return PaddingPlan({}, refusal, (), f"off for {sym}: {refusal}; each size is captured as it is")
    note = f"{sym} padded up to the next capture size"
    if capacities:
        rows = sorted({str(c.rows) for c in capacities})
        tensors = {c.tensor for c in capacities}
        note += (
            f" while the padded batch fits in {' / '.join(rows)} rows, the batch dim of the "
            f"{len(tensors)} tensor(s) it reads or writes by batch row (e.g. {capacities[0].tensor}, "
            f"{capacities[0].where}); past that, exact sizes"
        )
    return PaddingPlan(per_piece, None, capacities, note)


def _escaping_outputs(split_gm: torch.fx.GraphModule) -> dict[str, set]:
    """For each submodule, the indices of its outputs that the graph returns to the user."""
    out: dict[str, set] = {}
    output_node = next(n for n in split_gm.graph.nodes if n.op == "output")
    for arg in output_node.all_input_nodes:
        if arg.op == "call_module":
            out.setdefault(str(arg.target), set()).add(0)
        elif arg.op == "call_function" and arg.target is operator.getitem and arg.args[0].op == "call_module":
            out.setdefault(str(arg.args[0].target), set()).add(arg.args[1])
    return out


def _piece_plans(
    split: SplitGraph, compiled: Mapping, padding: PaddingPlan, staging: Mapping, static_names, unmasked: Mapping
) -> dict[str, PiecePlan]:
    split_gm = split.graph_module
    escaping = _escaping_outputs(split_gm)
    calls = {str(n.target): n for n in split_gm.graph.nodes if n.op == "call_module"}
    plans = {}
    for spec in split.pieces:
        if spec.kind != PieceKind.COMPUTE:
            continue
        inputs = {
            i: a.name
            for i, a in enumerate(calls[spec.name].args)
            if isinstance(a, torch.fx.Node) and a.op == "placeholder"
        }
        piece = compiled[spec.name]
        plans[spec.name] = PiecePlan(
            spec.name,
            describe(tuple(piece.fake_args)),
            static_args=frozenset(i for i, name in inputs.items() if name in static_names),
            escaping_outputs=frozenset(escaping.get(spec.name, ())),
            padding=padding.per_piece.get(spec.name),
            stage_keys=staging[spec.name],
            restore_after_warmup=frozenset(i for i, name in inputs.items() if name in unmasked[spec.name]),
            draws_random=piece.draws_random,
        )
    return plans


def _attention_calls(split: SplitGraph) -> list[tuple]:
    """(piece, node) of every attention call in the split graph, in order: SDPA, and the graph-safe
    decode kernel the rewrite put in its place. One walk serves the report and the SDPA kernel choice."""
    return [
        (spec, node)
        for spec in split.pieces
        for node in getattr(split.graph_module, spec.name).graph.nodes
        if node.op == "call_function" and (node.target is PREFIX_ATTENTION or canonical_op_name(node.target) == SDPA)
    ]


def _attention(calls: list[tuple]) -> tuple:
    """How each attention call runs, read from where the split put it: ``graph`` (the graph-safe decode
    kernel, or compiled into a compute piece, full mode) or ``eager: <why>`` (why the decode rewrite did
    not take it, or that it is a splitting op)."""
    return tuple((node.name, _how_attention_runs(spec, node)) for spec, node in calls)


def _how_attention_runs(spec, node: torch.fx.Node) -> str:
    if node.target is PREFIX_ATTENTION:
        return "graph: the graph-safe decode kernel"
    if spec.kind == PieceKind.COMPUTE:
        return "graph: compiled with its piece"
    return node.meta.get(ATTENTION_PATH, "eager: a splitting op")


def _scalars_read_by_compute(split: SplitGraph, inputs: GraphInputs) -> dict[int, str]:
    """Input index -> name of each Python float (``python_scalars``) that a compute piece reads.

    A captured graph keeps such a value as it was at capture, so these values end the shape key;
    like parameters they are passed in place, never copied. Floats only eager pieces read (attention's
    ``scaling``) stay out of the key: eager code reads them afresh each call.
    """
    names = {name: i for i, name in enumerate(inputs.names) if i in inputs.python_scalars}
    return {names[name]: name for name in _read_by_compute(split) if name in names}


def _read_by_compute(split: SplitGraph) -> set[str]:
    """Names of the graph inputs that compute pieces take as arguments."""
    compute = split.compute_names
    return {
        a.name
        for n in split.graph_module.graph.nodes
        if n.op == "call_module" and str(n.target) in compute
        for a in n.args
        if isinstance(a, torch.fx.Node) and a.op == "placeholder"
    }


def _in_place_batch_rows(split: SplitGraph, inputs: GraphInputs, sym) -> str | None:
    """Why no batch can be padded when a compute piece uses in place an input whose shape holds the
    batch size (a static cache made for each batch size, written at its own address): a padded
    batch would have rows that tensor does not. None when there is none."""
    read = _read_by_compute(split)
    for name, value in zip(inputs.names, inputs.fake_inputs):
        if (
            name in inputs.static_names
            and name in read
            and isinstance(value, torch.Tensor)
            and sym in facts.value_symbols(value, with_offset=False)
        ):
            return (
                f"{name} {tuple(value.shape)} is used in place and has the batch size {sym} in its "
                f"shape: a padded batch would have rows it does not"
            )
    return None


def _piece_code(split: SplitGraph) -> dict[str, str]:
    return {spec.name: getattr(split.graph_module, spec.name).code.strip() for spec in split.pieces}


def _program(split: SplitGraph, compiled: Mapping) -> FxProgram:
    """The split graph as code, each compute piece as Dynamo traced it (its copy from before the
    compiler's passes rewrote it in place). Made last: it drops the nodes' metadata."""
    module = torch.fx.GraphModule(split.graph_module, split.graph_module.graph)
    for name, piece in compiled.items():
        if piece.eager is not None:
            setattr(module, name, piece.eager)
    return FxProgram(module)


def _report(split: SplitGraph, compiled: Mapping, signatures, calls: list, compiler) -> PlanReport:
    return PlanReport(
        dict(signatures),
        _piece_code(split),
        _attention(calls),
        compiler.inductor_compiles,
        compiler.inductor_seconds,
        compiled_as={n: p.shared_with for n, p in compiled.items()},
        inductor_code={n: p.inductor_code for n, p in compiled.items() if p.inductor_code},
        step_symbols=tuple(sorted(map(str, split.step_symbols))),
    )


def make_plan(
    config: PiecewiseConfig,
    inputs: GraphInputs,
    split: SplitGraph,
    compiled: Mapping,
    fake_outputs: Mapping,
    node_values: Mapping,
    compiler,
) -> GraphPlan:
    """Decide, from what the compile stages found, everything the compiled graph does per call.
    ``node_values``: the fake value of every node of the split graph (read here, kept nowhere)."""
    staging = stage_keys(
        split.graph_module, node_values, split.compute_names, split.written_inputs, inputs.static_names
    )
    signatures = piece_signatures(split.graph_module, node_values)
    masked = inputs.masked_buffers
    # per compute piece, the inputs it writes at the caller's positions (not masked to its rows)
    unmasked = {
        p.name: tuple(w for w in p.writes_inputs if w not in masked)
        for p in split.pieces
        if p.kind == PieceKind.COMPUTE
    }
    needed = set()
    for piece in compiled.values():
        needed |= facts.value_symbols(piece.fake_args, with_offset=False)
    key, missing = _shape_key(inputs.fake_inputs, needed - split.step_symbols)
    scalars = _scalars_read_by_compute(split, inputs)
    key = dataclasses.replace(key, values=tuple(sorted(scalars)))
    padding = _padding(config, split, compiled, fake_outputs, key, unmasked, inputs)
    calls = _attention_calls(split)
    plan = dict(  # everything that reads the nodes' metadata first: the program drops it
        piece_specs=tuple(split.pieces),
        unsafe_ops=tuple(split.unsafe_ops),
        pieces=_piece_plans(split, compiled, padding, staging, inputs.static_names | set(scalars.values()), unmasked),
        inputs=inputs.run_time(),
        output_specs={name: describe(v) for name, v in fake_outputs.items()},
        key=key,
        padding=padding,
        graphs_disabled_reason=inputs.graphs_off or _missing_symbols_reason(missing),
        unmasked_writes=tuple(dict.fromkeys(w for writes in unmasked.values() for w in writes)),
        collective_groups=tuple(collective_groups(inputs.graph_module.graph)),
        sdpa_choice=choose_sdpa(
            config.eager_sdpa_backends,
            [node for spec, node in calls if spec.kind != PieceKind.COMPUTE and node.target is not PREFIX_ATTENTION],
            "cuda" if emulating() else graph_device(inputs.fake_inputs, inputs.python_scalars).type,
        ),
        full=full_graph_plan(config, inputs, split, key, any(p.draws_random for p in compiled.values())),
        report=_report(split, compiled, signatures, calls, compiler),
        settings=RuntimeSettings.of(config),
    )
    return GraphPlan(program=_program(split, compiled), **plan)
