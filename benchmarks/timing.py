"""Timing a decode loop of the toy models, the one way the benchmarks and their tests share.

Per step: CUDA events on a GPU (the GPU's view of the step, host overhead included because the next
step cannot start before the host launched it), ``perf_counter`` on the CPU. The median over the
second half of the steps leaves out compile, capture and warm-up.
"""

from __future__ import annotations

import statistics
import time

import torch

from piecewise_backend.runtime.devices import synchronize
from toys.models import next_tokens, reset_caches


def timed(fn, device: str):
    """(fn(), milliseconds it took)."""
    if device == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = fn()
        end.record()
        end.synchronize()
        return out, begin.elapsed_time(end)
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1e3


def time_decode(step, model, batch: int, prompt: int, steps: int, device: str, tensor_pos: bool = False,
                mark_batch: bool = True) -> tuple[float, float]:
    """Prefill ``prompt`` random tokens at ``batch``, then ``steps`` greedy decode steps, KV growing.

    Returns (median ms per decode step over the second half, seconds of the first call).
    ``tensor_pos``: the model takes positions as a tensor (``ToyStaticCacheLlama``) instead of an int.
    ``mark_batch``: mark the batch dim dynamic (one graph for every batch size).
    """
    reset_caches(model)

    def where(p, n):
        return torch.arange(p, p + n, device=device) if tensor_pos else p

    ids = torch.randint(0, model.cfg.vocab, (batch, prompt), device=device)
    synchronize(device)
    start = time.perf_counter()
    logits = step(ids, where(0, prompt))
    synchronize(device)
    first_call = time.perf_counter() - start
    pos, times = prompt, []
    for _ in range(steps):
        ids = next_tokens(logits, mark_batch and batch > 1)
        logits, ms = timed(lambda: step(ids, where(pos, 1)), device)
        times.append(ms)
        pos += 1
    return statistics.median(times[steps // 2:]), first_call


def _probe_work() -> int:
    table = {}
    for i in range(200):
        table[i] = (i, i * 2)
    return sum(a + b for a, b in table.values())


def host_probe_us(reps: int = 15) -> float:
    """How fast the host runs Python right now: the median µs of a fixed piece of pure Python.

    Why: the H200 machine's host runs at two speeds ~3× apart, switching every few seconds (in a
    slow spell a decode step's thread CPU time equals its wall time and no other process is busy:
    the CPU itself is slower, not our thread preempted; code hash ``6b12b66c…``). A decode step
    timed in a slow spell measures the machine: even the limit's one ``replay()`` takes 15 µs to
    enqueue instead of 5. Timed next to each run, this says which runs met the slow host.
    """
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        _probe_work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6
