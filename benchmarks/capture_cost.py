"""What capture costs on the GPU: time for one new size, by hand, all default sizes; pool memory.

    python -m benchmarks.capture_cost --out capture.json [--layers 16]

Run in a fresh process: the graph pool only grows, so "the largest size alone" must be measured
before anything else is captured. Part A captures size 512 up front (the pool then holds the
largest size alone), then every other size of the default scheme (67 in all). Part B compiles
again with lazy capture and times one new size across all pieces, then captures the very same
pieces at the same size by hand with ``torch.cuda.graph`` in a shared pool (the baseline).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import piecewise_backend
from benchmarks.suite_models import toy_model

POS = 8


def decode_graph():
    """The graph that served the calls, dynamic in the batch (fails loudly, showing every graph)."""
    graphs = piecewise_backend.compiled_graphs()
    served = [g for g in graphs if g.pad_position is not None and g.stats.calls]
    if not served:
        raise RuntimeError(
            "no graph dynamic in the batch served a call:\n"
            + "\n\n".join(
                f"graph {g.serial} (pad position {g.pad_position}, key symbols {g.key_symbols}):\n{g.stats.summary()}"
                for g in graphs
            )
        )
    return max(served, key=lambda g: g.stats.calls)


def call(compiled, batch: int, pos: int):
    ids = torch.randint(0, 32000, (batch, 1), device="cuda")
    torch._dynamo.mark_dynamic(ids, 0)
    out = compiled(ids, pos)
    torch.cuda.synchronize()
    return out


def all_sizes_up_front(model, max_size: int) -> dict:
    torch._dynamo.reset()
    compiled = torch.compile(
        model,
        backend="piecewise",
        options={"max_capture_size": max_size, "eager_capture_sizes": [max_size], "lazy_capture": False},
    )
    call(compiled, 2, POS)  # captures max_size before its first output, then replays it padded
    graph = decode_graph()
    assert graph.stats.events, graph.stats.summary()
    largest = graph.stats.events[0]
    assert largest.key == (max_size,) and largest.how == "up-front", graph.stats.table()
    largest_bytes = piecewise_backend.pool_bytes()
    start = time.perf_counter()
    graph.capture("all")
    torch.cuda.synchronize()
    rest_s = time.perf_counter() - start
    all_bytes = piecewise_backend.pool_bytes()
    # the graphs answer right: a padded size against eager
    ids = torch.randint(0, 32000, (5, 1), device="cuda")
    diff = (compiled(ids, POS + 1).float() - model(ids, POS + 1).float()).abs().max().item()
    return {
        "sizes": len(graph.captured),
        "largest_size": max_size,
        "largest_size_s": round(largest.seconds, 3),
        "all_default_sizes_s": round(largest.seconds + rest_s, 3),
        "largest_size_bytes": largest_bytes,
        "all_default_sizes_bytes": all_bytes,
        "padded_batch5_max_abs_diff_vs_eager": diff,
        "summary": graph.stats.summary(),
    }


def _spy_first_call_args(runners) -> dict:
    """Record the args each runner's compiled piece is first called with: in a capturing call,
    the warm-up run's, i.e. the very buffers and (padded) scalars the graph is captured with."""
    seen: dict = {}
    for runner in runners:

        def spy(*args, _fn=runner.fn, _name=runner.name):
            seen.setdefault(_name, args)
            return _fn(*args)

        spy.__wrapped__ = runner.fn
        runner.fn = spy
    return seen


def one_size(model) -> dict:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="piecewise")
    call(compiled, 2, POS)  # a graph for POS (Dynamo specialises the first int it sees)
    call(compiled, 2, POS + 1)  # the decode graph, dynamic in batch and position: captures size 2
    call(compiled, 2, POS + 2)  # replay
    graph = decode_graph()
    capture_args = _spy_first_call_args(graph.runners.values())
    call(compiled, 3, POS + 3)  # a new size: pads to 4, captured across all pieces
    for runner in graph.runners.values():
        runner.fn = runner.fn.__wrapped__  # the spies off
    event = graph.stats.events[-1]
    assert event.key == (4,), graph.stats.table()
    runners = [r for r in graph.runners.values() if (4,) in r.captures]

    # The same pieces, same inputs, captured by hand: warm-up run + torch.cuda.graph, one pool.
    pool = torch.cuda.graph_pool_handle()
    keep = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for runner in runners:
        args = capture_args[runner.name]
        runner.fn(*args)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            out = runner.fn(*args)
        keep.append((g, out))
    torch.cuda.synchronize()
    by_hand = time.perf_counter() - start
    return {"one_size_s": round(event.seconds, 4), "one_size_by_hand_s": round(by_hand, 4), "pieces": len(runners)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--max-size", type=int, default=512)
    args = parser.parse_args()
    model = toy_model("16L", "cuda", layers=args.layers, max_batch=args.max_size, max_seq=64)
    cfg = model.cfg
    with torch.inference_mode():  # torch's SDPA defaults, as a user's
        memory = all_sizes_up_front(model, args.max_size)
        one = one_size(model)
    result = {
        "capture": {
            "model": f"llama-{cfg.layers}L-{cfg.hidden}",
            "one_size_s": one["one_size_s"],
            "one_size_by_hand_s": one["one_size_by_hand_s"],
            "one_size_vs_by_hand": round(one["one_size_s"] / one["one_size_by_hand_s"], 3),
            "one_size_pieces": one["pieces"],
            "all_default_sizes_s": memory["all_default_sizes_s"],
            "all_default_sizes": memory["sizes"],
            "largest_size_s": memory["largest_size_s"],
        },
        "memory": {
            "largest_size": memory["largest_size"],
            "largest_size_bytes": memory["largest_size_bytes"],
            "all_default_sizes_bytes": memory["all_default_sizes_bytes"],
            "all_vs_largest": round(memory["all_default_sizes_bytes"] / memory["largest_size_bytes"], 3),
            "padded_batch5_max_abs_diff_vs_eager": memory["padded_batch5_max_abs_diff_vs_eager"],
        },
    }
    print(memory["summary"])
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
