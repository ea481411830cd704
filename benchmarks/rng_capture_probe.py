"""Can a capture leave torch's default CUDA generator alone? A probe for torch 2.11 (GPU only).

    python benchmarks/rng_capture_probe.py --out probe.json [--captures 200] [--modes swap raw]

torch 2.11's ``CUDAGraph.capture_begin`` registers the state the default CUDA generator holds and
marks it capturing; another thread's random op on a marked state raises "Offset increment outside
graph capture encountered unexpectedly". The backend points the generator at a private state for
``capture_begin`` (``runtime/devices.py``, ``GeneratorAside``), which leaves a window: the call
releases the GIL, and a draw on another thread meanwhile meets the private, marked state.

Modes, each beside a thread drawing from the default generator the whole time:

* ``swap``: ``torch.cuda.CUDAGraph`` with the generator set aside, as the backend captures today;
* ``raw``: the CUDA runtime's own ``cudaStreamBeginCapture``/``EndCapture``/``GraphInstantiate``
  (through ``ctypes``), allocations routed to a graph pool by torch's
  ``_cuda_beginAllocateCurrentThreadToPool``: no generator is registered, so nothing is marked.
  Only for code that draws no random numbers (a draw inside would find no registered state).

Each capture is a small MLP at a new batch size, replayed and compared with eager. Reports per mode
the neighbour's errors and iterations, wrong replays, and the nodes of each raw graph (0: an empty
graph). torch 2.12+ registers a generator on its first use in a capture (pytorch#176753): there,
``swap`` has no window either.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import threading
import time

import torch

import _checkout  # noqa: F401  (the repository root on sys.path)

THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal


def load_cudart() -> ctypes.CDLL:
    """The CUDA runtime torch was built against: its pip package's library, else the loader's."""
    major = (torch.version.cuda or "12").split(".")[0]
    site = os.path.dirname(os.path.dirname(torch.__file__))
    candidates = sorted(glob.glob(os.path.join(site, "nvidia", "**", f"libcudart.so.{major}*"), recursive=True))
    for name in (*candidates, f"libcudart.so.{major}", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError(f"no libcudart.so.{major} found (looked in {site}/nvidia and the loader's path)")


class RawGraphs:
    """Capture and replay through the CUDA runtime, torch's allocator routed to one pool."""

    def __init__(self, device: int):
        self.rt = load_cudart()
        for name in ("cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaGraphInstantiate", "cudaGraphLaunch",
                     "cudaGraphGetNodes", "cudaGraphExecDestroy", "cudaGraphDestroy"):
            getattr(self.rt, name).restype = ctypes.c_int
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)
        self.graphs: list = []

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} returned cudaError {code}")

    def capture(self, fn):
        """``fn()`` captured; returns (exec handle, its output, the graph's node count)."""
        side = self.stream
        side.wait_stream(torch.cuda.current_stream())
        graph = ctypes.c_void_p()
        torch._C._cuda_clearCublasWorkspaces()
        torch._C._cuda_beginAllocateCurrentThreadToPool(self.device, self.pool)
        try:
            with torch.cuda.stream(side):
                handle = ctypes.c_void_p(side.cuda_stream)
                self._check(self.rt.cudaStreamBeginCapture(handle, THREAD_LOCAL), "cudaStreamBeginCapture")
                try:
                    out = fn()
                finally:
                    self._check(self.rt.cudaStreamEndCapture(handle, ctypes.byref(graph)), "cudaStreamEndCapture")
        finally:
            torch._C._cuda_endAllocateToPool(self.device, self.pool)
        torch.cuda.current_stream().wait_stream(side)
        exe = ctypes.c_void_p()
        self._check(self.rt.cudaGraphInstantiate(ctypes.byref(exe), graph, ctypes.c_ulonglong(0)), "cudaGraphInstantiate")
        nodes = ctypes.c_size_t(0)
        self._check(self.rt.cudaGraphGetNodes(graph, None, ctypes.byref(nodes)), "cudaGraphGetNodes")
        self.graphs.append((exe, graph))
        return exe, out, nodes.value

    def replay(self, exe) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._check(self.rt.cudaGraphLaunch(exe, stream), "cudaGraphLaunch")

    def release(self) -> None:
        torch.cuda.synchronize(self.device)
        for exe, graph in self.graphs:
            self.rt.cudaGraphExecDestroy(exe)
            self.rt.cudaGraphDestroy(graph)
        self.graphs.clear()
        torch._C._cuda_releasePool(self.device, self.pool)


class SwapGraphs:
    """``torch.cuda.CUDAGraph`` begun as the backend begins it: ``GeneratorAside`` (``runtime/devices.py``)."""

    def __init__(self, device: int):
        from piecewise_backend.runtime.devices import GeneratorAside

        self.aside = GeneratorAside(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)
        self.graphs: list = []

    def capture(self, fn):
        side = self.stream
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            self.aside.capture_begin(graph, self.pool)
            try:
                out = fn()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        self.graphs.append(graph)
        return graph, out, None

    def replay(self, graph) -> None:
        graph.replay()

    def release(self) -> None:
        torch.cuda.synchronize()
        self.graphs.clear()


class Neighbour(threading.Thread):
    """Draws from the default CUDA generator until told to stop; counts what raises."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop, self.iterations, self.errors, self.messages = threading.Event(), 0, 0, set()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                torch.rand(1 << 12, device="cuda").sum().item()
            except RuntimeError as exc:
                self.errors += 1
                self.messages.add(str(exc).splitlines()[0][:200])
            self.iterations += 1


def probe(mode: str, captures: int) -> dict:
    device = torch.cuda.current_device()
    graphs = RawGraphs(device) if mode == "raw" else SwapGraphs(device)
    w1, w2 = torch.randn(256, 1024, device="cuda"), torch.randn(1024, 256, device="cuda")
    neighbour = Neighbour()
    neighbour.start()
    wrong, nodes, start = 0, [], time.perf_counter()
    try:
        for size in range(1, captures + 1):
            x = torch.randn(size, 256, device="cuda")

            def step(x=x):
                return torch.relu(x @ w1) @ w2

            step()  # warm-up: cuBLAS picks its kernels outside the capture
            handle, out, count = graphs.capture(step)
            if count is not None:
                nodes.append(count)
            x.normal_()  # new values in the captured input: the replay must see them
            graphs.replay(handle)
            torch.cuda.synchronize()
            wrong += not torch.allclose(out, step(), rtol=1e-3, atol=1e-3)
    finally:
        neighbour.stop.set()
        neighbour.join()
        graphs.release()
    return {"mode": mode, "captures": captures, "wrong_replays": wrong, "seconds": round(time.perf_counter() - start, 2),
            "neighbour_iterations": neighbour.iterations, "neighbour_errors": neighbour.errors,
            "neighbour_messages": sorted(neighbour.messages), "empty_graphs": sum(n == 0 for n in nodes),
            "nodes_min_max": [min(nodes), max(nodes)] if nodes else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--captures", type=int, default=200)
    parser.add_argument("--modes", nargs="+", default=["swap", "raw"])
    args = parser.parse_args()
    rows = []
    for mode in args.modes:
        try:
            rows.append(probe(mode, args.captures))
        except Exception as exc:  # a mode that cannot run here is a row too
            rows.append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"[:500]})
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "probe": rows}, f, indent=1)


if __name__ == "__main__":
    main()
