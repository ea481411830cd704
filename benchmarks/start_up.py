"""Suite ``startup``: start-up routes on the serving engine: eager, Inductor cold, no Inductor, a warm
process from a saved artifact, serve-first.

    python -m benchmarks startup [--variants eager,inductor,save,warm] [--requests 3]
    python -m benchmarks startup --smoke        # CPU: the tiny config

``toys/engine.py`` at Qwen2.5-1.5B's dimensions (random weights, bf16), each variant in a fresh child
process, each with an empty Inductor/Triton cache folder of its own unless said otherwise. The engine
marks the token count unbacked (``mark_dynamic="unbacked"``): one graph for every count, 1 included,
so Dynamo traces once (backed, a step of one token is a second graph and a second trace). Start-up
is process start (before ``import torch``) to the engine warmed up (vLLM's dummy runs: a step at the
token budget and a one-token decode step, un-graphed: the first requests capture what they need).
Per row:

* ``trace_s``: Dynamo's tracing (its compile time less the backend's); ``compile_s``: Inductor's
  compile time inside the backend; ``capture_s``: the captures (piecewise and full) until warmed up;
* ``tpot_median_ms``: then ``--requests`` requests one at a time (batch 1, 1,000-token prompts, 100
  new tokens): the decode step's time per token.

Variants:

* ``eager``;
* ``dynamo-only``: ``torch.compile(backend="eager")``: Dynamo's trace and nothing else (no split, no
  graphs): the floor under every route through ``torch.compile``, this backend's included;
* ``inductor``: this backend, its pieces compiled by Inductor (``compiler="inductor"``), cold;
* ``no-inductor``: ``compiler="eager"``: the pieces' traced code, captured the same way, cold;
* ``save`` then ``warm``: the first process builds through ``piecewise_backend.save`` (Inductor, cold)
  and writes the artifact (the package's Triton kernels added as its warm-up launches them); the
  second (``warm``, a fresh process, its Inductor and Triton caches empty: a fresh container) calls
  ``piecewise_backend.preload`` first, then builds the model and loads it: no trace, no compile,
  no Triton compile (``triton_compiles`` counts those of the process and its compile workers);
* ``serve-first``: ``compiler="eager_then_inductor"``: serving starts on the traced code while
  Inductor compiles behind; requests keep coming one at a time until both graphs switched and
  ``--after`` more finished: ``tpot_before_ms`` (while compiling), ``tpot_median_ms`` (after),
  ``switched_s`` (process start to the last switch), ``switch_step_ms`` (the slowest step of the
  ones that switched and captured again). That tokens stay right across the switch is checked in
  fp32, where eager's tokens are the reference (``tests/test_start_up.py``, ``tests/test_cuda_start_up.py``).
  ``behind``: per graph, when (seconds from process start) its pieces were submitted, the workers
  that compiled them were ready, the first piece started, the last came back, the code was loaded
  and the graph switched. ``$PIECEWISE_COMPILE_WORKERS`` sets the number of workers;
* ``serve-first-prestarted``: the same, with ``piecewise_backend.start_compile_workers()`` called
  before the model is built (the workers' start overlaps the model's load and Dynamo's trace).
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # before torch is imported: start-up counts the import
_STARTED_WALL = time.time()  # the same moment on the clock the compile workers share

import contextlib
import os
import statistics
import sys
from collections.abc import Iterator

import torch

from benchmarks import triton_compiles
from benchmarks.harness import Suite
from benchmarks.serving import CONFIGS, build
from toys import engine as toy

VARIANTS = (
    "eager",
    "dynamo-only",
    "inductor",
    "no-inductor",
    "save",
    "warm",
    "serve-first",
    "serve-first-prestarted",
)
COMPILERS = {
    "inductor": "inductor",
    "no-inductor": "eager",
    "save": "inductor",
    "warm": "inductor",
    "serve-first": "eager_then_inductor",
    "serve-first-prestarted": "eager_then_inductor",
}
PROMPT, OUTPUT = 1000, 100


def _options(variant: str) -> dict:
    return {
        "extra_splitting_ops": [toy.ATTENTION],
        "row_independent_ops": [toy.ATTENTION],
        "compiler": COMPILERS[variant],
    }


def _engine(model, forward, args, device, dtype, mark_dynamic="unbacked") -> toy.Engine:
    blocks = 4 * -(-(PROMPT + OUTPUT) // model.cfg.block_size) + -(-args.max_num_tokens // model.cfg.block_size) + 8
    return toy.Engine(
        model,
        forward,
        max_num_tokens=args.max_num_tokens,
        max_num_seqs=1,
        num_blocks=blocks,
        device=device,
        dtype=dtype,
        mark_dynamic=mark_dynamic,
    )


def _forward(model, variant: str, args, engine_examples):
    """What the engine calls, and the seconds ``load`` took (warm)."""
    import piecewise_backend

    if variant == "eager":
        return model, 0.0
    if variant == "dynamo-only":
        return torch.compile(model, backend="eager"), 0.0
    if variant in ("save", "warm"):
        began = time.perf_counter()
        examples = engine_examples() if variant == "save" else None  # normal tensors, as the engine's
        with torch.inference_mode():  # the engine calls under it: the saved guards record the grad mode
            if variant == "save":
                fn = piecewise_backend.save(model.forward, examples, args.artifact, options=_options(variant))
            else:
                fn = piecewise_backend.load(args.artifact, model.forward, options=_options(variant))
        return fn, time.perf_counter() - began
    return torch.compile(model, backend="piecewise", options=_options(variant)), 0.0


def _times() -> dict:
    """Dynamo's trace (its compile, or ``aot_compile``'s capture, less the backend's build), the
    backend's build, Inductor's compile within it and the captures so far, in seconds."""
    from torch._dynamo.utils import compilation_time_metrics as metrics

    dynamo = sum(metrics.get("_compile.compile_inner", [])) + sum(metrics.get("fullgraph_capture", []))
    out = {"trace_s": dynamo - sum(metrics.get("OutputGraph.call_user_compiler", []))}
    if "piecewise_backend" in sys.modules:
        import piecewise_backend

        graphs = piecewise_backend.compiled_graphs()
        build = sum(g.stats.build_seconds for g in graphs if not g.stats.loaded)
        out = {
            "trace_s": max(0.0, dynamo - build),
            "build_s": build,
            "compile_s": sum(g.stats.inductor_seconds for g in graphs),
            "capture_s": sum(e.seconds for g in graphs for e in g.stats.events),
        }
    return {k: round(v, 2) for k, v in out.items()}


def _gpu_mib_by_process() -> dict | None:
    """Device memory per process (nvidia-smi), this one and the compile workers: what a worker's
    CUDA context costs a server."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[field.strip() for field in line.split(",")] for line in out.strip().splitlines()]
    return {
        ("self" if int(row[0]) == os.getpid() else row[0]): int(row[1])
        for row in rows
        if len(row) == 2 and row[0].isdigit() and row[1].isdigit()
    }  # "[N/A]" in some containers


def _one_at_a_time(engine, n: int, vocab: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    engine.finished.clear()  # run() returns every finished request: only these
    return engine.run(
        [toy.Request(i, torch.randint(0, vocab, (PROMPT,), generator=g).tolist(), OUTPUT) for i in range(n)]
    )


def _tpots(done: list) -> list:
    return [(r.token_times[-1] - r.token_times[0]) * 1e3 / (len(r.token_times) - 1) for r in done]


def _serve_across_the_switch(engine, args, vocab: int) -> dict:
    """Requests one at a time until every graph switched to Inductor's code and ``--after`` more ran."""
    import piecewise_backend

    before, after, seed = [], [], 0
    deadline = time.perf_counter() + args.switch_timeout
    while len(after) < args.after and time.perf_counter() < deadline:
        graphs = piecewise_backend.compiled_graphs()
        switched = graphs and all(g.stats.code_switches for g in graphs if g.plan.pieces)
        (after if switched else before).extend(_one_at_a_time(engine, 1, vocab, seed))
        seed += 1
    graphs = piecewise_backend.compiled_graphs()
    at = [g.stats.switched_at for g in graphs if g.stats.code_switches]
    steps = [s.seconds * 1e3 for s in engine.steps if any(s.start <= t <= s.start + s.seconds for t in at)]
    return {
        "tpot_before_ms": round(statistics.median(_tpots(before)), 2) if before else None,
        "tpot_median_ms": round(statistics.median(_tpots(after)), 2) if after else None,
        "switched_s": round(max(at) - _STARTED, 2) if len(at) == len([g for g in graphs if g.plan.pieces]) else None,
        "switch_step_ms": round(max(steps), 2) if steps else None,
        "behind": [
            {step: round(at - _STARTED_WALL, 2) for step, at in g.stats.behind_timeline.items()}
            for g in graphs
            if g.stats.behind_timeline
        ],
        "requests_before": len(before),
        "requests_after": len(after),
        **_times(),
    }


@contextlib.contextmanager
def _profiled(args, key: str, into: dict | None = None):
    """``--profile``: where a phase's time goes (cProfile's top entries by cumulative time) into ``into[key]``."""
    into = {} if into is None else into
    if not args.profile:
        yield into
        return
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield into
    finally:
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.profile)
        into[key] = [line.strip() for line in text.getvalue().splitlines() if line.strip()[:1].isdigit()]


def rows(variant: str, args) -> Iterator[dict]:
    """In the child (a fresh process, its caches as ``CACHES`` says): the variant's one row."""
    args.artifact = os.path.join(args.work, "engine.piecewise")  # save writes it, warm reads it
    try:
        device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
        if variant == "warm":
            import piecewise_backend

            piecewise_backend.preload(args.artifact)  # the recipe's first line: reading overlaps the build
        if variant == "serve-first-prestarted":
            import piecewise_backend

            piecewise_backend.start_compile_workers()  # the recipe's first line: workers start as the model loads
        model = build(args.config, variant, device, dtype)
        probe = _engine(model, None, args, device, dtype)
        with _profiled(args, "profile_load") as profiles:
            forward, load_s = _forward(model, variant, args, probe.example_calls)
        engine = _engine(model, forward, args, device, dtype, mark_dynamic=variant != "warm" and "unbacked")
        with _profiled(args, "profile_warm_up", profiles):
            engine.warm_up(freeze_gc=True)
        if device == "cuda":
            torch.cuda.synchronize()
        row = {
            "caches": CACHES[variant],
            "startup_s": round(time.perf_counter() - _STARTED, 2),
            **_times(),
            "load_s": round(load_s, 2),
            "load_split": {k: round(v, 3) for k, v in getattr(forward, "load_seconds", {}).items()},
            **profiles,
        }
        if variant.startswith("serve-first"):
            from piecewise_backend.persist.compile_behind import worker_count

            row.update(
                _serve_across_the_switch(engine, args, model.cfg.vocab),
                compile_workers=worker_count(),
                gpu_mib_by_process=_gpu_mib_by_process(),
            )
        else:
            row["tpot_median_ms"] = round(
                statistics.median(_tpots(_one_at_a_time(engine, args.requests, model.cfg.vocab, 0))), 2
            )
        from torch._dynamo.utils import counters

        row["dynamo_frames"] = sum(counters["frames"].values())
        compiles = triton_compiles.compiled(os.environ.get(triton_compiles.LOG, ""))
        row["triton_compiles"], row["triton_compiled"] = sum(compiles.values()), compiles
        row["inductor_cache"] = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    except Exception as exc:  # a variant that fails is a result: say how
        row = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    yield row


CACHES = {
    "eager": "none",
    "dynamo-only": "none (nothing compiled)",
    "inductor": "cold (empty Inductor/Triton caches)",
    "no-inductor": "cold (empty caches)",
    "save": "cold (empty caches); writes the artifact",
    "warm": "the artifact `save` wrote (preload first); empty Inductor/Triton caches",
    "serve-first": "cold (empty caches)",
    "serve-first-prestarted": "cold (empty caches)",
}


def options(parser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="qwen2.5-1.5b", choices=sorted(CONFIGS))
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--after", type=int, default=3, help="serve-first: requests after the switch")
    parser.add_argument("--switch-timeout", type=int, default=240)
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--profile", type=int, default=0, help="the top N functions of load and warm-up")


# fmt: off
SUITE = Suite("startup", "the serving engine's start-up per route (eager, Inductor cold, a warm artifact in a fresh container...)",
              VARIANTS, rows, options, default=("eager", "inductor", "save", "warm"), fresh_caches=True, timeout=300,
              env=lambda variant, args: triton_compiles.counted_env(f"{args.work}/triton-compiles-{variant}.log"),
              smoke="--device cpu --config tiny --requests 1 --max-num-tokens 32 --variants eager,no-inductor".split())
# fmt: on
