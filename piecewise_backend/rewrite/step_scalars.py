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
written for the *next* call as soon as this call's kernels are enqueued (:meth:`StepScalars.write_ahead`),
so a decode step's ``fill_`` is launched while the GPU runs the step before, not between the call
and its replay, where a step that waits for its tokens pays for it (~10 µs of a batch-1 step's
host time on the H200 machine). Stream order keeps it right: the write comes after every kernel of
this call that reads the slot and before any of the next. A call whose values differ from what was
written ahead (a new sequence, a jump) writes them before it runs, as it did without this. A guess
past a slot's bounds is not written: up-front capture may read the tensor between calls.

Slot 0 is the *enable* flag: up-front capture runs compute pieces on made-up inputs and sets it to
0, and every rewritten write then puts back what it read. A graph whose writes are unmasked (fixed
sizes: it never captures up front) refuses that with an error instead.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.fx

from ..fx import graph_facts as facts

PLACEHOLDER = "piecewise_step_scalars"  # the graph input the rewrites add, after Dynamo's own
ENABLE = 0  # slot 0: 1 = write, 0 = write every element back unchanged (up-front capture)


@dataclasses.dataclass(frozen=True)
class Slot:
    """One step scalar: which graph input feeds it and what it must satisfy."""

    arg: int  # position of the SymInt graph input
    name: str
    low: int  # value must be >= low ...
    high: int  # ... and <= high
    what: str  # the reader it guards, for the error message


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
            self.slots[j] = dataclasses.replace(old, low=max(old.low, low), high=min(old.high, high),
                                                what=old.what if old.high <= high else what)
        else:
            self.slots.append(Slot(self.position[node], node.name, low, high, what))
            self.index[node] = len(self.slots)


class StepScalars:
    """The device tensor the rewritten graph reads its positions and real sizes from."""

    def __init__(self, slots: list[Slot], device: torch.device, writes_masked: bool = True):
        self.slots = slots
        self.writes_masked = writes_masked  # the rewritten writes honour the enable flag (kv_writes.py)
        with torch.inference_mode(False):  # a normal tensor: filled in place under any grad mode
            self.tensor = torch.ones(1 + len(slots), dtype=torch.int64, device=device)
            self._views = [self.tensor[j] for j in range(1 + len(slots))]
        self._held: list = [None] * len(slots)  # what the device tensor holds once the queued writes ran
        self._called: list | None = None  # this call's values
        self._before: list | None = None  # the previous call's

    def fresh(self) -> "StepScalars":
        """The same layout with a device tensor and per-call state of its own: what a compiled graph
        writes at run time (the plan keeps this one as compile time made it)."""
        return StepScalars(self.slots, self.tensor.device, self.writes_masked)

    def refresh(self, args: tuple) -> tuple:
        """Check this call's positions, write the ones the device does not hold; ``args`` + the tensor.

        All are checked before any is written: a refused call leaves the device tensor as it was.
        """
        values = [args[slot.arg] for slot in self.slots]
        if values != self._held:
            for slot, value in zip(self.slots, values):
                if not slot.low <= value <= slot.high:
                    name = slot.name
                    raise IndexError(f"piecewise: {slot.what} needs {slot.low} <= {name} <= {slot.high}; got "
                                     f"{name} = {value}. It would reach outside the buffer (eager PyTorch "
                                     f"raises a shape error here too): make the buffer larger or stop before "
                                     f"its end.")
            self._write(values)
        self._before, self._called = self._called, values
        return (*args, self.tensor)

    def write_ahead(self) -> None:
        """After a call's kernels are enqueued: write the next call's values where they are easy to
        guess (a slot one up on the previous call's goes one up again; see "Written ahead")."""
        called, before = self._called, self._before
        if called is None or before is None:
            return
        ahead = [value + 1 if value == old + 1 and value < slot.high else value
                 for slot, value, old in zip(self.slots, called, before)]
        if ahead != called:
            self._write(ahead)

    def _write(self, values: list) -> None:
        for j, (value, held) in enumerate(zip(values, self._held)):
            if value != held:
                self._views[1 + j].fill_(value)
        self._held = values

    @contextlib.contextmanager
    def writes_disabled(self):
        """Rewritten writes put back what they read (for runs on made-up inputs)."""
        if not self.writes_masked:
            raise RuntimeError("piecewise: this graph's KV writes are unmasked (its inputs have fixed sizes), so "
                               "they cannot be turned off for a run on made-up inputs; it captures lazily, on "
                               "real calls.")
        self._views[ENABLE].fill_(0)
        try:
            yield
        finally:
            self._views[ENABLE].fill_(1)
