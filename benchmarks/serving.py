"""Suite ``serving``: the seed's own serving workload, timed as ``vllm bench serve`` times it, and a
concurrency sweep, on the repository's serving engine (``toys/engine.py``).

    python -m benchmarks serving [--variants full-and-piecewise,piecewise] [--requests 30] [--in-flight 1,8,32,64,128]
    python -m benchmarks serving --smoke       # CPU: the tiny config, graphs emulated, four requests

The seed's headline (vLLM's "Support full cuda graph" table) is Qwen2.5-1.5B under ``vllm bench serve
--random-input-len 1000 --random-output-len 100 --request-rate 1``: median TPOT 5.75 ms with piecewise
graphs, 5.33 ms with one full graph. Here: ``toys/engine.py`` at Qwen2.5-1.5B's dimensions (random
weights, bf16), prompts of exactly 1,000 random tokens, 100 new tokens each, Poisson arrivals at
``--rate`` requests/s, ``--requests`` of them, token budget 2,048. Per request, as vLLM computes them:
TTFT (first token - arrival), TPOT ((last token - first token) / (tokens - 1)), ITL (every gap
between a request's tokens); median, mean and p99 of each, and output tokens/s.

Then, in the same process (the start-up paid once), the concurrency sweep: ``--in-flight`` levels
(1, 8, 32, 64, 128), each one wave of that many requests submitted at once with ``max_num_seqs`` set
to it, the seed's 1,000-token prompts and 100 new tokens, after a short untimed wave of the same
level (4 new tokens: the warm-up ``vllm bench serve`` does too): output tokens/s, median TPOT, and
the median decode-only step (``decode_step_median_ms``; ``decode_batch_median``: its rows) beside
its byte floor (``floor_ms``: the weights once plus the keys and values of that step's rows at
their lengths, over the copy bandwidth measured in the run; ``vs_floor``: the median of each step
over its own floor). Where the rest of a decode step goes: ``forward_median_ms`` (the compiled
forward, from the host's call to its last kernel: a graph replay in a full-graph step) and
``sample_median_ms`` (logits and argmax), the remainder being the engine's host work.

``--profile 1,64``: before the sweep, where a step's time goes at those levels (``workload: profile``,
:func:`profile_levels`): kernels, GPU time and copies per decode and per prefill step, the forward's
host time per call, the decode step's costliest kernels.

Rows (``workload``: ``seed``, ``profile``, ``concurrency`` per level, ``fp32-agreement``), written as they come.
Variants, each in a child process with its own timeout:

* ``eager``; ``inductor`` (``torch.compile`` default); ``reduce-overhead`` (the attention op tagged
  ``cudagraph_unsafe``, its best chance);
* ``piecewise``: this backend, every step piecewise (the engine's host metadata path), as before full
  graphs existed;
* ``piecewise-paged``: piecewise too, but decode steps take the engine's graph-safe path (the paged
  decode kernel, eager between the pieces): what the kernel gives without full graphs;
* ``full-and-piecewise``: the engine's default: decode-only steps under ``cudagraph_mode("full")``
  (one graph per batch size, captured lazily), other steps piecewise;
* ``full-and-piecewise-direct``: the same through ``piecewise_backend.direct`` (a call whose signature
  was seen skips Dynamo's guards and argument fetch);
* ``full-and-piecewise-all``: the same with every size captured up front (``eager_capture_sizes="all"``
  and a dummy decode step per decode size: vLLM's way).

The other variants run the engine's default metadata paths too (their attention op does the same
work); only ``piecewise`` keeps the host path for decode steps. Each row records its start-up
(process start to the engine warmed up), whether Inductor's cache was cold or warm for it (from
Inductor's own counters: the variants share one cache folder, so a later variant may find what an
earlier one compiled), the captures, and full and piecewise replays. ``--agreement-variants``: those
variants also compare their fp32 tokens with the eager engine's on a short trace (a second compile).
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # before torch is imported: start-up counts the import

import dataclasses
import pathlib
import statistics
import sys
from collections.abc import Iterator

import torch

from benchmarks import ramp
from benchmarks.harness import Suite
from toys import engine as toy

VARIANTS = (
    "piecewise",
    "full-and-piecewise",
    "full-and-piecewise-inline",
    "full-and-piecewise-all",
    "full-and-piecewise-direct",
    "piecewise-paged",
    "eager",
    "inductor",
    "reduce-overhead",
    "hand-captured",
)
SEED_VLLM = {
    "piecewise": {"tpot_median_ms": 5.75, "ttft_median_ms": 28.9, "itl_p99_ms": 6.58},
    "full": {"tpot_median_ms": 5.33, "ttft_median_ms": 30.5, "itl_p99_ms": 6.18},
}  # seed 001, their GPU, fp16
PROMPT, OUTPUT = 1000, 100  # the seed's workload, and the sweep's requests too
CONFIGS = {"tiny": toy.TINY, "qwen2.5-1.5b": toy.QWEN2_5_1_5B}


def build(config: str, variant: str, device: str, dtype):
    """The engine's model at ``config``'s dimensions, random weights (seeded)."""
    cfg = CONFIGS[config]
    if variant == "reduce-overhead":  # its best chance: the attention op tagged cudagraph_unsafe
        cfg = dataclasses.replace(cfg, attention_op=toy.TAGGED_ATTENTION)
    torch.manual_seed(0)
    with torch.device(device):
        model = toy.EngineModel(cfg)
    return model.init_weights_().to(device, dtype).eval()


def capture_sizes() -> tuple:
    """The backend's default capture sizes (the peer pads to the same)."""
    from piecewise_backend.config import scheme_sizes

    return scheme_sizes("default", 512)


def percentile(values: list, q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def compiled(model, variant: str):
    """What the engine calls for ``variant``."""
    if variant == "eager":
        return model
    if variant == "inductor":
        return torch.compile(model)
    if variant == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    if variant == "hand-captured":  # the peer: Inductor's default, decode steps captured by hand
        return HandCaptured(model, capture_sizes())
    options = {"extra_splitting_ops": [toy.ATTENTION], "row_independent_ops": [toy.ATTENTION]}
    if variant == "full-and-piecewise-inline":  # the reference: a new size captured in the call that meets it
        options["capture_behind"] = False
    if variant == "full-and-piecewise-all":
        options["eager_capture_sizes"] = "all"
    forward = torch.compile(model, backend="piecewise", options=options)
    if variant == "full-and-piecewise-direct":  # a signature seen once skips Dynamo's guards afterwards
        import piecewise_backend

        return piecewise_backend.direct(forward)
    if variant == "piecewise-paged":  # the engine's decode path, but never a full graph
        import piecewise_backend

        def piecewise_only(*args):
            with piecewise_backend.cudagraph_mode("piecewise"):  # inside the engine's own mode: it wins
                return forward(*args)

        return piecewise_only
    return forward


# -- the peer: what an engine author would write by hand ----------------------------------------------


class HandCaptured:
    """The ``hand-captured`` variant, the bar an engine author sets before adopting the backend:
    ``torch.compile(model)`` (Inductor's default) plus the CUDA graphs they would capture by hand.
    Decode-only steps (the engine's graph-safe :class:`~toys.engine.DecodeMetadata` path) are padded
    to the backend's capture sizes and replayed from one ``torch.cuda.CUDAGraph`` per size, captured
    the first time a size is met (inside that step), in one memory pool, over the engine's
    persistent decode buffers; every other step runs the compiled model un-graphed. Same warm-up and
    sizes as the backend's variants. :meth:`attach` gives it the engine's decode buffers (made after it)."""

    def __init__(self, model, sizes: tuple):
        self.compiled = torch.compile(model)
        self.sizes = sorted(sizes)
        self.graphs: dict[int, tuple] = {}  # padded size -> (graph, its output)
        self.pool = None
        self.buffers = None

    def attach(self, engine: toy.Engine) -> None:
        self.buffers = engine._decode

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        decode = isinstance(toy._CONTEXT.get(), toy.DecodeMetadata)
        size = next((s for s in self.sizes if s >= n), None)
        if not (decode and ids.is_cuda and size is not None and size <= self.buffers.step.shape[1]):
            return self.compiled(ids, positions)
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]

    def _capture(self, size: int) -> tuple:
        """Rows past the step are the buffers' padding (slot -1, length 0): they write and read nothing."""
        ids, positions = self.buffers.step[0, :size], self.buffers.step[1, :size]
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up run torch.cuda.graph's documentation asks for
            self.compiled(ids, positions)
        torch.cuda.current_stream().wait_stream(side)
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.compiled(ids, positions)
        return graph, out


def engine_for(model, forward, variant: str, device: str, dtype, args) -> toy.Engine:
    tiny = args.config == "tiny"
    longest = 64 if tiny else PROMPT + OUTPUT
    seqs = max(args.in_flight)
    per_request = -(-longest // model.cfg.block_size)
    blocks = (
        max(
            seqs * -(-(PROMPT + OUTPUT) // model.cfg.block_size),
            8 * per_request,
            -(-args.max_num_tokens // model.cfg.block_size) + 1,
        )
        + 8
    )  # (the warm-up's step at the budget)
    mode = "piecewise" if variant in ("piecewise",) else "full_and_piecewise"
    engine = toy.Engine(
        model,
        forward,
        max_num_tokens=args.max_num_tokens,
        max_num_seqs=seqs,
        num_blocks=blocks,
        device=device,
        dtype=dtype,
        graph_mode=mode,
    )
    if isinstance(forward, HandCaptured):
        forward.attach(engine)
    return engine


def requests(n: int, prompt: int, output: int, rate: float, vocab: int, seed: int = 0) -> list:
    """``n`` requests of exactly ``prompt`` random tokens and ``output`` new ones, Poisson arrivals at
    ``rate`` requests/s (0: all at once)."""
    g = torch.Generator().manual_seed(seed)
    out, arrival = [], 0.0
    for i in range(n):
        if rate > 0:
            arrival += float(torch.empty(()).exponential_(rate, generator=g))
        out.append(toy.Request(i, torch.randint(0, vocab, (prompt,), generator=g).tolist(), output, arrival))
    return out


def latencies(done: list, start: float) -> dict:
    """vLLM's serving metrics over finished requests (times in ms; arrivals relative to ``start``)."""
    ttft = [(r.token_times[0] - start - r.arrival) * 1e3 for r in done]
    tpot = [
        (r.token_times[-1] - r.token_times[0]) * 1e3 / (len(r.token_times) - 1) for r in done if len(r.token_times) > 1
    ]
    itl = [(b - a) * 1e3 for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    out = {}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        out.update(
            {
                f"{name}_median_ms": _ms(statistics.median(values)),
                f"{name}_mean_ms": _ms(statistics.fmean(values)),
                f"{name}_p99_ms": _ms(percentile(values, 0.99)),
            }
        )
    duration = max(r.token_times[-1] for r in done) - start - min(r.arrival for r in done)
    out["out_tok_s"] = round(sum(len(r.output) for r in done) / duration, 1)
    return out


def graph_counts() -> dict:
    """Captures and replays of every compiled graph of this process (the backend's variants only)."""
    if "piecewise_backend" not in sys.modules:
        return {}
    import piecewise_backend
    from piecewise_backend.kinds import Miss

    graphs = piecewise_backend.compiled_graphs()
    return {
        "captures": sum(g.stats.captures + g.stats.full_captures for g in graphs),
        "full_replays": sum(g.stats.full_replays for g in graphs),
        "piecewise_replays": sum(g.stats.piecewise_replays for g in graphs),
        # calls under cudagraph_mode("full") that ran piecewise: while their size was captured behind
        # them (expected, once per size), and for any other reason
        "full_while_behind": sum(g.stats.full_fallbacks[str(Miss.CAPTURING_BEHIND)] for g in graphs),
        "full_fallbacks": sum(
            n for g in graphs for r, n in g.stats.full_fallbacks.items() if r != Miss.CAPTURING_BEHIND
        ),
        "ungraphed_runs": sum(g.stats.ungraphed_runs for g in graphs),
    }


def inductor_cache() -> str:
    """cold / warm / mixed, from Inductor's FX graph cache counters (none: nothing was compiled)."""
    from torch._dynamo.utils import counters

    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    return "none" if not hits + misses else "warm" if not misses else "cold" if not hits else "mixed"


def serve(args, variant: str) -> Iterator[dict]:
    """One variant: start-up, the seed workload, then the sweep: the seed row, then a row per level."""
    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build(args.config, variant, device, dtype)
    engine = engine_for(model, compiled(model, variant), variant, device, dtype, args)
    sizes = [s for s in capture_sizes() if s <= max(args.in_flight)]
    engine.warm_up(freeze_gc=True, decode_sizes=sizes if variant == "full-and-piecewise-all" else ())
    _sync(device)
    startup = time.perf_counter() - _STARTED
    cache = inductor_cache()
    vocab, prompt = model.cfg.vocab, PROMPT if args.config != "tiny" else 24
    engine.max_num_seqs = max(args.in_flight)
    done = engine.run(
        requests(args.requests, prompt, OUTPUT if args.config != "tiny" else 8, args.rate, vocab),
        realtime=args.rate > 0,
    )
    _sync(device)
    yield {
        "workload": "seed",
        **latencies(done, engine._start),
        "startup_s": round(startup, 2),
        "inductor_cache": cache,
        **graph_counts(),
        **({"skipped_dynamo": engine.forward.skipped_dynamo} if hasattr(engine.forward, "skipped_dynamo") else {}),
        "requests": len(done),
    }
    if args.profile:
        yield from profile_levels(args, engine, vocab)
    yield from sweep_levels(args, engine, vocab)


def profile_levels(args, engine: toy.Engine, vocab: int) -> Iterator[dict]:
    """``--profile 1,64``: where a step's time goes, per level (rows ``workload: profile``). Two waves of
    that many requests under ``torch.profiler``, one that only prefills (1 new token) and one that
    decodes ``PROFILED`` steps more: decode kernels and kernel time per step are their difference over
    those steps (graph replays' kernels included), prefill's the first wave's per prefill step. The
    forward's host time per call (the caller's Python, no sync: the launches, replays and the
    backend's own work) is timed around the engine's forward. Same prompts in both waves."""
    from torch.profiler import ProfilerActivity, profile

    tiny = args.config == "tiny"
    prompt = 8 if tiny else PROMPT
    for level in args.profile:
        engine.max_num_seqs = level
        engine.run(requests(level, prompt, PROFILED + 1, 0.0, vocab, seed=2000 + level))  # sizes captured
        figures = {}
        for name, output in (("prefill", 1), ("all", PROFILED + 1)):
            timed = _HostTimed(engine.forward)
            engine.forward, engine.steps = timed, []
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
            with profile(activities=activities) as prof:
                engine.run(requests(level, prompt, output, 0.0, vocab, seed=3000 + level))
                _sync(args.device)
            engine.forward = timed.forward
            figures[name] = (_kernels(prof), timed, len(engine.steps))
        (pre_kernels, pre_timed, pre_steps), (all_kernels, all_timed, all_steps) = figures["prefill"], figures["all"]
        steps = all_steps - pre_steps
        decode = {
            name: (n - pre_kernels.get(name, (0, 0.0))[0], ms - pre_kernels.get(name, (0, 0.0))[1])
            for name, (n, ms) in all_kernels.items()
        }
        top = sorted(decode.items(), key=lambda item: -item[1][1])[:8]
        yield {
            "workload": "profile",
            "in_flight": level,
            "decode_steps": steps,
            **{f"decode_{k}": v for k, v in _summed(decode, steps).items()},
            "decode_forward_host_ms": _ms(statistics.median(all_timed.decode) if all_timed.decode else None),
            "prefill_steps": pre_steps,
            **{f"prefill_{k}": v for k, v in _summed(pre_kernels, pre_steps).items()},
            "prefill_forward_host_ms": _ms(statistics.median(pre_timed.other) if pre_timed.other else None),
            "decode_top_kernels": [[name[:80], round(n / steps, 2), round(ms / steps, 4)] for name, (n, ms) in top],
        }


PROFILED = 16  # decode steps per profiled wave


class _HostTimed:
    """The engine's forward, its host time per call kept apart for decode-only steps and others."""

    def __init__(self, forward):
        self.forward, self.decode, self.other = forward, [], []

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.forward(*args)
        decode = isinstance(toy._CONTEXT.get(), toy.DecodeMetadata)
        (self.decode if decode else self.other).append((time.perf_counter() - start) * 1e3)
        return out


def _kernels(prof) -> dict:
    """Per kernel name (graph replays' kernels included; copies and fills are ``Memcpy``/``Memset``):
    (launches, summed GPU time in ms)."""
    totals: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count, ms = totals.get(e.name, (0, 0.0))
            totals[e.name] = (count + 1, ms + e.device_time / 1e3)
    return totals


def _summed(totals: dict, steps: int) -> dict:
    copies = sum(n for name, (n, _) in totals.items() if name.startswith(("Memcpy", "Memset")))
    return {
        "kernels_per_step": round((sum(n for n, _ in totals.values()) - copies) / steps, 1),
        "kernel_ms_per_step": _ms(sum(ms for _, ms in totals.values()) / steps),
        "copies_per_step": round(copies / steps, 1),
    }


def sweep_levels(args, engine: toy.Engine, vocab: int) -> Iterator[dict]:
    """The concurrency sweep: per level, a short wave first (what a level needs that start-up did not
    make, a graph of its batch size say, is made there, as ``vllm bench serve``'s warm-up requests do),
    then the timed wave."""
    tiny = args.config == "tiny"
    floor = StepFloor(engine.model, args.device)
    for level in args.in_flight:
        engine.max_num_seqs = level
        prompt, output = (8, 8) if tiny else (PROMPT, OUTPUT)
        engine.run(requests(level, prompt, 4, 0.0, vocab, seed=1000 + level))
        batch = requests(level, prompt, output, 0.0, vocab, seed=level)
        engine.steps.clear()
        engine.finished.clear()  # run() returns every request finished so far: this wave's only
        engine.time_phases = args.device == "cuda"  # a few µs a step: the timed wave only
        began = time.perf_counter()
        finished = engine.run(batch)
        _sync(args.device)
        engine.time_phases = False
        seconds = time.perf_counter() - began
        tpot = [(r.token_times[-1] - r.token_times[0]) * 1e3 / (len(r.token_times) - 1) for r in finished]
        yield {
            "workload": "concurrency",
            "in_flight": level,
            "out_tok_s": round(level * len(batch[0].output) / seconds, 1),
            "tpot_median_ms": _ms(statistics.median(tpot)),
            **floor.decode_steps(engine.steps),
        }


class StepFloor:
    """A decode step's byte floor: the weights read once and every row's keys and values at its
    length, over the copy bandwidth measured here (on a GPU; None elsewhere)."""

    def __init__(self, model: toy.EngineModel, device: str):
        cfg = model.cfg
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        element = model.embed.weight.element_size()
        self.key_bytes = cfg.layers * 2 * cfg.kv_heads * cfg.head_dim * element  # a key and a value, every layer
        self.bandwidth = None
        if device == "cuda":
            from benchmarks.timing import copy_bandwidth

            self.bandwidth = copy_bandwidth()

    def ms(self, keys: int) -> float | None:
        return None if self.bandwidth is None else (self.weight_bytes + keys * self.key_bytes) / self.bandwidth * 1e3

    def decode_steps(self, steps: list) -> dict:
        """The decode-only steps' medians (step, rows, floor, step over floor, forward, sampling)."""
        decode = [s for s in steps if s.num_prefill_tokens == 0 and s.num_decode > 0]
        if not decode:
            return {}
        out = {
            "decode_steps": len(decode),
            "decode_step_median_ms": _ms(statistics.median(s.seconds * 1e3 for s in decode)),
            "decode_batch_median": statistics.median(s.num_decode for s in decode),
            "copy_gbs": None if self.bandwidth is None else round(self.bandwidth / 1e9),
        }
        if self.bandwidth is not None:
            out["floor_ms"] = _ms(statistics.median(self.ms(s.keys) for s in decode))
            out["vs_floor"] = _ms(statistics.median(s.seconds * 1e3 / self.ms(s.keys) for s in decode))
        phases = [s.phase_ms() for s in decode if s.events]
        if phases:
            out["forward_median_ms"] = _ms(statistics.median(f for f, _ in phases))
            out["sample_median_ms"] = _ms(statistics.median(p for _, p in phases))
        return out


def agreement(args, variant: str) -> float:
    """The share of requests whose fp32 tokens equal the eager engine's, on a short seeded trace."""
    model = build(args.config, variant, args.device, torch.float32)
    trace = dict(prompt=(32, 256), output=(8, 24)) if args.config != "tiny" else {}

    def tokens(forward):
        engine = engine_for(model, forward, variant, args.device, torch.float32, args)
        return [r.output for r in engine.run(toy.seeded_trace(6, seed=1, vocab=model.cfg.vocab, **trace))]

    expected = tokens(model)
    got = tokens(compiled(model, variant))
    return round(sum(a == b for a, b in zip(got, expected)) / len(expected), 3)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def rows(variant: str, args) -> Iterator[dict]:
    """In the child: the variant's rows as they come; a failure is a row saying how."""
    try:
        if variant.startswith("ramp"):
            yield from ramp.ramp(variant, args, sys.modules[__name__])
            return
        yield from serve(args, variant)
        if variant in args.agreement_variants.split(","):
            torch._dynamo.reset()
            yield {"workload": "fp32-agreement", "token_agreement": agreement(args, variant)}
    except Exception as exc:
        yield {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}


def figure(rows: list[dict], png: pathlib.Path) -> None:
    """Median TPOT per variant on the seed workload (harness rows), the seed's vLLM numbers beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["figures"].get("workload") == "seed" and "tpot_median_ms" in r["figures"]]
    names = [r["variant"] for r in rows] + ["vLLM piecewise (seed)", "vLLM full (seed)"]
    values = [r["figures"]["tpot_median_ms"] for r in rows] + [
        SEED_VLLM["piecewise"]["tpot_median_ms"],
        SEED_VLLM["full"]["tpot_median_ms"],
    ]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1))
    colors = ["tab:green" if n.startswith("full-and") else "tab:gray" if "seed" in n else "tab:blue" for n in names]
    ax.barh(names, values, color=colors)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.2f}", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("median TPOT (ms), lower is better")
    ax.set_title(
        "Seed workload: Qwen2.5-1.5B dims, bf16, 1,000-token prompts,\n100 new tokens, 1 request/s "
        "(vLLM's numbers: the seed's, their GPU, fp16)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def options(parser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="qwen2.5-1.5b", choices=sorted(CONFIGS))
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s (0: all at once)")
    parser.add_argument("--in-flight", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 32, 64, 128])
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--agreement-variants", default="full-and-piecewise")
    parser.add_argument(
        "--profile",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[],
        help="levels to profile (kernels and host time per step) before the sweep",
    )
    parser.add_argument("--ramp-prompt", type=int, default=PROMPT, help="ramp: tokens of each prompt")
    parser.add_argument("--ramp-output", type=int, default=OUTPUT, help="ramp: new tokens of each request")


def _env(variant: str, args) -> dict:
    """Ramp rows: empty caches of their own, their Triton compiles counted (``ramp.py``)."""
    return ramp.env(variant, args) if variant.startswith("ramp") else {}


def _ramp_variants() -> tuple:
    return tuple(
        f"ramp-{n}-{declared}{how}"
        for how in ("", "-inline", "-warm")
        for declared in ("declared", "undeclared")
        for n in (64, 128)
        if not (how == "-warm" and declared == "undeclared")
    ) + ("ramp-save",)


# fmt: off
SUITE = Suite("serving", "the serving engine: the seed's workload (TTFT, TPOT, ITL), a concurrency sweep beside its byte floor, a ramp",
              VARIANTS + _ramp_variants(), rows, options, default=("full-and-piecewise", "piecewise"), timeout=420, env=_env,
              smoke=["--device", "cpu", "--config", "tiny", "--requests", "4", "--rate", "0", "--in-flight", "1,3",
                     "--max-num-tokens", "32", "--variants", "full-and-piecewise", "--agreement-variants", ""])
# fmt: on
