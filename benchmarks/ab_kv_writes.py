"""A/B, interleaved step by step: KV-cache writes inside the graphs (default) vs eager between them.

    python -m benchmarks.ab_kv_writes [--model 16L --batches 1 8 32 --steps 60] [--json out.json]

Two copies of one model (same weights), compiled with ``capture_kv_writes`` on and off, decode in
lockstep: step A, step B, step A, ... so that host noise hits both alike. Per variant and batch:
median step time (CUDA events, synchronised per step as in suite.py), median host time to enqueue a
step, and the GPU's kernel time per step (torch.profiler over a few steps), which separates host-
bound from device-bound.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import piecewise_backend
from benchmarks.suite_models import MODELS, next_ids, toy_model
from toys.models import reset_caches

VARIANTS = {"kv-in-graphs": {}, "kv-eager": {"capture_kv_writes": False}}


def _step(state: dict) -> None:
    state["logits"] = state["step"](next_ids(state["logits"]), state["pos"])
    state["pos"] += 1


def _timed_step(state: dict) -> tuple[float, float]:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    begin.record()
    _step(state)
    enqueue = time.perf_counter() - start
    end.record()
    end.synchronize()
    return begin.elapsed_time(end), enqueue * 1e6


def _gpu_us_per_step(state: dict, steps: int) -> float:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _step(state)
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="16L", choices=sorted(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json")
    args = parser.parse_args()
    base = toy_model(args.model, "cuda", max_batch=max(args.batches), max_seq=args.prompt + 2 * args.steps + 16)
    cfg = base.cfg
    models = {name: copy.deepcopy(base) for name in VARIANTS}
    steps = {name: torch.compile(models[name], backend="piecewise", options=opts) for name, opts in VARIANTS.items()}
    rows = []
    with torch.inference_mode():  # torch's SDPA defaults, as a user's
        for batch in args.batches:
            states = {}
            for name in VARIANTS:
                reset_caches(models[name])
                ids = torch.randint(0, cfg.vocab, (batch, args.prompt), device="cuda")
                states[name] = {"step": steps[name], "logits": steps[name](ids, 0), "pos": args.prompt}
            times = {name: [] for name in VARIANTS}
            for i in range(args.steps):
                order = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))
                for name in order:
                    times[name].append(_timed_step(states[name]))
            for name in VARIANTS:
                tail = times[name][args.steps // 3 :]
                row = {
                    "model": args.model,
                    "batch": batch,
                    "variant": name,
                    "step_ms": round(statistics.median(t[0] for t in tail), 4),
                    "enqueue_us": round(statistics.median(t[1] for t in tail), 1),
                    "gpu_us_per_step": round(_gpu_us_per_step(states[name], 5), 1),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    graphs = piecewise_backend.compiled_graphs()
    check = {
        "graphs_with_kv_in_graphs": sum(g.step_scalars is not None for g in graphs),
        "graphs_with_kv_eager": sum(g.step_scalars is None for g in graphs),
    }
    print(json.dumps(check))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, **check}, f, indent=1)


if __name__ == "__main__":
    main()
