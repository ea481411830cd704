"""The graph the compile stages work on and its fake inputs (compile time only).

:class:`GraphInputs` is what the rewrite stage gives the split, compile and plan stages: Dynamo's
graph (or the decode rewrite's), its fake inputs and which inputs are used in place. The plan keeps
none of it: :meth:`GraphInputs.run_time` is what run time gets (``types.InputsPlan``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.fx

from ..fx import graph_facts as facts
from ..rewrite import PLACEHOLDER, Rewrite, example_tensor
from .types import InputsPlan, StepScalarLayout, describe


@dataclasses.dataclass(frozen=True)
class GraphInputs:
    """The graph the backend compiles and its inputs as the compiled graph will be called: Dynamo's,
    plus the step-scalar tensor when the decode rewrite added one (last)."""

    graph_module: torch.fx.GraphModule
    fake_mode: Any  # Dynamo's FakeTensorMode for this compile
    fake_inputs: tuple
    static_names: frozenset  # placeholder names of parameters/buffers (and the step scalars)
    rewrite: Rewrite | None
    graphs_off: str | None = None  # why the options or the inputs' devices keep graphs off (stage 1 asks once)

    @functools.cached_property
    def devices(self) -> frozenset:
        """The device types of the tensor inputs (Python floats passed as CPU scalars left out)."""
        return frozenset(
            v.device.type
            for i, v in enumerate(self.fake_inputs)
            if isinstance(v, torch.Tensor) and i not in self.python_scalars
        )

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
        return tuple(
            i for i in sorted(self.static_inputs) if isinstance(self.fake_inputs[i], torch.Tensor) and i != own
        )

    @property
    def masked_buffers(self) -> frozenset:
        """Buffers whose writes moved into compute pieces, masked to the caller's rows (or unmasked in a
        graph of fixed sizes, which is never padded): padding and repeated runs (warm-up) leave them
        as one real call would."""
        return self.rewrite.buffers if self.rewrite is not None else frozenset()

    def run_time(self) -> InputsPlan:
        """What run time reads of the inputs: their names, descriptions, and which are used in place."""
        return InputsPlan(
            self.names,
            tuple(describe(v) for v in self.fake_inputs),
            self.static_inputs,
            self.python_scalars,
            self.weight_indices,
            self.step_scalars,
        )

    @property
    def step_scalars(self) -> StepScalarLayout | None:
        rewrite = self.rewrite
        return StepScalarLayout(rewrite.slots, rewrite.device, rewrite.writes_masked) if rewrite is not None else None

    @staticmethod
    def with_rewrite(
        rewrite: Rewrite, fake_mode, fake_inputs: list, static_names: set, graphs_off: str | None = None
    ) -> GraphInputs:
        """The rewritten graph's inputs: one more, the step scalars (a tensor Dynamo never saw: its
        static shape, not a fresh symbol)."""
        fakes = (*fake_inputs, fake_mode.from_tensor(example_tensor(rewrite.slots, rewrite.device), static_shapes=True))
        return GraphInputs(
            rewrite.graph_module, fake_mode, fakes, frozenset(static_names) | {PLACEHOLDER}, rewrite, graphs_off
        )
