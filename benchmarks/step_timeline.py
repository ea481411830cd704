"""The GPU timeline of 5 decode steps, limit and piecewise, host running ahead (CUDA only).

    python -m benchmarks.step_timeline MODEL BATCH OUT_DIR   # writes OUT_DIR/trace_MODEL_bBATCH.json

Each kernel (and memcpy) of the steps with its start and duration, from ``torch.profiler``
(CUDA activity): which kernels are busy for how long, per step, side by side. The limit is built
first, in this process (what ``suite.py`` does too: see ``coresidence.py``). The profiler
stretches the gaps between a graph's kernels (0.45 µs each in the piecewise graph under it, where
an unprofiled replay is within 3% of the limit's), so read the busy times, not the spans.
"""

import argparse
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.suite_models import models_for
from benchmarks.suite_variants import compiled_variant, limit_graph
from benchmarks.timing import time_decode
from toys.models import next_tokens, reset_caches

key, batch, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
args = argparse.Namespace(prompt=256, steps=200, batches=[batch])
model, _ = models_for(key, args, "cuda")
if hasattr(model, "set_batch"):
    model.set_batch(batch)


def timeline(prof):
    return sorted(
        (
            {"name": e.name[:80], "ts": e.time_range.start, "dur": e.time_range.end - e.time_range.start}
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        ),
        key=lambda r: r["ts"],
    )


with torch.inference_mode():
    replay, _ = limit_graph(model, batch, 256, "cuda")
    for _ in range(20):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            replay()
        torch.cuda.synchronize()
    limit = timeline(prof)
    torch._dynamo.reset()
    step = compiled_variant("piecewise", model)
    time_decode(step, model, batch, 256, 8, "cuda")
    reset_caches(model)
    logits = step(torch.randint(0, model.cfg.vocab, (batch, 256), device="cuda"), 0)
    for pos in range(256, 276):
        logits = step(next_tokens(logits, batch > 1), pos)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for pos in range(276, 281):
            logits = step(next_tokens(logits, batch > 1), pos)
        torch.cuda.synchronize()
    piecewise = timeline(prof)
json.dump({"limit": limit, "piecewise": piecewise}, open(os.path.join(out_dir, f"trace_{key}_b{batch}.json"), "w"))
for name, tl in (("limit", limit), ("piecewise", piecewise)):
    span = (tl[-1]["ts"] + tl[-1]["dur"] - tl[0]["ts"]) / 5
    busy = sum(r["dur"] for r in tl) / 5
    print(f"{key} b{batch} {name}: {len(tl) / 5:.0f} kernels/step, span {span:.1f} us/step, busy {busy:.1f} us/step")
