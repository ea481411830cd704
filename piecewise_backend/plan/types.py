"""The plan's types: what compile time hands to run time, and all that run time reads of it.

``making.py`` decides them from what the compile stages found (``backend.build``: rewrite → split →
compile → plan → wrap); ``runtime/`` imports these types and nothing else of compile time. A
:class:`GraphPlan` holds the pieces and how each is run (:class:`PiecePlan`), the shape key read
per call (:class:`ShapeKey`), whether and how batches are padded (:class:`PaddingPlan`), and why
the graph gets no CUDA graphs at all, if it does not. Frozen: nothing changes it once made (the
run time wraps its pieces in a copy of the split graph, and writes each call's positions into step
scalars of its own, ``StepScalars.fresh``). No fake value of an intermediate outlives it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import torch
import torch.fx

from ..compiling.piece_compiler import CompiledPiece
from ..fx import graph_facts as facts
from ..rewrite import PLACEHOLDER, Rewrite, StepScalars
from ..split.splitting import SplitGraph
from .padding import PiecePadding
from .rows.row_independence import Capacity, evaluate_rows
from .sdpa_choice import SdpaChoice


@dataclasses.dataclass(frozen=True)
class GraphInputs:
    """The graph the backend compiles and its inputs as the compiled graph will be called: Dynamo's,
    plus the step-scalar tensor when the decode rewrite added one (last)."""

    graph_module: torch.fx.GraphModule
    fake_mode: Any  # Dynamo's FakeTensorMode for this compile
    fake_inputs: tuple
    static_names: frozenset  # placeholder names of parameters/buffers (and the step scalars)
    rewrite: Rewrite | None

    @functools.cached_property
    def devices(self) -> frozenset:
        """The device types of the tensor inputs (Python floats passed as CPU scalars left out)."""
        return frozenset(v.device.type for i, v in enumerate(self.fake_inputs)
                         if isinstance(v, torch.Tensor) and i not in self.python_scalars)

    @functools.cached_property
    def names(self) -> tuple:
        """The graph's input names, in order (the run time's messages name inputs by them)."""
        return tuple(n.name for n in facts.placeholders(self.graph_module.graph))

    @functools.cached_property
    def static_inputs(self) -> frozenset:
        return frozenset(i for i, name in enumerate(self.names) if name in self.static_names)

    @functools.cached_property
    def python_scalars(self) -> frozenset:
        """Inputs that are Python floats passed as CPU scalar tensors (``graph_facts.python_scalar_inputs``)."""
        return facts.python_scalar_inputs(self.graph_module.graph)

    @functools.cached_property
    def weight_indices(self) -> tuple:
        """The parameters/buffers whose addresses choose the set of graphs (not the step scalars)."""
        own = len(self.fake_inputs) - 1 if self.rewrite is not None else None
        return tuple(i for i in sorted(self.static_inputs)
                     if isinstance(self.fake_inputs[i], torch.Tensor) and i != own)

    @property
    def masked_buffers(self) -> frozenset:
        """Buffers whose writes moved into compute pieces, masked to the caller's rows (or unmasked in a
        graph of fixed sizes, which is never padded): padding and repeated runs (warm-up) leave them
        as one real call would."""
        return self.rewrite.buffers if self.rewrite is not None else frozenset()

    @staticmethod
    def with_rewrite(rewrite: Rewrite, fake_mode, fake_inputs: list, static_names: set) -> "GraphInputs":
        """The rewritten graph's inputs: one more, the step scalars (a tensor Dynamo never saw: its
        static shape, not a fresh symbol)."""
        fakes = (*fake_inputs, fake_mode.from_tensor(rewrite.scalars.tensor, static_shapes=True))
        return GraphInputs(rewrite.graph_module, fake_mode, fakes, frozenset(static_names) | {PLACEHOLDER}, rewrite)


@dataclasses.dataclass(frozen=True)
class PiecePlan:
    """How one compute piece runs (``runtime/piece_runner.py`` reads nothing else about it)."""

    name: str
    fn: Callable
    fake_args: list  # what it was compiled for (strides of its inputs)
    static_args: frozenset  # args that are parameters/buffers: captured in place
    escaping_outputs: frozenset  # outputs the user sees: cloned out of the pool
    padding: PiecePadding | None
    stage_keys: Mapping[int, str]  # args read by several pieces: copied once per step (staging.py)
    restore_after_warmup: frozenset  # written args whose writes are not idempotent
    draws_random: bool = False  # draws from the default CUDA generator (captured with it registered)
    eager_fn: Callable | None = None  # its FX code, for when the compiled code raises (piece_runner)


@dataclasses.dataclass(frozen=True)
class ShapeKey:
    """Where each call's shape key is read: the batch symbols, never the per-step scalars."""

    sources: tuple  # (arg index, dim) or (arg index, None) for a SymInt input, per symbol
    symbols: tuple
    pad_position: int | None  # index in the key of the batch size, None: no dynamic batch
    values: tuple = ()  # arg indices of Python floats read by compute pieces: their values end the key

    def of(self, args: tuple) -> tuple:
        key = tuple(args[i] if dim is None else args[i].shape[dim] for i, dim in self.sources)
        return key + tuple(args[i].item() for i in self.values) if self.values else key


@dataclasses.dataclass(frozen=True)
class PaddingPlan:
    per_piece: Mapping[str, PiecePadding]  # empty: not padded
    refusal: str | None  # why the graph cannot be padded
    capacities: tuple[Capacity, ...]  # tensors read or written by batch row: they cap the padded size
    note: str  # what is padded, or why nothing is, for people


@dataclasses.dataclass(frozen=True)
class FullGraphPlan:
    """How a call under ``cudagraph_mode("full")`` is captured whole (``full_graph.py`` decides it)."""

    refusal: str | None  # why no call of this graph may be captured whole (None: any may)
    padding: PiecePadding | None  # the whole graph's inputs and outputs padded (None: exact sizes)
    padding_note: str  # what is padded, or why nothing is (naming the op), for people
    capacities: tuple[Capacity, ...]  # tensors read or written by batch row: they cap the padded size
    in_place: frozenset  # input indices used at their own address (weights, written inputs, Python scalars)
    draws_random: bool  # some op draws from the default CUDA generator (captured with it registered)
    returns_inputs: frozenset = frozenset()  # output positions that are views of inputs used in place

    def row_limit(self, symbols: tuple) -> Callable[[tuple], int | None] | None:
        capacities = self.capacities
        return (lambda key: evaluate_rows(capacities, dict(zip(symbols, key)))) if capacities else None


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """What the plan tells people (the inspection report, the stats), apart from what runs a call."""

    signatures: Mapping[str, tuple]  # piece name -> (described inputs, described output)
    code: Mapping[str, str]  # piece name -> its FX code (wrapping hides the submodules)
    attention: tuple  # (node name, how it runs) per attention call, in order (``making._attention``)
    inductor_compiles: int
    inductor_seconds: float


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    split: SplitGraph
    compiled: Mapping[str, CompiledPiece]
    pieces: Mapping[str, PiecePlan]  # compute pieces, in execution order
    inputs: GraphInputs
    fake_outputs: Mapping[str, Any]  # every piece's fake output (up-front capture's stand-ins)
    key: ShapeKey
    padding: PaddingPlan
    graphs_disabled_reason: str | None  # why this graph never captures, None: it does
    unmasked_writes: tuple  # buffers compute pieces write at the caller's positions (full mode)
    collective_groups: tuple  # process groups whose ranks must decide captures together (collectives.py)
    sdpa_choice: SdpaChoice | None  # the SDPA kernels eager attention may use (None: torch's choice)
    full: FullGraphPlan  # how a call is captured whole, when its caller says it may be
    report: PlanReport  # what it tells people; nothing that runs a call reads it

    @functools.cached_property
    def device(self) -> torch.device:
        return graph_device(self.inputs.fake_inputs, self.inputs.python_scalars)

    @property
    def step_scalars(self) -> StepScalars | None:
        return self.inputs.rewrite.scalars if self.inputs.rewrite is not None else None

    @property
    def any_requires_grad(self) -> bool:
        return any(isinstance(v, torch.Tensor) and v.requires_grad for v in self.inputs.fake_inputs)

    def row_limit(self) -> Callable[[tuple], int | None] | None:
        """``key -> rows``: the most rows a padded batch may have at that key (None: no cap)."""
        capacities, symbols = self.padding.capacities, self.key.symbols
        return (lambda key: evaluate_rows(capacities, dict(zip(symbols, key)))) if capacities else None


def graph_device(fake_inputs, python_scalars: frozenset = frozenset()) -> torch.device:
    """The device of the graph's tensors (Python floats passed as CPU scalars do not count)."""
    tensors = [f for i, f in enumerate(fake_inputs) if isinstance(f, torch.Tensor) and i not in python_scalars]
    return tensors[0].device if tensors else torch.device("cpu")
