"""The step scalars at run time: the device tensor a compiled graph writes each call's positions into.

``rewrite/step_scalars.py`` says what they are and why one tensor; the plan carries their layout
(``plan.types.StepScalarLayout``); each compiled graph makes its own tensor from it, checks every
call's values against the bounds the rewrites need, and writes the next decode position ahead.
"""

from __future__ import annotations

import contextlib

import torch

from ..kinds import STEP_SCALARS_ENABLE as ENABLE
from ..plan.types import StepScalarLayout


class StepScalars:
    """The device tensor the rewritten graph reads its positions and real sizes from."""

    def __init__(self, layout: StepScalarLayout):
        slots, device, writes_masked = layout.slots, layout.device, layout.writes_masked
        self.slots = slots
        self.writes_masked = writes_masked  # the rewritten writes honour the enable flag (kv_writes.py)
        with torch.inference_mode(False):  # a normal tensor: filled in place under any grad mode
            self.tensor = torch.ones(1 + len(slots), dtype=torch.int64, device=device)
            self._views = [self.tensor[j] for j in range(1 + len(slots))]
        self._held: list = [None] * len(slots)  # what the device tensor holds once the queued writes ran
        self._called: list | None = None  # this call's values
        self._before: list | None = None  # the previous call's

    def refresh(self, args: tuple) -> tuple:
        """Check this call's positions, write the ones the device does not hold; ``args`` + the tensor.

        All are checked before any is written: a refused call leaves the device tensor as it was.
        """
        values = [args[slot.arg] for slot in self.slots]
        if values != self._held:
            for slot, value in zip(self.slots, values):
                if not slot.low <= value <= slot.high:
                    name = slot.name
                    raise IndexError(
                        f"piecewise: {slot.what} needs {slot.low} <= {name} <= {slot.high}; got "
                        f"{name} = {value}. It would reach outside the buffer (eager PyTorch "
                        f"raises a shape error here too): make the buffer larger or stop before "
                        f"its end."
                    )
            self._write(values)
        self._before, self._called = self._called, values
        return (*args, self.tensor)

    def write_ahead(self) -> None:
        """After a call's kernels are enqueued: write the next call's values where they are easy to
        guess (a slot one up on the previous call's goes one up again; see "Written ahead")."""
        called, before = self._called, self._before
        if called is None or before is None:
            return
        ahead = [
            value + 1 if value == old + 1 and value < slot.high else value
            for slot, value, old in zip(self.slots, called, before)
        ]
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
            raise RuntimeError(
                "piecewise: this graph's KV writes are unmasked (its inputs have fixed sizes), so "
                "they cannot be turned off for a run on made-up inputs; it captures lazily, on "
                "real calls."
            )
        self._views[ENABLE].fill_(0)
        try:
            yield
        finally:
            self._views[ENABLE].fill_(1)
