"""The ``piecewise`` torch.compile backend: split, compile, wrap, stitch.

``torch.compile(model, backend="piecewise", options={...})`` calls :func:`piecewise` once per graph
Dynamo captures. It returns a :class:`CompiledGraph`: the split graph (torch's ``split_module``
output) whose compute submodules are replaced by :class:`~piecewise_backend.cudagraphs.PieceRunner`
objects, and whose split/eager submodules run as they are, between the replays.
"""

from __future__ import annotations

import logging
import operator
import warnings
import weakref
from typing import Any, Mapping

import torch
import torch.fx

from . import _torch_internals
from . import graph_facts as facts
from .compiling import CompiledPiece, PieceCompiler, compile_pieces
from .config import PiecewiseConfig
from .cudagraphs import PieceRunner, StepState
from .splitting import COMPUTE, SplitGraph, split_graph
from .stats import GraphStats, PieceStats, register

log = logging.getLogger("piecewise_backend")

_COMPILED: "weakref.WeakSet[CompiledGraph]" = weakref.WeakSet()


def compiled_graphs() -> list["CompiledGraph"]:
    """Every live graph this backend compiled in this process, oldest first."""
    return sorted(_COMPILED, key=lambda g: g.serial)


class CompiledGraph:
    """The callable Dynamo installs for one captured graph."""

    _serial = 0

    def __init__(self, split: SplitGraph, compiled: dict[str, CompiledPiece], runners: dict[str, PieceRunner],
                 step: StepState, stats: GraphStats, config: PiecewiseConfig, key_sources: list,
                 graphs_disabled_reason: str | None, any_requires_grad: bool):
        CompiledGraph._serial += 1
        self.serial = CompiledGraph._serial
        self.split = split
        self.compiled = compiled
        self.runners = runners
        self.step = step
        self.stats = stats
        self.config = config
        self.key_sources = key_sources
        self.graphs_disabled_reason = graphs_disabled_reason
        self.any_requires_grad = any_requires_grad
        self._forward = split.graph_module.forward
        self._warned_grad = False

    @property
    def pieces(self):
        return self.split.pieces

    def shape_key(self, args) -> tuple:
        """The values of the batch symbols for this call (never the per-step scalars)."""
        return tuple(args[i] if dim is None else args[i].shape[dim] for i, dim in self.key_sources)

    def __call__(self, *args):
        step = self.step
        self.stats.calls += 1
        step.graphing = self.graphs_disabled_reason is None and self._grad_allows_graphs()
        if step.graphing:
            step.key = self.shape_key(args)
            step.pool_ptrs.clear()
        return self._forward(*args)

    def _grad_allows_graphs(self) -> bool:
        if not (self.any_requires_grad and torch.is_grad_enabled()):
            return True
        if not self._warned_grad:
            self._warned_grad = True
            warnings.warn("piecewise: inputs require grad and grad mode is on; CUDA graphs are for "
                          "inference, so this graph runs un-graphed. Call it under torch.no_grad() or "
                          "torch.inference_mode() to get graphs.", stacklevel=3)
        return False


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


def _static_args(split_gm: torch.fx.GraphModule, static_placeholders: set[str]) -> dict[str, frozenset]:
    """For each submodule, the positions of its args that are parameters/buffers of the model."""
    out = {}
    for node in split_gm.graph.nodes:
        if node.op == "call_module":
            out[str(node.target)] = frozenset(
                i for i, a in enumerate(node.args)
                if isinstance(a, torch.fx.Node) and a.op == "placeholder" and a.name in static_placeholders)
    return out


def _key_sources(fake_inputs: list, needed: set) -> tuple[list, set]:
    """Where to read each needed symbol at call time: (arg index, dim) or (arg index, None)."""
    sources, found = [], set()
    for i, value in enumerate(fake_inputs):
        candidates = [(None, value)] if isinstance(value, torch.SymInt) else (
            list(enumerate(value.shape)) if isinstance(value, torch.Tensor) else [])
        for dim, size in candidates:
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                sym = size.node.expr
                if sym in needed and sym not in found:
                    found.add(sym)
                    sources.append((i, dim))
    return sources, needed - found


def _graphs_disabled_reason(config: PiecewiseConfig, fake_inputs: list, missing: set) -> str | None:
    if not config.cudagraphs:
        return "cudagraphs=False in options"
    devices = {v.device.type for v in fake_inputs if isinstance(v, torch.Tensor)}
    if devices != {"cuda"}:
        return f"graphs need CUDA tensors; inputs are on {', '.join(sorted(devices)) or 'no device'}"
    if missing:
        return f"compute pieces depend on symbols not read from any input ({', '.join(map(str, missing))})"
    return None


def build(gm: torch.fx.GraphModule, example_inputs: list, config: PiecewiseConfig) -> CompiledGraph:
    fake_mode = _torch_internals.detect_fake_mode(example_inputs)
    phs = facts.placeholders(gm.graph)
    if fake_mode is None or any(facts.example_value(n) is None for n in phs):
        raise RuntimeError("piecewise backend: the graph has no fake example values; it must come from "
                           "torch.compile (Dynamo), not be called directly on an FX graph.")
    static_placeholders = {n.name for n in phs if _torch_internals.is_static_input(n)}
    fake_inputs = _torch_internals.fakify_inputs(example_inputs, fake_mode)
    any_requires_grad = any(isinstance(v, torch.Tensor) and v.requires_grad for v in fake_inputs)

    split = split_graph(gm, config.all_splitting_ops)
    split_gm = split.graph_module
    log.debug("%s", torch._dynamo.utils.lazy_format_graph_code("piecewise split graph", split_gm))
    compute_names = {p.name for p in split.pieces if p.kind == COMPUTE}
    compiler = PieceCompiler(fake_mode, split.step_symbols)
    compiled = compile_pieces(split_gm, compute_names, fake_inputs, compiler)

    needed = set()
    for piece in compiled.values():
        needed |= facts.value_symbols(piece.fake_args, with_offset=False)
    sources, missing = _key_sources(fake_inputs, needed - split.step_symbols)
    reason = _graphs_disabled_reason(config, fake_inputs, missing)

    stats = register(GraphStats(
        num_pieces=len(split.pieces), num_compute_pieces=len(compute_names),
        num_split_pieces=len(split.pieces) - len(compute_names),
        inductor_compiles=compiler.inductor_compiles, inductor_seconds=compiler.inductor_seconds,
        graphs_disabled_reason=reason))
    step = StepState()
    escaping = _escaping_outputs(split_gm)
    static_args = _static_args(split_gm, static_placeholders)
    runners = {}
    for spec in split.pieces:
        submod = getattr(split_gm, spec.name)
        if spec.kind == COMPUTE:
            stats.pieces[spec.name] = PieceStats(spec.name)
            runners[spec.name] = PieceRunner(
                spec.name, compiled[spec.name].fn, static_args[spec.name],
                frozenset(escaping.get(spec.name, ())), step, stats.pieces[spec.name],
                config.warmup_runs, config.clone_outputs)
            # An instance attribute shadows the registered submodule (kept for inspection).
            split_gm.__dict__[spec.name] = runners[spec.name]
        else:
            split_gm.__dict__[spec.name] = submod.forward  # skip nn.Module.__call__ overhead
    graph = CompiledGraph(split, compiled, runners, step, stats, config, sources, reason, any_requires_grad)
    _COMPILED.add(graph)
    log.info("piecewise: compiled graph %d: %d pieces (%d compute), %d Inductor compiles; graphs: %s",
             graph.serial, stats.num_pieces, stats.num_compute_pieces, stats.inductor_compiles,
             reason or "lazy, per shape key")
    return graph


def piecewise(gm: torch.fx.GraphModule, example_inputs: list, options: Mapping[str, Any] | None = None,
              **kwargs) -> CompiledGraph:
    """The backend Dynamo calls: ``torch.compile(model, backend="piecewise", options={...})``."""
    if kwargs:
        raise TypeError(f"piecewise backend: unexpected arguments {sorted(kwargs)}; pass settings as "
                        f"torch.compile(..., options={{...}}).")
    return build(gm, example_inputs, PiecewiseConfig.from_options(options))
