"""The ``piecewise`` torch.compile backend: one pipeline from Dynamo's graph to a compiled graph.

``torch.compile(model, backend="piecewise", options={...})`` calls :func:`piecewise` once per graph
Dynamo captures. :func:`build` runs five stages, each in a folder of its own (each folder's
``__init__`` says what it takes and gives):

1. **rewrite** (``rewrite/``): per-step ints read from a device tensor, so decode steps can be graphed;
2. **split** (``split/``): the graph cut at attention into compute and eager pieces;
3. **compile** (``compiling/``): each distinct compute piece compiled once with Inductor (a piece
   holding many layers, layer by layer);
4. **plan** (``plan/``): shape keys, padding, staging and capture decisions, frozen in a
   :class:`~piecewise_backend.plan.types.GraphPlan`;
5. **wrap** (``runtime/``): a :class:`~piecewise_backend.runtime.compiled_graph.CompiledGraph` that
   runs the plan per call, capturing one CUDA graph per shape key lazily.

Compile time ends at the plan: the run time imports nothing else of it (``tests/test_package_structure.py``).
``fx/`` holds the graph facts the compile stages share, ``ops/`` the graph-safe attention op that
rewritten graphs call, ``observe/`` what people read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx

from . import _torch_internals
from .compiling.piece_compiler import PieceCompiler, compile_pieces
from .config import PiecewiseConfig
from .fx import graph_facts as facts
from .op_names import GRAPH_ATTENTION_OP
from .persist.artifact import SaveableGraph
from .persist.compile_behind import CompileBehind, job_of
from .plan.inputs import GraphInputs
from .plan.making import graphs_disabled_reason, make_plan
from .plan.types import GraphPlan, TensorSpec
from .registry import register
from .rewrite import kv_written_inputs, rewrite_decode
from .rewrite.graph_attention import mark_attention_paths
from .runtime.compiled_graph import CompiledGraph
from .split.in_place_writes import written_in_place
from .split.splitting import SplitGraph, split_graph

log = logging.getLogger(__name__)  # under the "piecewise_backend" logger


_TORCH_COMPILE_MODES = (None, "default", "reduce-overhead")  # torch.compile(mode=...) this backend does anyway


def piecewise(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
    **kwargs,
) -> CompiledGraph:
    """The backend Dynamo calls: ``torch.compile(model, backend="piecewise", options={...})``.

    ``mode``: torch.compile hands a custom backend its ``mode`` when it is not "default".
    "reduce-overhead" (transformers' ``CompileConfig`` default) is what this backend does anyway;
    Inductor's other modes are refused by name rather than ignored.
    """
    if kwargs:
        raise TypeError(
            f"piecewise: unexpected arguments {sorted(kwargs)}; pass settings as torch.compile(..., options={{...}})."
        )
    if mode not in _TORCH_COMPILE_MODES:
        raise ValueError(
            f"piecewise: mode={mode!r} is not supported: this backend always captures CUDA "
            f"graphs per shape (what 'reduce-overhead' asks for) and compiles its pieces with "
            f"Inductor's defaults. Leave mode out, or pass 'default' or 'reduce-overhead'."
        )
    return build(gm, example_inputs, PiecewiseConfig.from_options(options))


def build(gm: torch.fx.GraphModule, example_inputs: list, config: PiecewiseConfig) -> CompiledGraph:
    started = time.perf_counter()
    serve_first = config.compiler == "eager_then_inductor"
    device = next((str(v.device) for v in example_inputs if isinstance(v, torch.Tensor)), None)
    if serve_first and device is not None and device.startswith("cuda"):
        CompileBehind.shared(device)  # started now, to import and warm while this build runs: see its docstring
    with _torch_internals.lazy_graph_modules():  # code only for the graph modules that run
        inputs = _rewrite(gm, example_inputs, config)
        split = _split(inputs, config)
        compiler = PieceCompiler(
            inputs.fake_mode, split.step_symbols, _attention_ops(config), inductor=config.compiler == "inductor"
        )
        run = compile_pieces(split.graph_module, split.compute_names, inputs.fake_inputs, compiler)
        plan = make_plan(config, inputs, split, run.pieces, run.fake_outputs, run.node_values, compiler)
        compiled = {name: piece.fn if compiler.inductor else None for name, piece in run.pieces.items()}
        del run  # fake values of every intermediate: the plan keeps none
    graph = register(SaveableGraph(plan, compiled))
    if serve_first and plan.pieces and plan.graphs_disabled_reason is None:  # else: nothing to switch to
        CompileBehind.shared(device).submit(
            job_of(plan, _torch_internals.symbol_hints(inputs.fake_mode)),
            _attention_ops(config),
            graph.code_switch.post,
            plan,
            str(graph.serial),
        )
    graph.stats.build_seconds = time.perf_counter() - started
    _log_built(graph, plan, config)
    return graph


def _attention_ops(config: PiecewiseConfig) -> frozenset[str]:
    """Where a compute piece that holds many layers is cut to compile each distinct layer once
    (``layer_chain.py``): every attention op, split at or not (full mode splits at none)."""
    return frozenset(config.splitting_ops) | frozenset(config.extra_splitting_ops) | {GRAPH_ATTENTION_OP}


def _rewrite(gm: torch.fx.GraphModule, example_inputs: list, config: PiecewiseConfig) -> GraphInputs:
    """Stage 1: Dynamo's graph and inputs, with the decode rewrite applied where it finds sites."""
    fake_mode = _torch_internals.detect_fake_mode(example_inputs)
    placeholders = facts.placeholders(gm.graph)
    if fake_mode is None or any(facts.example_value(n) is None for n in placeholders):
        raise RuntimeError(
            "piecewise: the graph has no fake example values; it must come from "
            "torch.compile (Dynamo), not be called directly on an FX graph."
        )
    if config.compiler == "inductor" and any(isinstance(v, torch.Tensor) and v.is_cuda for v in example_inputs):
        _torch_internals.warm_compile_workers()  # ready by the time the first piece reaches Triton
    static_names = {n.name for n in placeholders if _torch_internals.is_static_input(n)}
    if config.capture_kv_writes:  # inputs the graph may write itself are used in place (in_place_writes.py,
        steps = facts.step_symbols(gm.graph)  # and caches written like buffers: rewrite/kv_writes.py)
        static_names |= written_in_place(gm.graph, steps) | kv_written_inputs(gm.graph, steps)
    _log_graph("piecewise input graph", gm)
    fake_inputs = _torch_internals.fakify_inputs(example_inputs, fake_mode)
    off = graphs_disabled_reason(
        config, example_inputs, [n.name for n in placeholders], facts.python_scalar_inputs(gm.graph)
    )
    mark_attention_paths(
        gm.graph,
        static_names,
        facts.step_symbols(gm.graph),
        off or (None if config.graph_attention else "graph_attention=False in options"),
    )
    found = None
    if (config.capture_kv_writes or config.graph_attention) and off is None:
        found = rewrite_decode(gm, static_names, config.capture_kv_writes, config.graph_attention)
    if found is None:
        return GraphInputs(gm, fake_mode, tuple(fake_inputs), frozenset(static_names), None, off)
    _log_graph("piecewise graph with the KV writes moved into compute", found.graph_module)
    return GraphInputs.with_rewrite(found, fake_mode, fake_inputs, static_names, off)


def _split(inputs: GraphInputs, config: PiecewiseConfig) -> SplitGraph:
    """Stage 2: compute pieces (graphed) between the eager ones. Full mode lets compute pieces write
    the graph's parameters/buffers; the decode rewrite's masked writes may be captured in any mode,
    and so may index writes and fixed-size updates of inputs used in place (``in_place_writes.py``)."""
    writable = (inputs.static_names if config.mode == "full" else frozenset()) | inputs.masked_buffers
    result = split_graph(
        inputs.graph_module,
        config.all_splitting_ops,
        writable,
        fixed_attention=config.graph_attention,
        in_place=inputs.static_names if config.capture_kv_writes else frozenset(),
    )
    _log_graph("piecewise split graph", result.graph_module)
    for spec in result.pieces:
        _log_graph(f"piecewise {spec.name} {spec.kind}", getattr(result.graph_module, spec.name))
    return result


def _log_graph(title: str, gm: torch.fx.GraphModule) -> None:
    """Log a graph at DEBUG through Dynamo's formatter (under ``depyf.prepare_debug`` this call is
    what writes the graph into the dump folder, whatever the log level)."""
    log.debug("%s", _torch_internals.format_graph_code(title, gm))


def _log_built(graph: CompiledGraph, plan: GraphPlan, config: PiecewiseConfig) -> None:
    stats, pieces = graph.stats, plan.piece_specs
    devices = {
        v.device.type
        for i, v in enumerate(plan.inputs.specs)
        if isinstance(v, TensorSpec) and i not in plan.inputs.python_scalars
    }
    if plan.graphs_disabled_reason is not None and "cuda" in devices and len(devices) > 1:
        # a CUDA model with a stray input elsewhere (a CPU counter in a cache object): the user did not
        # ask for eager, so say it loudly (a CPU-only model is un-graphed by nature: no warning)
        log.warning("piecewise: graph %d runs un-graphed: %s", graph.serial, plan.graphs_disabled_reason)
    if config.mode == "full" and len(pieces) > 1:
        log.warning(
            "piecewise: graph %d: full mode, but %d nodes must run eagerly, so it is captured in %d pieces: %s",
            graph.serial,
            sum(len(p.eager_reasons) for p in pieces),
            len(plan.pieces),
            "; ".join(r for p in pieces for r in p.eager_reasons[:1]),
        )
    log.info(
        "piecewise: compiled graph %d: %d pieces (%d compute), %d Inductor compiles; graphs: %s; padding: %s",
        graph.serial,
        stats.num_pieces,
        stats.num_compute_pieces,
        stats.inductor_compiles,
        plan.graphs_disabled_reason or "per shape key",
        plan.padding.note,
    )
