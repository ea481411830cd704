"""Which SDPA kernels a compiled graph's eager attention may use: the compile-time half.

``runtime/sdpa_backends.py`` says why (cuDNN re-plans at every new KV length) and switches the
flags around each call; this reads the eager SDPA calls of the split graph once, at compile time,
and hands the choice to run time in the plan.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ..config import SDPA_BACKENDS as NAMES
from ..fx import graph_facts as facts
from .types import SdpaChoice


def _kv_length(node: torch.fx.Node):
    """The KV length (the key's dim -2) an SDPA call sees, or None when its key is not a tensor."""
    key = node.args[1] if len(node.args) > 1 else node.kwargs.get("key")
    value = facts.example_value(key) if isinstance(key, torch.fx.Node) else None
    return value.shape[-2] if isinstance(value, torch.Tensor) and value.dim() >= 2 else None


def choose(option: Any, eager_sdpa: list[torch.fx.Node], device_type: str = "cuda") -> SdpaChoice | None:
    """The backends a compiled graph's calls run with (None: torch's own choice, untouched), given the
    SDPA calls of its eager pieces and the graph's device (``"auto"`` concerns cuDNN: CUDA only)."""
    if option == "torch" or option == "auto" and device_type != "cuda":
        return None
    if option != "auto":
        return SdpaChoice({name: name in option for name in NAMES}, f"eager_sdpa_backends={list(option)}")
    varying = [node.name for node in eager_sdpa if isinstance(_kv_length(node), torch.SymInt)]
    if not varying:
        return None
    return SdpaChoice(
        {"cudnn": False},
        f"cuDNN attention off: {len(varying)} eager SDPA call(s) see a new KV "
        f"length per call (e.g. {varying[0]}), which cuDNN would re-plan",
    )
