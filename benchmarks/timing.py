"""Timing a decode loop of the toy models, the one way the benchmarks and their tests share.

Per step: CUDA events on a GPU (the GPU's view of the step, host overhead included because the next
step cannot start before the host launched it), ``perf_counter`` on the CPU. The median over the
second half of the steps leaves out compile, capture and warm-up.
"""

from __future__ import annotations

import statistics
import subprocess
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


def time_decode(
    step, model, batch: int, prompt: int, steps: int, device: str, tensor_pos: bool = False, mark_batch: bool = True
) -> tuple[float, float]:
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
    return statistics.median(times[steps // 2 :]), first_call


def graph_us(call, calls: int = 50, replays: int = 5) -> float:
    """GPU µs per call of ``call(i)``, ``calls`` of them (``i`` = 0, 1, ...) captured in one CUDA graph:
    launch cost is out of it, the GPU's time is what is left. The best of ``replays`` replays.

    Why ``i``: a caller that hands each call other data (``i`` cycling over copies larger than the
    L2 cache together) times reads from memory, as in a model whose layers each read their own."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, begin.elapsed_time(end) / calls * 1e3)
    del graph
    return round(best, 2)


def copy_bandwidth(gib: float = 1.0) -> float:
    """Device memory bandwidth in bytes/s: a device-to-device copy of ``gib`` GiB, bytes read plus
    bytes written over its time in a graph of copies (the floor a memory-bound kernel is held to)."""
    n = int(gib * (1 << 30)) // 2
    src, dst = torch.empty(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    us = graph_us(lambda i: dst.copy_(src), calls=10)
    return 2 * src.numel() * src.element_size() / (us * 1e-6)


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


def second_half(values: list, steps: int) -> list:
    """The second half of the last ``steps`` values: the decode steps past warm-up (a prefill, when
    there was one, comes before them)."""
    return values[-steps:][steps // 2 :]


class HostTimed:
    """``step`` with the host time of each call kept: the time to *enqueue* it (no sync).

    Why: the CUDA-event step time alone cannot say whether a variant waits on the host or on the
    GPU; with the host time next to it, a variant whose host time is most of its step is
    host-bound, and a slowdown shows on which side it is.
    """

    def __init__(self, step):
        self.step, self.seconds = step, []

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.step(*args)
        self.seconds.append(time.perf_counter() - start)
        return out

    def median_ms(self, steps: int) -> float:
        """Median over :func:`second_half` of the calls, in ms."""
        return statistics.median(second_half(self.seconds, steps)) * 1e3


class GpuTimed:
    """``step`` with CUDA events recorded around each call, and no wait for the GPU until asked.

    Why: ``timing.time_decode`` waits for every step, as a server that reads each token on the host
    does, so the host work before a replay (Dynamo's entry, the backend's checks) lands on the step
    in full. With the host free to run ahead, that work overlaps the previous step's GPU time and
    a step costs what the GPU spends from its start to its end, host time counting only where the
    GPU waits for a launch. On a CPU everything runs as it is called: wall-clock per call.
    """

    def __init__(self, step, device: str):
        self.step, self.device, self.marks = step, device, []
        self._wall = HostTimed(step) if device != "cuda" else None  # a CPU's step ends when its call does

    def __call__(self, *args):
        if self._wall is not None:
            return self._wall(*args)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = self.step(*args)
        end.record()
        self.marks.append((begin, end))
        return out

    def median_ms(self, steps: int) -> float:
        """Waits for the GPU once, then: the median over :func:`second_half` of the calls."""
        if self._wall is not None:
            return self._wall.median_ms(steps)
        synchronize(self.device)
        return statistics.median(begin.elapsed_time(end) for begin, end in second_half(self.marks, steps))


def pipelined_decode_ms(
    step, model, batch: int, prompt: int, steps: int, device: str, tensor_pos: bool = False
) -> float:
    """``time_decode``'s decode (prefill ``prompt`` tokens, ``steps`` greedy steps, KV growing) without
    waiting for the GPU between steps: the median GPU ms per step over the second half."""
    reset_caches(model)

    def where(p, n):
        return torch.arange(p, p + n, device=device) if tensor_pos else p

    timed_step = GpuTimed(step, device)
    logits = step(torch.randint(0, model.cfg.vocab, (batch, prompt), device=device), where(0, prompt))
    for pos in range(prompt, prompt + steps):
        logits = timed_step(next_tokens(logits, batch > 1), where(pos, 1))
    return timed_step.median_ms(steps)


def sm_clock_mhz(device: str) -> int | None:
    """The GPU's SM clock now (``nvidia-smi``), read right after a timed run; None without one.

    Why: a one-graph step is bound by the GPU, and the H200's clock follows its load (345 MHz idle,
    1980 under matmuls on these machines): a variant timed after a stretch of light, host-bound
    work may run at a lower clock. With the clock in the row, that shows instead of being guessed.
    """
    if device != "cuda":
        return None
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    target = f"GPU-{uuid}" if uuid is not None else str(torch.cuda.current_device())
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-i", target],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return int(out.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def replay_ms(replay, steps: int, device: str, pipelined: bool = False) -> tuple[float, float]:
    """Median over the second half of ``steps`` timed calls of ``replay``: (step ms, host ms);
    ``pipelined``: without waiting for the GPU between calls (:class:`GpuTimed`)."""
    replay = HostTimed(replay)
    if pipelined:
        gpu_timed = GpuTimed(replay, device)
        for _ in range(steps):
            gpu_timed()
        return gpu_timed.median_ms(steps), replay.median_ms(steps)
    times = [timed(replay, device)[1] for _ in range(steps)]
    return statistics.median(second_half(times, steps)), replay.median_ms(steps)


# -- the host's speed, read beside every timed run: the H200 machine's CPU runs at two speeds ~3×
# apart, switching every few seconds (host_probe_us). settled_probe probes before a timed run
# (waiting for full speed where allowed); fast_host_times keeps, per row, the rounds timed at full speed.

# a round met the host at full speed when its probe took at most this times the fastest probe
# (the process's, or its rows' own: ``fast_host_times``; the slow spells are ~3×: ``timing.host_probe_us``)
FAST_HOST = 1.3


FASTEST_PROBE = [float("inf")]  # the fastest host probe of this process, µs


def probe() -> float:
    """One host probe (µs), remembered if it is the fastest so far."""
    microseconds = host_probe_us()
    FASTEST_PROBE[0] = min(FASTEST_PROBE[0], microseconds)
    return microseconds


def settled_probe(wait_s: float) -> float:
    """A host probe (µs); with ``wait_s`` > 0, probed again every 50 ms while the host runs slower
    than ``FAST_HOST`` times the fastest probe so far, for up to ``wait_s`` seconds (``--settle``):
    a timed run then starts, where it can, on a host at full speed."""
    deadline = time.perf_counter() + wait_s
    while True:
        microseconds = probe()
        if microseconds <= FAST_HOST * FASTEST_PROBE[0] or time.perf_counter() >= deadline:
            return microseconds
        time.sleep(0.05)


def fast_host_times(rows: list[dict], fastest: float = float("inf")) -> None:
    """Add to each interleaved row the median of the rounds timed while the host ran at full speed:
    ``step_ms_fast_host`` over ``fast_host_rounds`` of its rounds (None when none was).

    "Full speed" is relative to the fastest probe: ``fastest`` (the process's) or the rows' own,
    whichever is less. A round is fast when the probes just before and after it took at most
    ``FAST_HOST`` times that. ``step_ms`` (every round) stays the row's main figure; this one says
    what the backend costs on the host the machine has when it is not slowed, the reading a
    quieter machine would give.
    """
    probes = [p for r in rows if "error" not in r for p in r.get("host_probe_us_rounds") or ()]
    if not probes:
        return
    fastest = min(fastest, *probes)
    for row in rows:
        times = row.get("step_ms_rounds")
        if not times or "error" in row:
            continue
        fast = [t for t, p in zip(times, row["host_probe_us_rounds"]) if p <= FAST_HOST * fastest]
        row["fast_host_rounds"] = len(fast)
        row["step_ms_fast_host"] = round(statistics.median(fast), 4) if fast else None
        row["host_probe_fastest_us"] = round(fastest, 2)
