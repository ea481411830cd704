"""The benchmark suite: decode step time of toy Llamas under every backend a user would pick.

    python benchmarks/suite.py --out suite.json [--models 16L 28L --batches 1 8 32 --steps 40]

Variants, side by side in one process (the machines are noisy; read ratios):

* ``eager``: the model as written.
* ``inductor``: ``torch.compile`` default.
* ``reduce-overhead``: Inductor + cudagraph trees, ``graph_partition`` off.
* ``reduce-overhead+partition``: the same with Inductor's ``graph_partition`` on.
* ``piecewise``: this backend, default options: since the switch that followed code hash
  ``3c7e8e89…``'s run, with ``graph_attention`` (decode attention read from the cache by a
  graph-safe kernel, the whole step one graph); results measured before the switch name this
  ``piecewise-graph-attention``.
* ``piecewise-eager-attention``: ``piecewise`` with ``graph_attention=False``: decode attention runs
  eagerly (SDPA) between the captured pieces; the default before, named ``piecewise`` in results
  measured before the switch.
* ``piecewise-kv-eager``: ``piecewise-eager-attention`` with ``capture_kv_writes=False`` too (the
  KV-cache writes run eagerly between replays, as before ``rewrite/kv_writes.py``): what moving them
  into the graphs gives.
* ``piecewise-skip-guards``: ``piecewise`` decoding under
  ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: Dynamo checks only the guards that
  tell its cached graphs apart (a server's choice once warmed up; the backend cannot make it).
* ``piecewise-no-clone``: ``piecewise`` with ``clone_outputs=False``: the logits stay in the graph
  pool until the next call (the step reads them first), no copy per step.
* ``piecewise-fast-call``: ``piecewise-no-clone`` decoding under ``skip_guard_eval_unsafe``: every
  per-call saving a user can choose at once.
* ``piecewise-full-skip-guards``: ``piecewise-full`` decoding the same way: how much of full mode's
  excess over ``limit`` is Dynamo's guard evaluation.
* ``piecewise-full``: this backend, ``mode="full"`` (with ``graph_attention``), on the model
  itself: the decode step is one graph, so this is the same model and work as ``limit``.
* ``piecewise-full-static``: ``mode="full"`` on the graph-safe twin of the model
  (:class:`ToyStaticCacheLlama`, same weights: tensor positions, masked attention over the cache);
  named ``piecewise-full`` in results measured before the rename.
* ``limit``: the Inductor-compiled step at one fixed shape (batch, position) captured whole in one
  ``torch.cuda.graph`` and replayed: no host work at all; the floor for any backend.
* ``dynamo-floor``: ``torch.compile(model)`` with a backend that does nothing but replay ``limit``'s
  graph: Dynamo's entry (guards, gathering the ~150 parameters it passes as inputs) plus one replay,
  the floor for *any* ``torch.compile`` backend. Timing only: its outputs are the limit's, whatever
  the inputs. ``piecewise`` minus this is what the backend itself adds.
* ``limit-full``: the same for the graph-safe twin, the floor for ``piecewise-full-static`` (its
  masked attention over the whole static cache is a different, slower kernel than ``limit``'s).

Decode: after a warm-up (compile, a prefill and 4 steps), prefill ``--prompt`` tokens, then
``--steps`` steps with the KV length growing each step; CUDA events; median over the second half
(``first_call_s``: the warm-up's first call, compile included; ``host_ms``: the same median of the
time each step took to *enqueue*, without waiting for the GPU; ``sm_clock_mhz``: the GPU's clock
read right after). ``--rounds N`` (N > 1): per batch, every variant is
compiled and warmed up first, then timed in turn N times (``step_ms``: the median of the rounds),
so a slow spell of the machine hits all variants alike.

The host's speed. The H200 machine's CPU runs at two speeds ~3× apart, switching every few seconds
(``timing.host_probe_us``). Each timed run has a host probe just before and after it
(``host_probe_us_rounds``: the slower of the two); ``step_ms_fast_host`` is the median of the rounds
whose probe was within ``FAST_HOST`` of the fastest, and ``vs_limit_fast_host`` its ratio. ``--pause S``
puts S seconds between rounds; ``--settle S`` lets a timed run wait up to S seconds for the host
to be at full speed (after S seconds of probing first, to learn that speed).

Two views of a step. ``step_ms`` waits for each step before starting the next (a server that reads
every token on the host before the next step), so host work before a replay adds to the step.
``pipelined_ms`` lets the host run ahead (a server that samples on the GPU and reads tokens later):
CUDA events around each step and one wait at the end, so a step costs what the GPU spends on it,
host time counting only where it leaves the GPU waiting. Every variant is timed both ways in the
same process; the pipelined runs come after all the waiting ones (per batch, after the last round),
so they do not change what the waiting runs meet. Reduce-overhead's pipelined runs therefore
replay KV lengths it has already recorded; its waiting runs meet new ones in round 1. A variant that fails is a row with its
error, never a skip.

SDPA runs with torch's defaults, as a user's does (rows say ``"sdpa": "torch default"``). A variant
named with the suffix ``+pinned-sdpa`` (``piecewise+pinned-sdpa``, ``limit+pinned-sdpa``, ...) is the
same variant compiled and timed under ``sdpa_kernel([FLASH, EFFICIENT])``, as every row was before
the backend chose the eager attention's kernels itself (``eager_sdpa_backends``): the two side by side
show what a user's defaults cost. Startup (``--startup``): time from ``torch.compile`` to first output in fresh processes, cold
(empty Inductor cache) and warm (second process, same cache), for ``inductor`` and ``piecewise``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

import _checkout  # noqa: F401  (the checkout's toys/ on sys.path)
import piecewise_backend
from piecewise_backend.runtime.devices import synchronize
from timing import host_probe_us, time_decode, timed
from toys.idioms import WholeCacheLlama
from toys.models import BENCHMARK_SIZES, ToyConfig, ToyLlama, ToyStaticCacheLlama, init_weights_, \
    next_tokens, reset_caches, sdpa_backends
from plot import PINNED, SAME_PROCESS_LIMIT, base_variant

MODELS = {
    **BENCHMARK_SIZES,
    "tiny": dict(vocab=256, hidden=64, layers=2, heads=4, intermediate=128),  # CPU smoke runs
}
# the same sizes, written in an idiom other than the toys' own (``toys/idioms.py``): key -> (size, class)
IDIOMS = {f"{size}-whole-cache": (size, WholeCacheLlama) for size in ("16L", "28L", "tiny")}
BASE_VARIANTS = ("eager", "inductor", "reduce-overhead", "reduce-overhead+partition", "piecewise",
                 "piecewise-kv-eager", "piecewise-eager-attention", "piecewise-skip-guards", "piecewise-no-clone",
                 "piecewise-fast-call", "piecewise-full",
                 "piecewise-full-skip-guards", "piecewise-full-static", "limit", "limit-full", "dynamo-floor")
VARIANTS = BASE_VARIANTS + tuple(v + PINNED for v in BASE_VARIANTS)


def sdpa_setting(variant: str, device: str):
    """The SDPA setting a variant runs under: torch's defaults, unless its name says pinned."""
    return sdpa_backends(device) if variant.endswith(PINNED) else contextlib.nullcontext()
# variant -> the variant it compiles as, decoded under skip_guard_eval_unsafe (same backend and
# options: where that variant is in the same process and compiled first, Dynamo serves its cache
# entries and this one compiles nothing of its own)
SKIP_GUARDS = {"piecewise-skip-guards": "piecewise", "piecewise-full-skip-guards": "piecewise-full",
               "piecewise-fast-call": "piecewise-no-clone"}


def toy_model(key: str, device: str, model_cls=ToyLlama, **sizes):
    """``model_cls`` at ``MODELS[key]`` (``sizes`` override or add config fields), with the
    deterministic weights every benchmark compares on: bf16 on a GPU, fp32 on a CPU."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return init_weights_(model_cls(ToyConfig(**{**MODELS[key], **sizes}))).to(device=device, dtype=dtype).eval()


def next_ids(logits: torch.Tensor) -> torch.Tensor:
    """Greedy next tokens, their batch dim marked dynamic (one decode graph for every batch size)."""
    return next_tokens(logits, mark_batch_dynamic=True)


def model_name(model) -> str:
    idiom = getattr(model, "idiom", None)
    return f"llama-{model.cfg.layers}L-{model.cfg.hidden}" + (f"-{idiom}" if idiom else "")


def limit_graph(model, batch: int, prompt: int, device: str, tensor_pos: bool = False, inductor: bool = True):
    """The whole Inductor-compiled decode step at one shape and position, captured in one graph:
    (``replay()`` returning the graph's logits, seconds to compile and warm up). ``inductor=False``:
    the eager step captured instead (``coresidence.py``).

    ``replay.inputs`` holds the graph's inputs: a CUDA graph keeps only their addresses. Before it
    did, the token ids were freed when this function returned, later allocations reused their memory,
    and the replays read whatever lay there: at batch 8, ids out of the vocabulary and a device-side
    assert in the embedding, next to reduce-overhead's models on the H200.
    """
    if device != "cuda":
        raise RuntimeError("the limit is a CUDA graph: needs a GPU")
    compiled = torch.compile(model, dynamic=False) if inductor else model
    reset_caches(model)
    ids = torch.randint(0, model.cfg.vocab, (batch, 1), device=device)
    pos = torch.tensor([prompt], device=device) if tensor_pos else prompt
    start = time.perf_counter()
    for _ in range(3):  # compile and warm up at the fixed shape
        compiled(ids, pos)
    torch.cuda.synchronize()
    first_call = time.perf_counter() - start
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = compiled(ids, pos)

    def replay():
        graph.replay()
        return logits

    replay.inputs = (ids, pos)
    return replay, first_call


def floor_backend(replay):
    """A ``torch.compile`` backend whose every graph is ``replay()`` (the limit's graph): what a
    backend costs when it adds nothing to Dynamo's entry (``dynamo-floor``; timing only)."""

    def backend(gm, example_inputs):
        def run(*args):
            return (replay(),)
        return run
    return backend


def second_half(values: list, steps: int) -> list:
    """The second half of the last ``steps`` values: the decode steps past warm-up (a prefill, when
    there was one, comes before them)."""
    return values[-steps:][steps // 2:]


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


def pipelined_decode_ms(step, model, batch: int, prompt: int, steps: int, device: str,
                        tensor_pos: bool = False) -> float:
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
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-i", target],
                             capture_output=True, text=True, timeout=10)
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


def compiled_variant(variant: str, model, pinned: bool = False):
    """``variant`` compiled. ``pinned``: its ``+pinned-sdpa`` twin, compiled with one option more
    (a no-op for Inductor, the same pin for the backend's eager attention) so that Dynamo keeps its
    cache entries apart from the unpinned variant's: Inductor picks SDPA's kernel at compile time,
    and equal backends share Dynamo's cache within a process."""
    variant = SKIP_GUARDS.get(variant, variant)
    inductor_extra = {"max_autotune": False} if pinned else {}
    piecewise_extra = {"eager_sdpa_backends": ["flash", "efficient"]} if pinned else {}
    if variant == "inductor":
        return torch.compile(model, options=inductor_extra or None)
    if variant == "reduce-overhead":
        return torch.compile(model, options={"triton.cudagraphs": True, "graph_partition": False, **inductor_extra})
    if variant == "reduce-overhead+partition":
        return torch.compile(model, options={"triton.cudagraphs": True, "graph_partition": True, **inductor_extra})
    options = {"piecewise": {}, "piecewise-eager-attention": {"graph_attention": False},
               "piecewise-kv-eager": {"capture_kv_writes": False, "graph_attention": False},
               "piecewise-no-clone": {"clone_outputs": False},
               "piecewise-full": {"mode": "full"},
               # its masked attention over the whole cache: nothing to rewrite
               "piecewise-full-static": {"mode": "full", "graph_attention": False}}
    if variant not in options:
        raise ValueError(variant)
    return torch.compile(model, backend="piecewise", options={**options[variant], **piecewise_extra} or None)


def piecewise_facts(graphs: list) -> dict:
    """What the backend made of the model: pieces, compiles, captures, copies per step."""
    main = max(graphs, key=lambda g: g.stats.calls)
    return {"graphs": len(graphs), "pieces": main.stats.num_pieces,
            "compute_pieces": main.stats.num_compute_pieces,
            "inductor_compiles": sum(g.stats.inductor_compiles for g in graphs),
            "captures": sum(g.stats.captures for g in graphs),
            "input_copies_per_step": round(sum(p.input_copies for p in main.stats.pieces.values())
                                           / max(main.stats.calls, 1), 2),
            "padding": main.stats.padding}


def inductor_compiles() -> dict:
    """Inductor's graph counts so far: compiled afresh (``fxgraph_cache_miss``) or loaded from its
    cache (``fxgraph_cache_hit``)."""
    from torch._dynamo.utils import counters

    return {k: counters["inductor"].get(k, 0) for k in ("fxgraph_cache_miss", "fxgraph_cache_hit")}


def _since(before: dict) -> dict:
    """A row's compile facts: how many Inductor graphs its warm-up compiled and how many it loaded
    from the cache, so that ``first_call_s`` says which it timed (the device runs keep Inductor's
    cache between calls on one machine)."""
    now = inductor_compiles()
    return {"inductor_compiled": now["fxgraph_cache_miss"] - before["fxgraph_cache_miss"],
            "inductor_cache_hits": now["fxgraph_cache_hit"] - before["fxgraph_cache_hit"]}


def prepared_variant(variant: str, model, twin, batch: int, args, device: str):
    """Compile and warm up ``variant`` at ``batch`` (a short decode, or the limit's capture):
    (first call seconds, ``measure(pipelined=False)`` giving one decode run's median step ms and host ms,
    ``facts()`` giving the row's extra fields once the timing is done). Dynamo is not reset here: the sequential path
    resets before each variant, the interleaved one before each batch."""
    with sdpa_setting(variant, device):
        first_s, measure, facts = _prepared(base_variant(variant), model, twin, batch, args, device,
                                            pinned=variant.endswith(PINNED))

    def measure_as_named(pipelined: bool = False):
        with sdpa_setting(variant, device):
            return measure(pipelined)
    return first_s, measure_as_named, facts


def _prepared(variant: str, model, twin, batch: int, args, device: str, pinned: bool):
    before = {g.serial for g in piecewise_backend.compiled_graphs()}
    compiles_before = inductor_compiles()
    if variant in ("limit", "limit-full"):
        full = variant == "limit-full"
        replay, first_s = limit_graph(twin if full else model, batch, args.prompt, device, tensor_pos=full)
        compiles = _since(compiles_before)
        return first_s, lambda pipelined=False: replay_ms(replay, args.steps, device, pipelined), lambda: compiles
    if variant == "eager":
        step, target = model, model
    elif variant == "dynamo-floor":
        replay, _ = limit_graph(model, batch, args.prompt, device)
        step, target = torch.compile(model, backend=floor_backend(replay)), model
    else:
        target = twin if variant == "piecewise-full-static" else model
        step = compiled_variant(variant, target, pinned)
    tensor_pos = variant == "piecewise-full-static"
    _, first_s = time_decode(step, target, batch, args.prompt, 4, device, tensor_pos=tensor_pos)
    compiles = _since(compiles_before)

    stance = (lambda: torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)) if variant in SKIP_GUARDS \
        else contextlib.nullcontext

    def measure(pipelined: bool = False) -> tuple[float, float]:
        host = HostTimed(step)
        decode = pipelined_decode_ms if pipelined else lambda *a, **k: time_decode(*a, **k)[0]
        with stance():
            ms = decode(host, target, batch, args.prompt, args.steps, device, tensor_pos=tensor_pos)
        return ms, host.median_ms(args.steps)

    # this variant's graphs: those its warm-up compiled (SKIP_GUARDS' variants: none where Dynamo
    # serves them their base variant's cache entries)
    mine = [g for g in piecewise_backend.compiled_graphs() if g.serial not in before]

    def facts() -> dict:
        return {**compiles, "piecewise": piecewise_facts(mine)} if mine else compiles

    return first_s, measure, facts


def models_for(key: str, args, device: str):
    """The model sized for the run, and its graph-safe twin with the same weights."""
    if key in IDIOMS:  # no graph-safe twin: the full-static variants are the toys' own
        size, cls = IDIOMS[key]
        return toy_model(size, device, cls, max_batch=max(args.batches), max_seq=args.prompt + args.steps + 8), None
    model = toy_model(key, device, max_batch=max(args.batches), max_seq=args.prompt + args.steps + 8)
    twin = toy_model(key, device, ToyStaticCacheLlama, max_batch=model.cfg.max_batch, max_seq=model.cfg.max_seq)
    twin.load_state_dict(model.state_dict())
    return model, twin


def _size_caches(model, batch: int) -> None:
    """A model whose caches hold exactly the batch (``toys/idioms.py``) gets new ones per batch."""
    if hasattr(model, "set_batch"):
        model.set_batch(batch)


def _sdpa_label(variant: str) -> str:
    return "pinned flash/efficient" if variant.endswith(PINNED) else "torch default"


def _error(exc: Exception) -> str:
    traceback.print_exc()
    return f"{type(exc).__name__}: {exc}"[:500]


def _mark_process(batch_rows: list[dict], args) -> None:
    """Say on each row what shared its process, and the limit timed there.

    Why: the same variant measures differently with what else the process holds (the limit
    itself, one graph and no host work, took 0.98 and 1.08 ms in two processes of one lease), and
    a device call cannot hold every variant at every batch, so results merge rows of several
    processes: a ratio is only as good as the knowledge of which rows shared one.
    """
    how = "interleaved" if getattr(args, "rounds", 1) > 1 else "one at a time"
    label = f"{'/'.join(args.models)} b{'/'.join(map(str, args.batches))}, {how}: {', '.join(args.variants)}"
    limit = next((r for r in batch_rows if r["variant"] == "limit"), {})
    for row in batch_rows:
        row["process"] = label
        if row["variant"] == "limit":
            continue
        for field, same in SAME_PROCESS_LIMIT.items():
            if limit.get(field) is not None:
                row[same] = limit[field]


def _pipelined_ms(row: dict, measure) -> float | None:
    """One pipelined run's median step ms, or None with the failure in ``row["pipelined_error"]``:
    kept apart, so that it does not take the row's waiting times with it."""
    try:
        return round(measure(pipelined=True)[0], 4)
    except Exception as exc:
        row["pipelined_error"] = _error(exc)
        return None


def decode_rows(args, device: str, rows: list) -> list[dict]:
    """Appends each row to ``rows`` as it is measured (so a run cut short keeps what it measured).
    With ``args.rounds`` > 1, :func:`interleaved_rows` instead."""
    if getattr(args, "rounds", 1) > 1:
        return interleaved_rows(args, device, rows)
    for key in args.models:
        model, twin = models_for(key, args, device)
        for batch in args.batches:
            _size_caches(model, batch)
            batch_rows = []
            for variant in args.variants:
                row = {"model": model_name(model), "variant": variant, "batch": batch}
                batch_rows.append(row)
                try:
                    torch._dynamo.reset()
                    with torch.inference_mode():
                        first_s, measure, facts = prepared_variant(variant, model, twin, batch, args, device)
                        step_ms, host_ms = measure()
                        clock = sm_clock_mhz(device)
                        row.update(step_ms=round(step_ms, 4), host_ms=round(host_ms, 4), sm_clock_mhz=clock,
                                   first_call_s=round(first_s, 3), sdpa=_sdpa_label(variant), **facts())
                        row["pipelined_ms"] = _pipelined_ms(row, measure)
                except Exception as exc:  # a failure is a result, not a skip
                    row.update(step_ms=None, first_call_s=None, error=_error(exc))
                _mark_process(batch_rows, args)
                print(json.dumps(row), flush=True)
                rows.append(row)
                _save(args)
    return rows


def interleaved_rows(args, device: str, rows: list) -> list[dict]:
    """Per model and batch: every variant compiled and warmed up first, then ``args.rounds`` rounds
    that time each variant in turn; a row's ``step_ms`` is the median of its rounds
    (``step_ms_rounds``).

    Why: a lent machine's host speed drifts over seconds (two variants doing the same work, one
    graph per step each, came out 1.05 and 1.25 ms when timed 30 s apart), so variants timed one
    after the other can differ by more than what separates them. Interleaved, a slow spell hits
    every variant. Dynamo is reset once per batch, not per variant, so its cache holds every
    variant's graphs at once (told apart by its backend check; the recompile limit is raised).
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    settle = getattr(args, "settle", 0)
    deadline = time.perf_counter() + settle
    while time.perf_counter() < deadline:  # learn the host's full speed before the first round waits for it
        _probe()
        time.sleep(0.05)
    for key in args.models:
        model, twin = models_for(key, args, device)
        for batch in args.batches:
            _size_caches(model, batch)
            torch._dynamo.reset()
            batch_rows, measures, facts = {}, {}, {}
            with torch.inference_mode():
                for variant in args.variants:
                    row = batch_rows[variant] = {"model": model_name(model), "variant": variant, "batch": batch,
                                                 "sdpa": _sdpa_label(variant)}
                    try:
                        first_s, measures[variant], facts[variant] = prepared_variant(variant, model, twin, batch,
                                                                                      args, device)
                        row.update(first_call_s=round(first_s, 3), step_ms_rounds=[], host_ms_rounds=[],
                                   host_probe_us_rounds=[], sm_clock_mhz_rounds=[], pipelined_ms_rounds=[])
                    except Exception as exc:  # a failure is a result, not a skip
                        row.update(step_ms=None, first_call_s=None, error=_error(exc))
                for round_ in range(args.rounds):
                    if round_ and getattr(args, "pause", 0):
                        time.sleep(args.pause)  # rounds seconds apart meet the host's spells apart
                    for variant, measure in list(measures.items()):
                        row = batch_rows[variant]
                        try:
                            probe = settled_probe(settle)
                            step_ms, host_ms = measure()
                            row["host_probe_us_rounds"].append(round(max(probe, _probe()), 2))
                            row["step_ms_rounds"].append(round(step_ms, 4))
                            row["host_ms_rounds"].append(round(host_ms, 4))
                            row["sm_clock_mhz_rounds"].append(sm_clock_mhz(device))
                        except Exception as exc:
                            row.update(error=_error(exc))
                            del measures[variant]
                for _ in range(args.rounds):  # after every waiting round: see the module's docstring
                    for variant, measure in list(measures.items()):
                        row = batch_rows[variant]
                        if "pipelined_error" not in row and (ms := _pipelined_ms(row, measure)) is not None:
                            row["pipelined_ms_rounds"].append(ms)
            for variant, row in batch_rows.items():
                if variant in facts:
                    row.update(facts[variant]())
                times, host = row.get("step_ms_rounds"), row.get("host_ms_rounds")
                ok = bool(times) and "error" not in row
                row["step_ms"] = round(statistics.median(times), 4) if ok else None
                row["host_ms"] = round(statistics.median(host), 4) if ok else None
                pipelined = row.get("pipelined_ms_rounds")
                row["pipelined_ms"] = round(statistics.median(pipelined), 4) \
                    if ok and pipelined and "pipelined_error" not in row else None
            fast_host_times(list(batch_rows.values()), _FASTEST_PROBE[0])
            _mark_process(list(batch_rows.values()), args)
            for row in batch_rows.values():
                print(json.dumps(row), flush=True)
                rows.append(row)
            _save(args)
    return rows


# a round met the host at full speed when its probe took at most this times the fastest probe
# (the process's, or its rows' own: ``fast_host_times``; the slow spells are ~3×: ``timing.host_probe_us``)
FAST_HOST = 1.3


_FASTEST_PROBE = [float("inf")]  # the fastest host probe of this process, µs


def _probe() -> float:
    probe = host_probe_us()
    _FASTEST_PROBE[0] = min(_FASTEST_PROBE[0], probe)
    return probe


def settled_probe(wait_s: float) -> float:
    """A host probe (µs); with ``wait_s`` > 0, probed again every 50 ms while the host runs slower
    than ``FAST_HOST`` times the fastest probe so far, for up to ``wait_s`` seconds (``--settle``):
    a timed run then starts, where it can, on a host at full speed."""
    deadline = time.perf_counter() + wait_s
    while True:
        probe = _probe()
        if probe <= FAST_HOST * _FASTEST_PROBE[0] or time.perf_counter() >= deadline:
            return probe
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


_RESULT: dict = {}


def _save(args) -> None:
    if getattr(args, "out", None):
        with open(args.out, "w") as f:
            json.dump(_RESULT, f, indent=1)


# -- startup --------------------------------------------------------------------------------------


def first_output(variant: str, model_key: str, device: str) -> None:
    """(In a fresh process.) Print seconds from torch.compile to the first output, and compiles."""
    model = toy_model(model_key, device, max_batch=1, max_seq=300)
    ids = torch.randint(0, model.cfg.vocab, (1, 256), device=device)
    compiling = _compile_span()
    with torch.inference_mode():  # torch's SDPA defaults, as a user starts
        synchronize(device)
        start = time.perf_counter()
        step = torch.compile(model) if variant == "inductor" else torch.compile(model, backend="piecewise")
        step(ids, 0)
        synchronize(device)
        seconds = time.perf_counter() - start
    from torch._dynamo.utils import compile_times, counters

    inductor = counters["inductor"]  # graphs Inductor compiled or loaded from its cache
    graphs = sum(inductor.get(k, 0) for k in ("fxgraph_cache_miss", "fxgraph_cache_hit", "fxgraph_cache_bypass"))
    row = {"seconds": round(seconds, 3), "inductor_graphs": graphs,
           "fxgraph_cache_hits": inductor.get("fxgraph_cache_hit", 0),
           "phases_s": _top_phases(*compile_times(repr="csv", aggregate=True))}
    if compiling:  # where the time outside Dynamo's compile goes: before it starts, or in the first run
        row["before_compile_s"] = round(compiling[0] - start, 3)
        row["compile_s"] = round(compiling[-1] - compiling[0], 3)
        row["first_run_s"] = round(start + seconds - compiling[-1], 3)
    if variant == "piecewise":
        graph = piecewise_backend.compiled_graphs()[-1]
        row["backend_s"] = {"build": round(graph.stats.build_seconds, 3),
                            "inductor": round(graph.stats.inductor_seconds, 3),
                            "capture": round(graph.stats.capture_seconds, 3)}
    print(json.dumps(row))


def _compile_span() -> list:
    """perf_counter() at each start and end of a Dynamo compile, appended as they happen."""
    from torch._dynamo.callback import callback_handler

    stamps: list = []
    callback_handler.register_start_callback(lambda *_: stamps.append(time.perf_counter()))
    callback_handler.register_end_callback(lambda *_: stamps.append(time.perf_counter()))
    return stamps


def _top_phases(names: list, values: list, n: int = 10) -> dict:
    """Dynamo's own compile-time metrics (``dynamo_timed``), the ``n`` largest, in seconds."""
    pairs = sorted(((float(v), k) for k, v in zip(names, values)), reverse=True)[:n]
    return {k: round(v, 3) for v, k in pairs}


def startup_rows(args, device: str, rows: list) -> list[dict]:
    for variant in ("inductor", "piecewise"):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
            for start in ("cold", "warm"):
                cmd = [sys.executable, __file__, "--first-output", variant, "--models", args.models[0],
                       "--device", device]
                row = {"model": args.models[0], "variant": variant, "start": start}
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                try:
                    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                except Exception:
                    row["error"] = (proc.stderr or proc.stdout)[-500:]
                print(json.dumps(row), flush=True)
                rows.append(row)
                _save(args)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--models", nargs="+", default=["16L", "28L"], choices=sorted(MODELS) + sorted(IDIOMS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=1,
                        help="> 1: compile every variant first, then time them in turn, this many rounds")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between interleaved rounds")
    parser.add_argument("--settle", type=float, default=0.0,
                        help="seconds a timed run may wait for the host to run at full speed (settled_probe)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--startup", action="store_true", help="also time cold and warm starts")
    parser.add_argument("--first-output", choices=("inductor", "piecewise"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_output:
        return first_output(args.first_output, args.models[0], args.device)
    _RESULT["decode"] = []
    if args.startup:  # first: fresh processes, before this one fills the GPU with models
        startup_rows(args, args.device, _RESULT.setdefault("startup", []))
    decode_rows(args, args.device, _RESULT["decode"])
    _save(args)


if __name__ == "__main__":
    main()
