"""The ``ramp`` workload of suite ``serving``: what a fresh process meets when traffic jumps at once.

    python -m benchmarks serving --variants ramp-64-declared,ramp-128-declared,ramp-64-undeclared,...

A fresh process per row (the harness's child), the engine at Qwen2.5-1.5B's dims (bf16) compiled as
the README shows (``extra_splitting_ops=[ATTENTION]``, with ``row_independent_ops=[ATTENTION]`` when
``declared``), ``warm_up()`` (which captures nothing), then two identical waves of N requests
submitted at once (1,000-token prompts, 100 new tokens, token budget 2,048: ``--ramp-prompt``,
``--ramp-output``, ``--max-num-tokens``): nothing captured up
front, every size the waves meet is captured as they meet it. Wave 1 pays for that; wave 2 is
the steady state. Per row: ``wave1_tok_s``, ``wave2_tok_s`` and their ratio; the longest decode-only
step of wave 1 against the median of wave 2's (``steady_step_median_ms``); ITL p99 of each wave;
what the waves' callers spent capturing and compiling (``process_stats``' ``request_path_capture_s``
and ``request_path_compile_s``, from after ``warm_up`` to the end); the captures made behind the
calls; the Triton kernels the process compiled during the waves (``triton_compiles.py``).

Variants ``ramp-<N>-<declared|undeclared>[-inline|-warm]``, and ``ramp-save``:

* empty Inductor and Triton caches of its own (a first deploy), unless ``-warm``;
* ``-inline``: ``capture_behind=False``, the reference (captures in the calls that meet a size);
* ``ramp-save`` writes the artifact (``piecewise_backend.save``, empty caches, declared) that the
  ``-warm`` rows load (``preload`` first, empty caches: a restart in a new container).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator

import torch

from benchmarks import triton_compiles
from toys import engine as toy


def env(variant: str, args) -> dict:
    """Empty Inductor and Triton caches of the row's own, and its Triton compiles counted."""
    folder = os.path.join(args.work, f"caches-{variant}")
    return {
        "TORCHINDUCTOR_CACHE_DIR": f"{folder}/inductor",
        "TRITON_CACHE_DIR": f"{folder}/triton",
        **triton_compiles.counted_env(f"{args.work}/triton-compiles-{variant}.log"),
    }


def _options(declared: bool, inline: bool) -> dict:
    options = {"extra_splitting_ops": [toy.ATTENTION]}
    if declared:
        options["row_independent_ops"] = [toy.ATTENTION]
    if inline:
        options["capture_behind"] = False
    return options


def _engine(model, forward, n: int, args, mark_dynamic) -> toy.Engine:
    per_request = -(-(args.ramp_prompt + args.ramp_output) // model.cfg.block_size)
    blocks = n * per_request + -(-args.max_num_tokens // model.cfg.block_size) + 8
    return toy.Engine(
        model,
        forward,
        max_num_tokens=args.max_num_tokens,
        max_num_seqs=n,
        num_blocks=blocks,
        device=args.device,
        dtype=torch.bfloat16 if args.device == "cuda" else torch.float32,
        mark_dynamic=mark_dynamic,
    )


def _counts() -> dict:
    import piecewise_backend

    stats = piecewise_backend.process_stats()
    return {k: stats[k] for k in ("request_path_capture_s", "request_path_compile_s", "captures_behind")}


def _wave(engine: toy.Engine, n: int, args, vocab: int, sync, workload) -> tuple[dict, list, float]:
    """One wave of ``n`` requests at once (the same ones each wave): its latencies, decode-only
    steps (ms), seconds."""
    engine.finished.clear()
    engine.steps.clear()
    began = time.perf_counter()
    done = engine.run(workload.requests(n, args.ramp_prompt, args.ramp_output, 0.0, vocab, seed=n))
    sync()
    seconds = time.perf_counter() - began
    decode = [s.seconds * 1e3 for s in engine.steps if s.num_prefill_tokens == 0 and s.num_decode > 0]
    return workload.latencies(done, began), decode, seconds


def _parse(variant: str) -> tuple[int, bool, str]:
    """(in flight, declared, how: empty / inline / save / warm) of a row's name."""
    if variant == "ramp-save":
        return 64, True, "save"
    parts = variant.split("-")
    return int(parts[1]), parts[2] == "declared", parts[3] if len(parts) > 3 else "empty"


def _warmed_engine(variant: str, args, workload) -> tuple[toy.Engine, int]:
    """The row's engine, compiled (or saved, or loaded) and warmed up; and N."""
    import piecewise_backend

    n, declared, how = _parse(variant)
    artifact = os.path.join(args.work, "ramp-engine.piecewise")
    if how == "warm":
        piecewise_backend.preload(artifact)  # the recipe's first line
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = workload.build(args.config, "full-and-piecewise", args.device, dtype)
    options = _options(declared, how == "inline")
    if how in ("save", "warm"):
        probe = _engine(model, None, n, args, "unbacked")
        with torch.inference_mode():  # as the engine calls
            if how == "save":
                forward = piecewise_backend.save(model.forward, probe.example_calls(), artifact, options=options)
            else:
                forward = piecewise_backend.load(artifact, model.forward, options=options)
        engine = _engine(model, forward, n, args, "unbacked" if how == "save" else False)
    else:
        engine = _engine(model, torch.compile(model, backend="piecewise", options=options), n, args, True)
    engine.warm_up(freeze_gc=True)
    return engine, n


def ramp(variant: str, args, workload) -> Iterator[dict]:
    """In the child: build, warm up, two waves; one row (graphs emulated on CPU: the tests).
    ``workload``: what builds the engine's model and its requests and times them (``serving``'s
    ``build``, ``requests``, ``latencies``), handed in so that this module imports none of it."""
    import piecewise_backend

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    with piecewise_backend.emulated_graphs(args.device == "cpu"):
        engine, n = _warmed_engine(variant, args, workload)
        sync()
        log = os.environ.get(triton_compiles.LOG, "")
        compiled_before, before = triton_compiles.compiled(log), _counts()
        first, first_steps, first_s = _wave(engine, n, args, engine.cfg.vocab, sync, workload)
        compiled_mid = triton_compiles.compiled(log)
        second, second_steps, second_s = _wave(engine, n, args, engine.cfg.vocab, sync, workload)
        after, compiled_after = _counts(), triton_compiles.compiled(log)
    _, declared, how = _parse(variant)
    tokens, steady = n * args.ramp_output, statistics.median(second_steps) if second_steps else None
    yield {
        "workload": "ramp",
        "in_flight": n,
        "declared": declared,
        "caches": {"empty": "empty", "inline": "empty", "save": "empty; writes the artifact", "warm": "artifact"}[how],
        "capture": "inline" if how == "inline" else "behind",
        "wave1_tok_s": round(tokens / first_s, 1),
        "wave2_tok_s": round(tokens / second_s, 1),
        "wave1_over_wave2": round(second_s / first_s, 3),
        "wave1_longest_step_ms": round(max(first_steps), 2) if first_steps else None,
        "steady_step_median_ms": round(steady, 2) if steady is not None else None,
        "wave1_itl_p99_ms": first["itl_p99_ms"],
        "wave2_itl_p99_ms": second["itl_p99_ms"],
        **{k: round(after[k] - before[k], 3) for k in after},
        "triton_compiles_during_waves": sum(compiled_after.values()) - sum(compiled_before.values()),
        "triton_compiles_wave2": sum(compiled_after.values()) - sum(compiled_mid.values()),
        "triton_compiled_during_waves": {
            k: v - compiled_before.get(k, 0) for k, v in compiled_after.items() if v > compiled_before.get(k, 0)
        },
        "wave1_decode_steps_over_10x": sum(1 for s in first_steps if steady and s > 10 * steady),
    }
