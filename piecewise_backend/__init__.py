"""piecewise_backend: a torch.compile backend that splits at attention, compiles each piece with
Inductor, and captures each compiled piece lazily as one CUDA graph per shape.

    torch.compile(model, backend="piecewise", options={...})

The name is found through the ``torch_dynamo_backends`` entry point once the package is installed;
``backend=piecewise_backend.piecewise`` works too. ``with cudagraph_mode("full"):`` around a call
captures it whole (a serving engine's decode step); ``piecewise_backend.ops`` holds the paged decode
attention that makes such a step graph-safe. ``save(model.forward, example_inputs, path)`` and
``load(path, model.forward)`` start a later process with no trace and no compile (``persist/``;
``preload(path)`` first overlaps the loading with building the model).
"""

from .backend import piecewise
from .config import PiecewiseConfig
from .kinds import CaptureHow, GraphMode, Miss, PieceKind
from .observe.inspection import PieceInfo, SplitReport, debug_dump, inspect_split, report, reports
from .observe.reports import capture_table, explain, process_stats
from .op_names import DEFAULT_SPLITTING_OPS
from .persist.compile_behind import start_compile_workers
from .persist.warm_start import load, preload, save
from .plan.emulation import emulated_graphs
from .registry import (
    capture,
    compiled_graphs,
    estimate_graph_memory,
    graph_memory_bytes,
    release_graphs,
    wait_for_captures,
)
from .runtime.compiled_graph import CompiledGraph
from .runtime.devices import pool_bytes
from .runtime.direct_calls import DirectCalls, direct
from .runtime.graph_mode import cudagraph_mode
from .runtime.memory_estimate import GraphMemoryEstimate
from .runtime.stats import CaptureEvent, GraphStats, PieceStats

__version__ = "0.2.0"

__all__ = [
    "piecewise",
    "PiecewiseConfig",
    "CompiledGraph",
    "direct",
    "DirectCalls",
    "compiled_graphs",
    "capture",
    "wait_for_captures",
    "release_graphs",
    "estimate_graph_memory",
    "process_stats",
    "explain",
    "capture_table",
    "pool_bytes",
    "graph_memory_bytes",
    "GraphMemoryEstimate",
    "CaptureEvent",
    "inspect_split",
    "report",
    "reports",
    "debug_dump",
    "SplitReport",
    "PieceInfo",
    "GraphStats",
    "PieceStats",
    "DEFAULT_SPLITTING_OPS",
    "PieceKind",
    "Miss",
    "CaptureHow",
    "emulated_graphs",
    "cudagraph_mode",
    "GraphMode",
    "save",
    "load",
    "preload",
    "start_compile_workers",
]
