"""The step scalars: one small device tensor that carries a decode step's Python ints into graphs.

A decode step's position (``pos``) changes every call; a graph that baked it in would be wrong the
next step. The rewrites of this package read such ints from this tensor instead. The compiled graph
refreshes it once per call (one ``fill_`` per value that changed, none when nothing did) after
checking every value against the bounds its readers need, so an out-of-range position raises a
named error on the host rather than a device-side index error that kills the CUDA context.

One slot per per-step int, whatever constants its readers add (``pos`` for the write, ``pos + 1``
for the attention's length): the graph adds them. Why: each ``fill_`` is a kernel launch from the
host on every decode step (~5 µs on the H200 machine); an add in the graph costs next to nothing.

**Written ahead.** A slot that went up by one since the previous call (a decode position) is
written for the *next* call as soon as this call's kernels are enqueued (``runtime/step_scalars.py``),
so a decode step's ``fill_`` is launched while the GPU runs the step before, not between the call
and its replay, where a step that waits for its tokens pays for it (~10 µs of a batch-1 step's
host time on the H200 machine). Stream order keeps it right: the write comes after every kernel of
this call that reads the slot and before any of the next. A call whose values differ from what was
written ahead (a new sequence, a jump) writes them before it runs, as it did without this. A guess
past a slot's bounds is not written: up-front capture may read the tensor between calls.

This module finds the slots at compile time; ``runtime/step_scalars.py`` writes them per call.

Slot 0 is the *enable* flag: up-front capture runs compute pieces on made-up inputs and sets it to
0, and every rewritten write then puts back what it read. A graph whose writes are unmasked (fixed
sizes: it never captures up front) refuses that with an error instead.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from ..fx import graph_facts as facts
from ..kinds import STEP_SCALARS_ENABLE as ENABLE
from ..kinds import Slot

PLACEHOLDER = "piecewise_step_scalars"  # the graph input the rewrites add, after Dynamo's own
__all__ = ["ENABLE", "PLACEHOLDER", "Slot", "Slots", "example_tensor"]


class Slots:
    """Step scalars by graph input, with the tightest bounds any reader needs."""

    def __init__(self, graph: torch.fx.Graph):
        self.position = {n: i for i, n in enumerate(facts.placeholders(graph))}
        self.slots: list[Slot] = []
        self.index: dict = {}  # placeholder -> index in the device tensor (0 is the enable flag)

    def need(self, node: torch.fx.Node, offset: int, low: int, high: int, what: str) -> None:
        """A reader of ``node + offset`` needs ``low <= node + offset <= high``."""
        low, high = low - offset, high - offset
        if node in self.index:
            j = self.index[node] - 1
            old = self.slots[j]
            self.slots[j] = dataclasses.replace(
                old, low=max(old.low, low), high=min(old.high, high), what=old.what if old.high <= high else what
            )
        else:
            self.slots.append(Slot(self.position[node], node.name, low, high, what))
            self.index[node] = len(self.slots)


def example_tensor(slots, device: torch.device) -> torch.Tensor:
    """A tensor shaped as the step scalars of ``slots`` (the rewritten graph's new input, for its fake value)."""
    return torch.ones(1 + len(slots), dtype=torch.int64, device=device)
