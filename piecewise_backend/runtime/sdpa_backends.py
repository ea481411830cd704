"""Which SDPA kernels the eager attention pieces run with, so that a new KV length never re-plans.

Why: torch picks an SDPA kernel at every call. With torch 2.11 on the H200 its default order puts
cuDNN attention first, and cuDNN builds an execution plan for every new shape: about 9 ms of host
time per call (profiled: ``aten::_cudnn_attention_forward``, 95% of a step's CPU time). An eager
attention piece sees a new KV length at every decode step, so with torch's defaults every layer of
every step paid it, and a 16-layer decode step took 36-54 ms, as long as eager. Flash and
memory-efficient attention launch without planning; math runs anything they cannot.

So by default (``eager_sdpa_backends="auto"``; decided at compile time, ``plan/sdpa_choice.py``),
while a compiled graph runs, cuDNN attention is off
if one of its eager SDPA calls has a KV length that changes between calls (a symbol in the key's
length). Where every length is fixed (a static cache attended whole), torch's own choice stands:
cuDNN plans once per shape. ``"torch"`` leaves torch's choice alone; a list of names (``"flash"``,
``"efficient"``, ``"math"``, ``"cudnn"``) enables exactly those while the graph runs. The caller's
settings are restored after each call, and "auto" never turns off the last backend a caller left on.
Compiled pieces are unaffected: Inductor chose their kernels at compile time, and graphs replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..config import SDPA_BACKENDS as NAMES

_cuda = torch.backends.cuda
_GET = {
    "flash": _cuda.flash_sdp_enabled,
    "efficient": _cuda.mem_efficient_sdp_enabled,
    "math": _cuda.math_sdp_enabled,
    "cudnn": _cuda.cudnn_sdp_enabled,
}
_SET = {
    "flash": _cuda.enable_flash_sdp,
    "efficient": _cuda.enable_mem_efficient_sdp,
    "math": _cuda.enable_math_sdp,
    "cudnn": _cuda.enable_cudnn_sdp,
}


class SdpaBackends:
    """Runs a call with some SDPA backends switched on or off, and the caller's settings after."""

    def __init__(self, enabled: dict[str, bool], reason: str):
        self.enabled = enabled  # backend name -> on/off while the graph runs
        self.reason = reason  # why, for the stats and the inspection report

    def call(self, fn: Callable, args: tuple) -> Any:
        changed = self._apply()
        try:
            return fn(*args)
        finally:
            for name, value in changed:
                _SET[name](value)

    def _apply(self) -> list[tuple[str, bool]]:
        """Switch the flags; returns (name, the caller's value) of each one changed."""
        changed = []
        for name, value in self.enabled.items():
            current = _GET[name]()
            if current != value:
                changed.append((name, current))
                _SET[name](value)
        if changed and not any(_GET[name]() for name in NAMES):  # "auto" turned off the caller's only one
            for name, value in changed:
                _SET[name](value)
            return []
        return changed
