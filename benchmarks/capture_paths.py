"""Does the way a graph is captured change its replay time? (CUDA only)

    python -m benchmarks.capture_paths BATCH

The limit's Inductor-compiled decode step (16L whole-cache idiom) captured five ways in one process
and each replayed alone: ``torch.cuda.graph``; the backend's own capture (``DeviceGraphs.record``:
a shared pool, ``capture_error_mode="thread_local"``, cuBLAS workspaces from the pool); and each
of those three differences alone. On the H200 at code hash ``95a5198c…``, batch 8: 680.3–682.6 µs
per replay, all five within 0.4%: the capture path does not make a graph slower.
"""

import argparse
import statistics
import sys

import torch

from benchmarks.suite_models import models_for
from benchmarks.timing import timed
from piecewise_backend import _torch_internals
from piecewise_backend.runtime.devices import device_graphs
from toys.models import reset_caches

batch = int(sys.argv[1])
args = argparse.Namespace(prompt=256, steps=40, batches=[batch])
model, _ = models_for("16L-whole-cache", args, "cuda")
model.set_batch(batch)
compiled = torch.compile(model, dynamic=False)
ids = torch.randint(0, model.cfg.vocab, (batch, 1), device="cuda")
with torch.inference_mode():
    reset_caches(model)
    for _ in range(3):
        compiled(ids, 256)
    torch.cuda.synchronize()
    fn = lambda: compiled(ids, 256)
    graphs = {}
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    graphs["A torch.cuda.graph"] = g
    graphs["B ours (DeviceGraphs.record)"], _ = device_graphs(torch.device("cuda")).record(fn, warmup_runs=1)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        fn()
    graphs["C thread_local"] = g
    g = torch.cuda.CUDAGraph()
    _torch_internals.free_cublas_workspaces()
    with torch.cuda.graph(g):
        fn()
    graphs["D after free_cublas_workspaces"] = g
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=device_graphs(torch.device("cuda")).pool):
        fn()
    graphs["E our pool"] = g
    for rnd in range(2):
        for name, g in graphs.items():
            for _ in range(10):
                g.replay()
            times = [timed(g.replay, "cuda")[1] for _ in range(30)]
            print(f"b{batch} round {rnd} {name:36s} {statistics.median(times) * 1e3:7.1f} us")
