"""The long fuzz run, for the GPU: ``python -m tests.fuzz --device cuda --out fuzz.json``.

Random models against eager (``runner.py``) with the default capture sizes (up to 512) and batch
sizes up to 600, so sizes above the largest capture size run too; then one model's memory over
10,000 replays at sizes already captured (the graph pool and the allocator must stay flat: nothing
may be kept per call). Writes the totals, and every wrong step's description, as JSON.

``--threads``: a neighbour thread (``toys/neighbour.py``: syncs, allocations, random numbers from
the default generator) runs beside the whole fuzz, so every lazy capture happens next to it; then
two threads call each of ``--concurrent-models`` compiled models at once (``runner.concurrent``).
``dynamic_compile`` / ``graph_breaks`` / ``threads`` say the run covered those.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
import warnings

import torch

from .grammar import WIDTH, FuzzModel, T, random_spec
from .runner import concurrent, fuzz


def memory_growth(device: str, replays: int, seed: int = 7, sizes=(1, 3, 8, 17, 64, 200)) -> dict:
    """Bytes the allocator and the graph pool grew by over ``replays`` calls at captured sizes."""
    import piecewise_backend

    spec = random_spec(seed, max(sizes))
    model = FuzzModel(spec).to(device).eval()
    compiled = torch.compile(model, backend="piecewise")
    rng = random.Random(seed)

    def call(batch: int) -> None:
        x = torch.randn(batch, T, WIDTH, device=device)
        if batch > 1:
            torch._dynamo.mark_dynamic(x, 0)
        compiled(x, rng.randint(0, 15))

    for _ in range(3):  # every size captured, every graph Dynamo needs compiled
        for batch in sizes:
            call(batch)
    torch.cuda.synchronize()
    allocated, pool = torch.cuda.memory_allocated(), piecewise_backend.pool_bytes()
    replayed = piecewise_backend.process_stats()["replays"]
    for _ in range(replays):
        call(rng.choice(sizes))
    torch.cuda.synchronize()
    return {
        "memory_growth_bytes": torch.cuda.memory_allocated() - allocated,
        "pool_growth_bytes": piecewise_backend.pool_bytes() - pool,
        "memory_calls": replays,
        "memory_replays": piecewise_backend.process_stats()["replays"] - replayed,
        "memory_model": str(spec),
    }


def options(parser: argparse.ArgumentParser) -> None:
    """The fuzz run's options (``python -m benchmarks reliability`` adds them to its own)."""
    parser.add_argument("--models", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150, help="steps per model")
    parser.add_argument("--max-batch", type=int, default=600)
    parser.add_argument("--replays", type=int, default=10_000)
    parser.add_argument("--first-seed", type=int, default=1000)
    parser.add_argument("--threads", action="store_true", help="a neighbour thread, then concurrent callers")
    parser.add_argument("--concurrent-models", type=int, default=4)
    parser.add_argument("--concurrent-calls", type=int, default=200, help="per model, over both threads")


def run(args) -> dict:
    """The whole run's totals (and up to 50 wrong steps' descriptions)."""
    # the backend's warnings are expected here (moved weights, ...); torch's "The CUDA Graph is empty"
    # is counted: a capture that recorded no kernel (pieces without device work are not captured)
    empty_graphs = []
    show = warnings.showwarning
    warnings.showwarning = lambda message, *rest, **kw: (
        empty_graphs.append(1) if "CUDA Graph is empty" in str(message) else None
    )
    warnings.simplefilter("always")
    torch._dynamo.config.cache_size_limit = 64  # random positions and sizes: many Dynamo graphs
    start = time.perf_counter()
    seeds = range(args.first_seed, args.first_seed + args.models)
    neighbour = None
    if args.threads:
        from toys.neighbour import Neighbour

        neighbour = Neighbour(args.device)
        neighbour.start()
    with torch.no_grad():
        result = fuzz(seeds, args.steps, args.max_batch, args.device)
        out = {
            **dataclasses.asdict(result),
            "failures": result.failures[:50],
            "max_batch": args.max_batch,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "dynamic_compile": result.dynamic_models > 0,
            "graph_breaks": result.breaking_models > 0,
            "threads": False,
        }
        if neighbour is not None:
            neighbour.finish()
            out.update({"neighbour_iterations": neighbour.iterations, "neighbour_errors": neighbour.errors})
            out.update(
                concurrent(
                    range(args.first_seed, args.first_seed + args.concurrent_models),
                    args.concurrent_calls,
                    args.max_batch,
                    args.device,
                )
            )
            out["threads"] = out["concurrent_calls"] > 0 and neighbour.iterations > 0
            out["wrong"] += out["concurrent_wrong"] + out["concurrent_errors"]
        if args.device == "cuda" and args.replays:
            out.update(memory_growth(args.device, args.replays))
    out["seconds"] = round(time.perf_counter() - start, 1)
    out["empty_graph_warnings"] = len(empty_graphs)
    warnings.showwarning = show
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    options(parser)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = run(args)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "failures"}, indent=1))
    print("\n".join(out["failures"][:10]))


if __name__ == "__main__":
    main()
