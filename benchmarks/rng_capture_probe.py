"""Can a capture leave torch's default CUDA generator alone? A probe for torch 2.11 (GPU only).

    python -m benchmarks.rng_capture_probe --out probe.json [--captures 200] [--modes swap raw]

torch 2.11's ``CUDAGraph.capture_begin`` registers the state the default CUDA generator holds and
marks it capturing; another thread's random op on a marked state raises "Offset increment outside
graph capture encountered unexpectedly". The backend points the generator at a private state for
``capture_begin`` (``runtime/devices.py``, ``GeneratorAside``), which leaves a window: the call
releases the GIL, and a draw on another thread meanwhile meets the private, marked state.

Modes, each beside a thread drawing from the default generator the whole time:

* ``swap``: ``torch.cuda.CUDAGraph`` with the generator set aside, as the backend captures today;
* ``raw``: the backend's ``RawGraph`` (``piecewise_backend/runtime/_torch_internals.py``): the CUDA runtime's
  own ``cudaStreamBeginCapture``/``EndCapture``/``GraphInstantiateWithFlags`` through ``ctypes``,
  allocations routed to the graph pool by torch: no generator is registered, so nothing is marked.
  Only for code that draws no random numbers (a draw inside would find no registered state).

Each capture is a small MLP at a new batch size, replayed and compared with eager. Reports per mode
the neighbour's errors and iterations, and wrong replays. torch 2.12+ registers a generator on its first use in a capture (pytorch#176753): there,
``swap`` has no window either.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch


class RawGraphs:
    """Captures as the backend captures a piece that draws nothing on torch < 2.12: ``RawGraph``
    (``piecewise_backend/runtime/_torch_internals.py``), in one pool, on one side stream."""

    def __init__(self, device: int):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.keeper = torch.cuda.CUDAGraph()  # holds the pool open, as DeviceGraphs' keeper does
        self.stream = torch.cuda.Stream(device=device)
        from piecewise_backend.runtime.devices import GeneratorAside

        with torch.cuda.stream(self.stream):  # before the neighbour starts: its begin marks nothing it uses
            GeneratorAside(device).capture_begin(self.keeper, self.pool)
            torch.zeros(1, device="cuda").add_(1)
            self.keeper.capture_end()
        self.graphs: list = []

    def capture(self, fn):
        from piecewise_backend.runtime._torch_internals import RawGraph

        side = self.stream
        side.wait_stream(torch.cuda.current_stream())
        graph = RawGraph(self.device, self.pool)
        with torch.cuda.stream(side):
            out = graph.capture(fn)
        torch.cuda.current_stream().wait_stream(side)
        self.graphs.append(graph)
        return graph, out, None

    def replay(self, graph) -> None:
        graph.replay()

    def release(self) -> None:
        torch.cuda.synchronize()
        self.graphs.clear()


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
    wrong, start = 0, time.perf_counter()
    try:
        for size in range(1, captures + 1):
            x = torch.randn(size, 256, device="cuda")

            def step(x=x):
                return torch.relu(x @ w1) @ w2

            step()  # warm-up: cuBLAS picks its kernels outside the capture
            handle, out, _ = graphs.capture(step)
            x.normal_()  # new values in the captured input: the replay must see them
            graphs.replay(handle)
            torch.cuda.synchronize()
            wrong += not torch.allclose(out, step(), rtol=1e-3, atol=1e-3)
    finally:
        neighbour.stop.set()
        neighbour.join()
        graphs.release()
    return {
        "mode": mode,
        "captures": captures,
        "wrong_replays": wrong,
        "seconds": round(time.perf_counter() - start, 2),
        "neighbour_iterations": neighbour.iterations,
        "neighbour_errors": neighbour.errors,
        "neighbour_messages": sorted(neighbour.messages),
    }


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
