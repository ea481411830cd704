"""What a capture leaves behind: a graph and what its replays check, for one piece or one whole call.

Made by the capture paths (``piece.py`` inline, ``behind_record.py`` in the capture thread) and read
by the replay paths (``runtime/piece_runner.py``, ``runtime/full_graph.py``); kept apart from both so
that neither imports the other.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Captured:
    """One piece's graph at one shape key, and what a replay checks."""

    graph: Any  # a torch.cuda.CUDAGraph, a RawGraph (devices.py), or an EmulatedGraph on CPU: replay()
    checks: list  # (arg index, captured buffer, captured data_ptr, stage key or None) per tensor input
    #               that is not a parameter/buffer
    outputs: Any  # the piece's output structure, tensors as non-owning aliases
    views: dict = dataclasses.field(default_factory=dict)  # caller size -> (checks, outputs) sliced to it


@dataclasses.dataclass
class WholeCapture:
    """One whole call's graph at one shape key (``cudagraph_mode("full")``), and what a replay checks."""

    graph: Any  # torch.cuda.CUDAGraph, a RawGraph, or an EmulatedGraph on CPU
    copies: list  # (arg index, owned buffer, its address) per input copied in
    written: list  # (arg index, address at capture) per written input used in place: must not move
    outputs: tuple  # the call's outputs, tensors as weak aliases
    views: dict = dataclasses.field(default_factory=dict)  # caller size -> (copies, outputs) cut to it
