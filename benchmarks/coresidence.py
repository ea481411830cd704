"""Does building the one-graph limit in the same process slow the piecewise decode step? (CUDA only)

    python -m benchmarks.coresidence MODEL BATCH STEPS [AFTER]   # e.g. 16L-whole-cache 8 40 (the suite's sizes)

AFTER, what is built between the two timings (default ``limit``, what ran for the numbers below):
``limit`` (Inductor, ``dynamic=False``, and its graph captured: ``suite_variants.limit_graph``);
``inductor`` (the same compile, run, nothing captured); ``eager-graph`` (the eager step captured
in a graph, nothing compiled); ``limit-no-cudnn`` (the limit built and replayed with cuDNN's SDPA
kept out: is it cuDNN's state?).

Why: ``suite.py`` times every variant of a batch in one process, the limit first (an Inductor
compile of the same model, ``dynamic=False``, and its graph captured), and divides by the limit of
that process. This times the piecewise step with the host running ahead (CUDA events around the
whole call, and around each ``CUDAGraph.replay`` inside it) twice in one process: alone, then
after the limit has been built and replayed. Measured on the H200 at code hash ``95a5198c…``
(16L whole-cache idiom, batch 8, 40 steps): alone the replay took 686 µs and the call 696 µs
(the limit's replay is 680 µs in a process of its own); after the limit was built, 768 µs and
779 µs, and the host's time per call went from 148 to 385 µs. See benchmarks/README.md.
"""

import argparse
import contextlib
import statistics
import sys
import time

import torch

from benchmarks.suite_models import models_for
from benchmarks.suite_variants import compiled_variant, limit_graph
from benchmarks.timing import time_decode, timed
from toys.models import next_tokens, reset_caches

key, batch = sys.argv[1], int(sys.argv[2])
args = argparse.Namespace(prompt=256, steps=int(sys.argv[3]), batches=[batch])
model, _ = models_for(key, args, "cuda")
if hasattr(model, "set_batch"):
    model.set_batch(batch)
step = compiled_variant("piecewise", model)
with torch.inference_mode():
    time_decode(step, model, batch, 256, 8, "cuda")
marks = {"replay": [], "call": [], "step incl. argmax": []}
orig = torch.cuda.CUDAGraph.replay


def replay(self):
    b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    b.record()
    orig(self)
    e.record()
    marks["replay"].append((b, e))


torch.cuda.CUDAGraph.replay = replay


def measure(label):
    host = []
    with torch.inference_mode():
        reset_caches(model)
        logits = step(torch.randint(0, model.cfg.vocab, (batch, 256), device="cuda"), 0)
        torch.cuda.synchronize()
        for r in marks.values():
            r.clear()
        for pos in range(256, 256 + n):
            s0 = torch.cuda.Event(enable_timing=True)
            s0.record()
            ids = next_tokens(logits, batch > 1)
            b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            b.record()
            t = time.perf_counter()
            logits = step(ids, pos)
            host.append(time.perf_counter() - t)
            e.record()
            marks["call"].append((b, e))
            marks["step incl. argmax"].append((s0, e))
        torch.cuda.synchronize()
    for name, m in marks.items():
        ms = [b.elapsed_time(e) * 1e3 for b, e in m[-(n // 2) :]]
        print(
            f"{label} {key} b{batch} pipelined: {name:20s} median {statistics.median(ms):7.1f} us  min {min(ms):7.1f}"
        )
    starts = [b for b, _ in marks["call"][-(n // 2 + 1) :]]
    print(
        "call start to next call start, median us:",
        statistics.median(a.elapsed_time(c) * 1e3 for a, c in zip(starts, starts[1:])),
    )
    print("host us per call median", statistics.median(host[-(n // 2) :]) * 1e6)


n = min(80, int(sys.argv[3]) - 8)
measure("alone")
after = sys.argv[4] if len(sys.argv) > 4 else "limit"


with torch.inference_mode():
    if after == "inductor":
        compiled = torch.compile(model, dynamic=False)
        ids = torch.randint(0, model.cfg.vocab, (batch, 1), device="cuda")
        replay = lambda: compiled(ids, 256)  # noqa: E731
    elif after == "eager-graph":
        replay, _ = limit_graph(model, batch, 256, "cuda", inductor=False)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        pin = (
            sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
            if after == "limit-no-cudnn"
            else contextlib.nullcontext()
        )
        with pin:
            replay, _ = limit_graph(model, batch, 256, "cuda")
    for _ in range(20):
        replay()
    torch.cuda.synchronize()
    ms = [timed(replay, "cuda")[1] * 1e3 for _ in range(30)]
    print(f"{after} replay us", statistics.median(ms))
measure(f"after {after}")
