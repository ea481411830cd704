"""Capturing sizes before any call needs them, with no side effects on the caller's state.

To capture size 64 we must run every compute piece at 64 with inputs at the right addresses, but
we have no batch of 64 to run. Running the whole graph on made-up inputs would run its eager pieces
too, and those write the caller's KV cache. So only the compute pieces run (they never write a
caller's tensor except, in full mode, buffers the graph itself writes at the positions it is given),
in order, fed by zero stand-ins for everything else:

* weights and buffers: the real tensors, remembered from the graph's first call;
* other graph inputs and the eager pieces' outputs: zeros shaped from their fake values, with the
  batch symbol set to the size being captured (zeros are valid token ids and harmless activations);
* earlier compute pieces' outputs: the real captured outputs, as in a real step, so each piece is
  captured reading its predecessor's pool memory and a later real step replays with no copies.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from .padding import evaluate


def materialize(fake: Any, values: dict, device: torch.device | None = None) -> Any:
    """A real zero-filled stand-in for a fake value, its sizes evaluated at ``values``."""
    if isinstance(fake, (tuple, list)):
        return type(fake)(materialize(f, values, device) for f in fake)
    if isinstance(fake, torch.Tensor):
        size = [evaluate(_expr(s), values) for s in fake.shape]
        stride = [evaluate(_expr(s), values) for s in fake.stride()]
        out = torch.empty_strided(size, stride, dtype=fake.dtype, device=device or fake.device)
        return out.zero_()
    if isinstance(fake, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return evaluate(_expr(fake), values)
    return fake


def _expr(v):
    return v.node.expr if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) else v


def symbol_values(fake_inputs: list, args: tuple) -> dict:
    """Every symbol that is a whole input dim or a SymInt input, mapped to its value in ``args``."""
    values = {}
    for fake, real in zip(fake_inputs, args):
        if isinstance(fake, torch.SymInt) and fake.node.expr.is_Symbol:
            values[fake.node.expr] = int(real)
        elif isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor):
            for size, n in zip(fake.shape, real.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    values[size.node.expr] = n
    return values


class _ComputeOnlyRun(torch.fx.Interpreter):
    """Runs the split graph's compute pieces; eager pieces are replaced by zero stand-ins."""

    def __init__(self, split_gm, runners: dict, fake_outputs: dict, values: dict, device):
        super().__init__(split_gm)
        self.runners = runners
        self.fake_outputs = fake_outputs
        self.values = values
        self.device = device

    def call_module(self, target, args, kwargs):
        if target in self.runners:
            return self.runners[target](*args)
        return materialize(self.fake_outputs[target], self.values, self.device)


def run_compute_pieces(split_gm, runners: dict, fake_outputs: dict, fake_inputs: list, template: list,
                       static_inputs: frozenset, values: dict) -> None:
    """Run every compute piece once on stand-ins at the symbol ``values`` (the runners capture)."""
    device = next(f.device for f in fake_inputs if isinstance(f, torch.Tensor))
    inputs = [template[i] if i in static_inputs or not isinstance(fake, torch.Tensor)
              and not isinstance(fake, torch.SymInt) else materialize(fake, values, device)
              for i, fake in enumerate(fake_inputs)]
    with torch.no_grad():
        _ComputeOnlyRun(split_gm, runners, fake_outputs, values, device).run(*inputs)
