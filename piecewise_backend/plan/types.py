"""The plan: what compile time hands to run time, a run-time value and all that run time reads.

``making.py`` decides it from what the compile stages found (``backend.build``: rewrite → split →
compile → plan → wrap); ``runtime/`` imports these types and nothing else of compile time. A
:class:`GraphPlan` holds the split graph as code (:class:`FxProgram`), how each compute piece is
run (:class:`PiecePlan`), the shape key read per call (:class:`ShapeKey`), whether and how batches
are padded (:class:`PaddingPlan`), how a call is captured whole (:class:`FullGraphPlan`), and why
the graph gets no CUDA graphs at all, if it does not.

It is a value: no fake tensor, no graph node's metadata, no proof object outlives compile time.
Tensors are described by :class:`TensorSpec` (sizes as ints or sympy expressions in the graph's
symbols), so the plan pickles, and a process that loads it (``persist/``) runs it as the one that
made it. Frozen: the run time wraps its pieces in a copy of the program, and writes each call's
positions into step scalars of its own (``runtime/step_scalars.py``, from :class:`StepScalarLayout`).

It imports no compile stage and evaluates nothing: what run time computes from it (the row limits
of :class:`Capacity`, symbol values) run time computes with its own code (``runtime/symbolic.py``).
The options run time reads travel in it (:class:`RuntimeSettings`), not beside it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx

from .._torch_internals import sym_expr
from ..kinds import PieceSpec, Slot

# -- values, described -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor as a fake value described it: sizes and strides are ints or sympy expressions in the
    graph's symbols (``s0``, ``128*s0``). What run time needs to read a symbol's value from a real
    tensor, check its strides, or make a zero stand-in at chosen sizes (``runtime/symbolic.py``)."""

    shape: tuple
    strides: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool = False

    def dim(self) -> int:
        return len(self.shape)


@dataclasses.dataclass(frozen=True)
class SymSpec:
    """A symbolic number (a SymInt input: a size passed as an int), as its sympy expression."""

    expr: Any


def _size(value) -> Any:
    expr = sym_expr(value)
    return int(expr) if getattr(expr, "is_Integer", False) else expr


def describe(value: Any) -> Any:
    """The run-time description of a compile-time value: fake tensors become :class:`TensorSpec`,
    symbolic numbers :class:`SymSpec`, lists and tuples keep their structure, the rest is kept."""
    if isinstance(value, torch.Tensor):
        return TensorSpec(
            tuple(map(_size, value.shape)),
            tuple(map(_size, value.stride())),
            value.dtype,
            value.device,
            bool(value.requires_grad),
        )
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return SymSpec(sym_expr(value))
    if type(value) in (list, tuple):
        return type(value)(describe(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class StepScalarLayout:
    """The decode rewrite's step scalars as run time makes them: one int64 slot per per-step int after
    the enable flag (``rewrite/step_scalars.py`` says why; ``runtime/step_scalars.py`` writes them)."""

    slots: tuple[Slot, ...]
    device: torch.device
    writes_masked: bool  # the rewritten writes honour the enable flag (kv_writes.py)


@dataclasses.dataclass(frozen=True)
class InputsPlan:
    """The graph's inputs as run time reads them: Dynamo's, plus the step-scalar tensor when the
    decode rewrite added one (last)."""

    names: tuple  # in order (the run time's messages name inputs by them)
    specs: tuple  # TensorSpec / SymSpec / a plain value, per input
    static_inputs: frozenset  # indices of parameters/buffers (and the step scalars): used in place
    python_scalars: frozenset  # Python floats passed as CPU scalar tensors (host values, keyed by value)
    weight_indices: tuple  # the parameters/buffers whose addresses choose the set of graphs
    step_scalars: StepScalarLayout | None  # the decode rewrite's layout (None: no rewrite)

    @functools.cached_property
    def device(self) -> torch.device:
        """The device of the graph's tensors (Python floats passed as CPU scalars do not count)."""
        return graph_device(self.specs, self.python_scalars)

    @property
    def any_requires_grad(self) -> bool:
        return any(isinstance(v, TensorSpec) and v.requires_grad for v in self.specs)


def graph_device(values, python_scalars: frozenset = frozenset()) -> torch.device:
    """The device of the first tensor (fake or described) that is not a Python float's CPU scalar."""
    for i, v in enumerate(values):
        if isinstance(v, (torch.Tensor, TensorSpec)) and i not in python_scalars:
            return v.device
    return torch.device("cpu")


# -- padding -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PiecePadding:
    """How to pad one compute piece (``padding.py`` proves it safe).

    Attributes:
        arg_dims: tensor arg index -> the dim that holds the padded size.
        out_dims: for each output (flattened), the dim to slice back, or None.
        scalar_exprs: SymInt arg index -> its sympy expression (re-evaluated at the padded size).
    """

    arg_dims: dict
    out_dims: tuple
    scalar_exprs: dict


@dataclasses.dataclass(frozen=True)
class Capacity:
    """A tensor read or written by batch row: a padded batch may not exceed ``rows``
    (``rows/row_independence.py`` finds them)."""

    tensor: str  # the graph input (or value) read or written by batch row
    where: str  # which dim, and the node that does it, for people
    rows: Any  # an int, or a sympy expression in the graph's symbols


@dataclasses.dataclass(frozen=True)
class PaddingPlan:
    per_piece: Mapping[str, PiecePadding]  # empty: not padded
    refusal: str | None  # why the graph cannot be padded
    capacities: tuple[Capacity, ...]  # tensors read or written by batch row: they cap the padded size
    note: str  # what is padded, or why nothing is, for people


# -- pieces and calls ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SdpaChoice:
    """Which SDPA kernels a graph's eager attention may use (``sdpa_choice.py`` decides it)."""

    enabled: Mapping[str, bool]  # backend name -> on/off while the graph runs
    reason: str  # why, for the stats and the inspection report


@dataclasses.dataclass(frozen=True)
class PiecePlan:
    """How one compute piece runs (``runtime/piece_runner.py`` reads nothing else about it; its code
    is handed beside the plan: compiled code is not a plan's to hold)."""

    name: str
    arg_specs: tuple  # what it was compiled for (strides of its inputs), described
    static_args: frozenset  # args that are parameters/buffers: captured in place
    escaping_outputs: frozenset  # outputs the user sees: cloned out of the pool
    padding: PiecePadding | None
    stage_keys: Mapping[int, str]  # args read by several pieces: copied once per step (staging.py)
    restore_after_warmup: frozenset  # written args whose writes are not idempotent
    draws_random: bool = False  # draws from the default CUDA generator (captured with it registered)


@dataclasses.dataclass(frozen=True)
class PieceCode:
    """The code one compute piece runs, handed to run time beside its :class:`PiecePlan`."""

    compiled: Callable | None  # Inductor's code (None: the traced code runs, ``compiler="eager"``)
    traced: Callable  # its FX code as Dynamo traced it (the program's submodule)

    @property
    def runs(self) -> Callable:
        return self.compiled if self.compiled is not None else self.traced


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
class FullGraphPlan:
    """How a call under ``cudagraph_mode("full")`` is captured whole (``full_graph.py`` decides it)."""

    refusal: str | None  # why no call of this graph may be captured whole (None: any may)
    padding: PiecePadding | None  # the whole graph's inputs and outputs padded (None: exact sizes)
    padding_note: str  # what is padded, or why nothing is (naming the op), for people
    capacities: tuple[Capacity, ...]  # tensors read or written by batch row: they cap the padded size
    in_place: frozenset  # input indices used at their own address (weights, written inputs, Python scalars)
    draws_random: bool  # some op draws from the default CUDA generator (captured with it registered)
    returns_inputs: frozenset = frozenset()  # output positions that are views of inputs used in place


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """What the plan tells people (the inspection report, the stats), apart from what runs a call."""

    signatures: Mapping[str, tuple]  # piece name -> (described inputs, described output)
    code: Mapping[str, str]  # piece name -> its FX code (wrapping hides the submodules)
    attention: tuple  # (node name, how it runs) per attention call, in order (``making._attention``)
    inductor_compiles: int
    inductor_seconds: float
    compiled_as: Mapping[str, str] = dataclasses.field(default_factory=dict)  # piece -> first piece of its code
    inductor_code: Mapping[str, str] = dataclasses.field(default_factory=dict)  # piece -> Inductor's module
    step_symbols: tuple = ()  # the per-step scalars' symbols (positions), by name


class FxProgram:
    """The split graph as code: its forward calls the pieces in order; each piece is a submodule of
    FX code (a compute piece's as Dynamo traced it, before any compiler rewrote it: what runs when
    no compiler is used, or when compiled code fails). No node keeps its metadata (fake values), so
    it pickles as torch pickles a ``GraphModule``: Python code and constants."""

    def __init__(self, module: torch.fx.GraphModule):
        for gm in (module, *(m for m in module.children() if isinstance(m, torch.fx.GraphModule))):
            for node in gm.graph.nodes:
                node.meta.clear()
        self.module = module

    def piece(self, name: str) -> torch.fx.GraphModule:
        return getattr(self.module, name)


@dataclasses.dataclass(frozen=True)
class RuntimeSettings:
    """The options run time reads (``config.PiecewiseConfig`` documents each), fixed at compile time."""

    sizes: tuple  # the capture sizes, ascending
    eager_sizes: tuple  # eager_capture_sizes, largest first
    lazy_capture: bool
    padding: bool
    defer_captures: bool
    capture_behind: bool
    max_graph_memory: int | None
    max_captured_sizes: int | None
    max_unreplayed_captures: int | None
    max_weight_sets: int
    warmup_runs: int
    clone_outputs: bool

    @classmethod
    def of(cls, config) -> RuntimeSettings:
        """The run-time options of a ``PiecewiseConfig`` (validated)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    program: FxProgram
    piece_specs: tuple[PieceSpec, ...]  # every piece of the split graph, in order
    pieces: Mapping[str, PiecePlan]  # compute pieces, in execution order
    inputs: InputsPlan
    output_specs: Mapping[str, Any]  # every piece's output, described (up-front capture's stand-ins)
    key: ShapeKey
    padding: PaddingPlan
    graphs_disabled_reason: str | None  # why this graph never captures, None: it does
    unmasked_writes: tuple  # buffers compute pieces write at the caller's positions (full mode)
    collective_groups: tuple  # process groups whose ranks must decide captures together (collectives.py)
    sdpa_choice: SdpaChoice | None  # the SDPA kernels eager attention may use (None: torch's choice)
    full: FullGraphPlan  # how a call is captured whole, when its caller says it may be
    report: PlanReport  # what it tells people; nothing that runs a call reads it
    settings: RuntimeSettings  # the options run time reads
    unsafe_ops: tuple = ()  # ops split at because they are tagged cudagraph_unsafe, once each

    @property
    def device(self) -> torch.device:
        return self.inputs.device

    @property
    def step_scalars(self) -> StepScalarLayout | None:
        return self.inputs.step_scalars
