"""The GPU kernels of a decode step, piecewise against the one-graph limit: where the graph's extra
GPU time (the ``"decode"`` rows' pipelined excess, 11–12% at batch 8) goes.

    python -m benchmarks.graph_kernels [--models 16L-whole-cache 16L] [--batches 1 8] [--steps 20] [--top 12]

Per model and batch: torch.profiler (CUDA activity only) over ``--steps`` decode steps of each of
``limit`` and ``piecewise`` (suite.py's variants, torch's defaults), kernels grouped by name with
their launches and device µs *per step*, the biggest first, then each side's totals. Kernels that
run outside the captured graph (the next token ids, the step scalars' ``fill_``, the output's clone)
count on piecewise's side: a pipelined step pays for them too, but for the next token ids' (argmax),
which the suite's timing leaves out.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.suite_models import models_for, next_ids
from benchmarks.suite_variants import compiled_variant, limit_graph
from benchmarks.timing import time_decode
from toys.models import reset_caches


def kernels_per_step(run, steps: int) -> dict[str, list]:
    """name -> [launches, device µs] per step, over what ``run()`` launches (``steps`` steps)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    out: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0])
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:  # torch before the device_* names
            us = event.self_cuda_time_total
        if us > 0:
            out[event.key][0] += event.count / steps
            out[event.key][1] += us / steps
    return dict(out)


def compare(key: str, batch: int, args) -> dict:
    sized = argparse.Namespace(prompt=args.prompt, steps=2 * args.steps + 8, batches=[batch])  # warm-up + 2 runs
    model, _ = models_for(key, sized, "cuda")
    if hasattr(model, "set_batch"):
        model.set_batch(batch)
    torch._dynamo.reset()
    replay, _ = limit_graph(model, batch, args.prompt, "cuda")
    replay()
    limit = kernels_per_step(lambda: [replay() for _ in range(args.steps)], args.steps)
    torch._dynamo.reset()
    step = compiled_variant("piecewise", model)
    time_decode(step, model, batch, args.prompt, 4, "cuda")  # compile, capture
    reset_caches(model)
    logits = step(torch.randint(0, model.cfg.vocab, (batch, args.prompt), device="cuda"), 0)
    state = {"logits": logits, "pos": args.prompt}

    def decode() -> None:
        for _ in range(args.steps):
            state["logits"] = step(next_ids(state["logits"]), state["pos"])
            state["pos"] += 1

    decode()  # the first steps after a prefill: captures, if any are left
    return {"model": key, "batch": batch, "limit": limit, "piecewise": kernels_per_step(decode, args.steps)}


def report(result: dict, top: int) -> None:
    limit, mine = result["limit"], result["piecewise"]
    names = sorted(set(limit) | set(mine), key=lambda n: -max(limit.get(n, [0, 0])[1], mine.get(n, [0, 0])[1]))
    print(f"\n{result['model']} b{result['batch']}: launches and device µs per step")
    print(f"{'kernel':70} {'limit':>16} {'piecewise':>16}")
    for name in names[:top]:
        a, b = limit.get(name, [0, 0]), mine.get(name, [0, 0])
        print(f"{name[:70]:70} {a[0]:5.1f} {a[1]:9.1f} µs {b[0]:5.1f} {b[1]:9.1f} µs")
    for side, table in (("limit", limit), ("piecewise", mine)):
        print(f"{side}: {sum(v[0] for v in table.values()):.1f} launches, {sum(v[1] for v in table.values()):.1f} µs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["16L-whole-cache", "16L"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", help="write the per-kernel tables here")
    args = parser.parse_args()
    results = []
    for key in args.models:
        for batch in args.batches:
            results.append(compare(key, batch, args))
            report(results[-1], args.top)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
