"""A serving engine's model under continuous batching: start-up, graph memory, tokens/s, inter-token latency.

    python -m benchmarks.serving --out serving.json [--variants piecewise,piecewise-all] [--starts cold,warm]
    python -m benchmarks.serving --out serving.json --figure serving_itl.png            # its figure
    python -m benchmarks.serving --out /tmp/s.json --device cpu --config tiny --requests 6   # smoke test

The engine is ``toys/engine.py`` (paged KV cache, attention a custom op over a forward context,
chunked prefill under a token budget, greedy sampling outside the compiled model), on Qwen2.5-1.5B's
dimensions with random weights in bf16, every step piecewise (``graph_mode="piecewise"``: what this
benchmark has always timed; the engine's full decode graphs are ``seed_workload.py``'s). The trace is seeded: ``--requests`` requests, prompts of
32-1024 tokens and outputs of 16-256, Poisson arrivals at ``--rate`` requests/s (0: all at once).

Variants (one child process each, with its own timeout, per start):

* ``eager``: the model as it is;
* ``inductor``: ``torch.compile`` default;
* ``reduce-overhead``: ``torch.compile(mode="reduce-overhead")`` (with the attention op tagged
  ``cudagraph_unsafe``, its best chance); how it fails is recorded if it does;
* ``piecewise``: ``backend="piecewise"``, the op named in ``extra_splitting_ops``, defaults: lazy;
  (every variant's engine first warms up as vLLM's does: a step at the full token budget and a
  one-token decode step, which compile before the first request)
* ``piecewise-all``: the same with ``eager_capture_sizes="all"`` (vLLM's way: every size up front);
* ``piecewise-cap8``: lazy with ``max_captured_sizes=8``: captured sizes follow the traffic.

Per row: ``startup_s`` (child start, before ``import torch``, to the first output token; ``cold``:
fresh Inductor/Triton caches, ``warm``: the caches of the cold run), ``capture_s`` (of it and after,
the backend's capture seconds), ``graph_pool_mib``, ``captures`` (sizes captured), ``tokens_per_s``
(output tokens over the run), ``itl_p50_ms``/``itl_p99_ms`` (gaps between a request's tokens),
``itl_p99_first10s_ms`` (those in the run's first 10 s), ``worst_capture_stall_ms`` (the longest
step that captured a size, less the median step), ``rides`` (calls that replayed a larger captured
graph, padded, while their own size waited: ``defer_captures``), ``gc_pause_ms_max`` (the longest
collector pause in the run; the engine freezes what start-up made), ``replaced`` (sizes replaced,
capture following traffic) and ``token_agreement`` (the share of requests whose tokens equal eager's, in fp32 on a
shorter trace, ``--agreement-requests``, checked by the cold run: bf16 rows are timed, fp32 tokens
compared).

The graph memory estimate on this engine: ``graph_memory.py``.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # before torch is imported: start-up counts the import

import argparse
import dataclasses
import gc
import json
import pathlib
import statistics
import sys
import tempfile

import torch

from benchmarks.child_rows import child_row, report
from toys import engine as toy

VARIANTS = ("eager", "inductor", "reduce-overhead", "piecewise", "piecewise-all", "piecewise-cap8")
CONFIGS = {"tiny": toy.TINY, "qwen2.5-1.5b": toy.QWEN2_5_1_5B}
TRACE = {"prompt": (32, 1024), "output": (16, 256)}
AGREEMENT_TRACE = {"prompt": (32, 256), "output": (16, 64)}  # the fp32 check's shorter trace
SMALL_TRACE = {"prompt": (4, 40), "output": (2, 12)}  # for the tiny config


def compiled(model, variant: str):
    """What the engine calls for ``variant``: the model, or a ``torch.compile`` of it."""
    if variant == "eager":
        return model
    if variant == "inductor":
        return torch.compile(model)
    if variant == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    options = {"extra_splitting_ops": [toy.ATTENTION]}
    if variant == "piecewise-all":
        options["eager_capture_sizes"] = "all"
    if variant == "piecewise-cap8":
        options["max_captured_sizes"] = 8
    return torch.compile(model, backend="piecewise", options=options)


def build(config: str, variant: str, device: str, dtype):
    cfg = CONFIGS[config]
    if variant == "reduce-overhead":
        cfg = dataclasses.replace(cfg, attention_op=toy.TAGGED_ATTENTION)
    torch.manual_seed(0)
    with torch.device(device):
        model = toy.EngineModel(cfg)
    return model.init_weights_().to(device, dtype).eval()


def engine_for(model, forward, device: str, dtype, args) -> toy.Engine:
    longest = TRACE["prompt"][1] + TRACE["output"][1] if args.config != "tiny" else 64
    blocks = args.max_num_seqs * -(-longest // model.cfg.block_size) + 8
    return toy.Engine(
        model,
        forward,
        max_num_tokens=args.max_num_tokens,
        max_num_seqs=args.max_num_seqs,
        num_blocks=blocks,
        device=device,
        dtype=dtype,
        graph_mode="piecewise",
    )


def trace(args, n: int, seed: int = 0, short: bool = False):
    shape = SMALL_TRACE if args.config == "tiny" else AGREEMENT_TRACE if short else TRACE
    return toy.seeded_trace(n, seed=seed, vocab=CONFIGS[args.config].vocab, rate=args.rate, **shape)


class CaptureWatch:
    """Wraps the engine's forward: which steps captured a size (the backend's capture events)."""

    def __init__(self, forward):
        import piecewise_backend

        self.forward, self.graphs = forward, piecewise_backend.compiled_graphs
        self.capturing_steps: list[int] = []
        self.step = 0

    def _events(self) -> int:
        return sum(len(g.stats.events) for g in self.graphs())

    def __call__(self, *args):
        before = self._events()
        out = self.forward(*args)
        if self._events() != before:
            self.capturing_steps.append(self.step)
        self.step += 1
        return out


def percentile(values: list, q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def backend_totals() -> dict:
    import piecewise_backend

    graphs = piecewise_backend.compiled_graphs()
    stats = piecewise_backend.process_stats()
    return {
        "capture_s": round(stats["capture_seconds"], 2),
        "graph_pool_mib": round(stats["pool_bytes"] / 2**20, 1),
        "captures": stats["captured_sizes"],
        "replays": stats["replays"],
        "ungraphed_runs": stats["ungraphed_runs"],
        "rides": stats["rides"],
        "failed_captures": sum(g.stats.failed_captures for g in graphs),
        "replaced": sum(len(g.stats.replaced_keys) for g in graphs),
    }


class GcPauses:
    """The collector's pauses during the timed run (Python's ``gc.callbacks``): a pause of tens
    of ms in a process full of compile-time objects would show as inter-token latency."""

    def __init__(self):
        self.pauses: list[float] = []
        self._began = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.append((time.perf_counter() - self._began) * 1e3)

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def serve(args, variant: str, device: str) -> dict:
    """One variant's timed run (bf16 on CUDA); the row without ``token_agreement``."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build(args.config, variant, device, dtype)
    watch = CaptureWatch(compiled(model, variant))
    engine = engine_for(model, watch, device, dtype, args)
    engine.warm_up(freeze_gc=True)  # compiles (and, for piecewise-all, captures every size): start-up
    warm_up_steps = watch.step
    with GcPauses() as gc_pauses:
        done = engine.run(trace(args, args.requests), realtime=args.rate > 0)
    if device == "cuda":
        torch.cuda.synchronize()
    first_token = min(r.token_times[0] for r in done)
    start, end = engine.steps[0].start, max(r.token_times[-1] for r in done)
    gaps = [(b - start, (b - a) * 1e3) for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    steps = [s.seconds * 1e3 for s in engine.steps]
    median = statistics.median(steps)
    stalls = [steps[i - warm_up_steps] - median for i in watch.capturing_steps if i >= warm_up_steps]
    return {
        "variant": variant,
        "startup_s": round(first_token - _STARTED, 2),
        "tokens_per_s": round(sum(len(r.output) for r in done) / (end - start), 1),
        "itl_p50_ms": _ms(percentile([g for _, g in gaps], 0.5)),
        "itl_p99_ms": _ms(percentile([g for _, g in gaps], 0.99)),
        "itl_p99_first10s_ms": _ms(percentile([g for t, g in gaps if t <= 10.0], 0.99)),
        "worst_capture_stall_ms": _ms(max(stalls, default=0.0)),
        "steps": len(steps),
        "gc_pause_ms_max": _ms(max(gc_pauses.pauses, default=0.0)),
        "gc_pauses": len(gc_pauses.pauses),
        "step_ms_median": _ms(median),
        "output_tokens": sum(len(r.output) for r in done),
        **backend_totals(),
        "itl_over_time": [(round(t, 3), round(g, 2)) for t, g in gaps[:: max(1, len(gaps) // 2000)]],
    }


def agreement(args, variant: str, device: str) -> float:
    """The share of requests whose tokens equal the eager engine's, fp32, on a short trace."""
    model = build(args.config, variant, device, torch.float32)
    requests = args.agreement_requests

    def tokens(forward):
        engine = engine_for(model, forward, device, torch.float32, args)
        return [r.output for r in engine.run(trace(args, requests, seed=1, short=True))]

    expected = tokens(model)
    got = tokens(compiled(model, variant))
    return round(sum(a == b for a, b in zip(got, expected)) / len(expected), 3)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def child(args) -> None:
    """One (variant, start) in this process: print its row as JSON."""
    device = args.device
    try:
        row = serve(args, args.variant, device)
        torch._dynamo.reset()
        if args.start != "warm":  # the cold run checks it; the warm one times the same code
            row["token_agreement"] = 1.0 if args.variant == "eager" else agreement(args, args.variant, device)
    except Exception as exc:  # a variant that fails is a result: say how
        row = {"variant": args.variant, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    report({**row, "start": args.start, "config": args.config})


def figure(rows: list[dict], png: pathlib.Path) -> None:
    """Inter-token latency over the run, lazy capture beside up-front capture (the cold runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for row in rows:
        if (
            row.get("start") == "cold"
            and row.get("variant") in ("piecewise", "piecewise-all")
            and "itl_over_time" in row
        ):
            t, ms = zip(*row["itl_over_time"]) if row["itl_over_time"] else ((), ())
            ax.scatter(t, ms, s=3, alpha=0.5, label=f"{row['variant']} (p99 {row['itl_p99_ms']} ms)")
    ax.set_yscale("log")
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_title("Serving engine (Qwen2.5-1.5B dims, bf16): lazy vs up-front capture")
    ax.legend(loc="upper right", markerscale=4)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="qwen2.5-1.5b", choices=sorted(CONFIGS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--starts", default="cold,warm")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--agreement-requests", type=int, default=12)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--max-num-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--child-timeout", type=int, default=300)
    parser.add_argument("--figure", help="write the ITL-over-time figure of --out's rows to this PNG and stop")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # set in the child processes
    parser.add_argument("--start", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        return child(args)
    out = pathlib.Path(args.out)
    rows = json.loads(out.read_text()).get("serving", []) if out.exists() else []
    if args.figure:
        return figure(rows, pathlib.Path(args.figure))
    passed = [a for a in sys.argv[1:]]
    for variant in args.variants.split(","):
        with tempfile.TemporaryDirectory() as caches:
            for start in args.starts.split(","):
                cmd = [sys.executable, "-m", __spec__.name, *passed, "--variant", variant, "--start", start]
                row = child_row(cmd, args.child_timeout, caches)
                if "error" in row:
                    row = {"variant": variant, "start": start, **row}
                rows = [r for r in rows if (r.get("variant"), r.get("start")) != (variant, start)] + [row]
                print(json.dumps({k: v for k, v in row.items() if k != "itl_over_time"}), flush=True)
                out.write_text(json.dumps({"serving": rows}, indent=1) + "\n")  # partial results survive a cut


if __name__ == "__main__":
    main()
