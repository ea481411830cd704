"""A Hugging Face model's first ``generate()`` calls through the backend: cold, warm, at a new batch
size and at a new length.

    python -m benchmarks.hf_startup --out startup.json [--models qwen3-28L-1.5b] [--caches dynamic static]
    python -m benchmarks.hf_startup --out /tmp/s.json --device cpu --models tiny --dtype float32   # smoke test

What a server feels: how long before the first tokens, and whether a request of a new shape stalls.
Per model (``hf_generate.py``'s keys) and cache, one child process each (own timeout), after the
model is built (its weights' time left out):

* ``cold_s``: fresh Inductor/Triton caches; start-up as the README's recipe has it:
  ``torch.compile(model.forward, backend="piecewise", dynamic=True)`` (the dynamic cache; the static
  cache without ``dynamic``, ``max_cache_len`` 256), then ``generate()`` at batch 1 and at batch 2
  (4 new tokens each: Dynamo keeps size 1 apart);
* ``warm_s``: the same in a new process with the cold run's caches; then, in that process,
  ``new_batch_s``: the first ``generate()`` at batch 4 (16 tokens), and ``new_length_s``: then at
  batch 4 with 48 tokens (``compiles_after_start``: Dynamo graphs compiled by those two);
* ``no_inductor_cold_s``: fresh caches, the backend with ``compiler="eager"`` (the pieces' traced code,
  captured the same way), the same start-up;
* ``inductor_cold_s``: fresh caches, ``torch.compile`` default (Inductor), the same start-up;
* ``--skip-inductor``: no ``inductor_cold_s`` (a start known to outlast ``--child-timeout``);
* ``--specialize-float``: all three with ``torch._dynamo.config.specialize_float=True``.

Rows ``{model, layers, cache, cold_s, warm_s, new_batch_s, new_length_s, inductor_cold_s, ...}``, with
the backend's build time and its Inductor share (``backend_build_s_*``, ``backend_inductor_s_*``; the
rest is its rewrite, split and fake run), its Inductor compiles at start-up, and each start's
breakdown (``dynamo_frames_warm``, ``dynamo_compile_s_warm``, ``backend_call_s_warm``, ...);
``record.py --hf-startup`` stamps them with the code hash.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
import warnings

import torch

from benchmarks import hf_generate  # (its model keys and builder)
from benchmarks.child_rows import child_row, report

MAX_CACHE = 256  # the static cache's length: no generate() below outgrows it
START = ((1, 4), (2, 4))  # (batch, new tokens) of the start-up generate() calls
NEW_BATCH, NEW_LENGTH = (4, 16), (4, 48)


def first_calls(
    key: str,
    cache: str,
    backend: str,
    device: str,
    dtype: torch.dtype,
    after_start: bool,
    specialize_float: bool = False,
) -> dict:
    """Build ``key``, compile its forward with ``backend`` ("piecewise" or "inductor"), time the
    start-up calls and, ``after_start``, the first call at a new batch size and at a new length.
    ``specialize_float``: Dynamo keeps Python floats constants (the README's advice with ``dynamic=True``)."""
    from torch._dynamo.utils import counters

    import piecewise_backend

    if specialize_float:  # else torch's default, whatever it is
        torch._dynamo.config.specialize_float = True

    model = hf_generate.build_model(key, device, dtype)
    model.generation_config.disable_compile = True  # transformers' own compile of the static cache: not this
    dynamic = True if cache == "dynamic" else None
    options = (
        {"backend": "piecewise"}
        if backend == "piecewise"
        else {"backend": "piecewise", "options": {"compiler": "eager"}}
        if backend == "piecewise-eager"
        else {}
    )
    model.forward = torch.compile(model.forward, dynamic=dynamic, **options)
    kwargs = {"cache_implementation": "static", "max_cache_len": MAX_CACHE} if cache == "static" else {}
    g = torch.Generator().manual_seed(0)
    compile_before = compile_totals()

    def generate(batch: int, tokens: int) -> float:
        ids = torch.randint(3, model.config.vocab_size, (batch, hf_generate.PROMPT), generator=g).to(device)
        start = time.perf_counter()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    row = {"start_s": round(sum(generate(*call) for call in START), 2)}
    if after_start:
        before = counters["stats"]["unique_graphs"]
        row["new_batch_s"] = round(generate(*NEW_BATCH), 2)
        row["new_length_s"] = round(generate(*NEW_LENGTH), 2)
        row["compiles_after_start"] = counters["stats"]["unique_graphs"] - before
    row.update({name: round(value - compile_before[name], 2) for name, value in compile_totals().items()})
    if backend.startswith("piecewise"):
        stats = piecewise_backend.process_stats()
        graphs = piecewise_backend.compiled_graphs()
        row.update(
            capture_s=round(stats["capture_seconds"], 2),
            backend_build_s=round(sum(g.stats.build_seconds for g in graphs), 2),
            backend_inductor_s=round(sum(g.stats.inductor_seconds for g in graphs), 2),
            inductor_compiles=sum(g.stats.inductor_compiles for g in graphs),
        )
    return row


def compile_totals() -> dict:
    """Where compile time went so far in this process, from Dynamo's own counters and timers:
    ``dynamo_frames`` (graphs Dynamo compiled), ``dynamo_traces`` (its traces: one more per restart,
    e.g. ``TensorifyScalarRestartAnalysis`` for a float Inductor cannot take), ``dynamo_compile_s``
    (their compile, the backend's included) and ``backend_call_s`` (the backend's share). The
    difference of the last two is Dynamo's tracing and guards, which no cache of torch 2.11's skips
    for a custom backend."""
    from torch._dynamo.utils import compilation_time_metrics as metrics
    from torch._dynamo.utils import counters

    def total(name: str) -> float:
        return sum(metrics.get(name, ()))  # timer names as on torch 2.11-2.13

    return {
        "dynamo_frames": counters["stats"]["unique_graphs"],
        "dynamo_traces": len(metrics.get("bytecode_tracing", ())),
        "dynamo_compile_s": total("_compile.compile_inner"),
        "backend_call_s": total("OutputGraph.call_user_compiler"),
    }


def _child(args, key: str, cache: str, backend: str, after_start: bool, caches: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        __spec__.name,
        "--out",
        "-",
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--child",
        json.dumps([key, cache, backend, after_start, args.specialize_float]),
    ]
    return child_row(cmd, args.child_timeout, caches)


def startup_row(args, key: str, cache: str) -> dict:
    _, _, name, layers = hf_generate.model_config(key)
    row: dict = {
        "model": name,
        "layers": layers,
        "cache": cache,
        "dtype": args.dtype,
        "specialize_float": args.specialize_float,
    }
    with tempfile.TemporaryDirectory() as caches:
        cold = _child(args, key, cache, "piecewise", False, caches)
        warm = _child(args, key, cache, "piecewise", True, caches)
    with tempfile.TemporaryDirectory() as caches:  # the pieces' traced code, no Inductor (compiler="eager")
        no_inductor = _child(args, key, cache, "piecewise-eager", False, caches)
    inductor = {"error": "not run (--skip-inductor)"}
    if not args.skip_inductor:
        with tempfile.TemporaryDirectory() as caches:
            inductor = _child(args, key, cache, "inductor", False, caches)
    parts = (("cold", cold), ("warm", warm), ("no_inductor", no_inductor), ("inductor", inductor))
    errors = {part: r["error"] for part, r in parts if "error" in r}
    row.update(
        cold_s=cold.get("start_s"),
        warm_s=warm.get("start_s"),
        new_batch_s=warm.get("new_batch_s"),
        new_length_s=warm.get("new_length_s"),
        inductor_cold_s=inductor.get("start_s"),
        compiles_after_start=warm.get("compiles_after_start"),
        capture_s=warm.get("capture_s"),
        backend_build_s_warm=warm.get("backend_build_s"),
        backend_build_s_cold=cold.get("backend_build_s"),
        backend_inductor_s_warm=warm.get("backend_inductor_s"),
        backend_inductor_s_cold=cold.get("backend_inductor_s"),
        inductor_compiles=cold.get("inductor_compiles"),
        no_inductor_cold_s=no_inductor.get("start_s"),
        backend_build_s_no_inductor=no_inductor.get("backend_build_s"),
    )
    for part, r in parts:  # where each start's time went
        row.update(
            {
                f"{name}_{part}": r.get(name)
                for name in ("dynamo_frames", "dynamo_traces", "dynamo_compile_s", "backend_call_s")
            }
        )
    if errors:
        row["errors"] = errors
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="+", default=["qwen3-28L-1.5b"])
    parser.add_argument("--caches", nargs="+", default=["dynamic", "static"], choices=["dynamic", "static"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--child-timeout", type=int, default=240)
    parser.add_argument(
        "--specialize-float",
        action="store_true",
        help="torch._dynamo.config.specialize_float=True in every start (Inductor's too)",
    )
    parser.add_argument(
        "--skip-inductor",
        action="store_true",
        help="leave Inductor's cold start out (inductor_cold_s null; e.g. when it is known to time out)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # [key, cache, backend, after_start, specialize_float]
    args = parser.parse_args()
    if args.child:
        key, cache, backend, after_start, specialize_float = json.loads(args.child)
        row = first_calls(key, cache, backend, args.device, getattr(torch, args.dtype), after_start, specialize_float)
        report(row)
        return
    rows = []
    for key in args.models:
        for cache in args.caches:
            rows.append(startup_row(args, key, cache))
            print(json.dumps(rows[-1]), flush=True)
            pathlib.Path(args.out).write_text(json.dumps({"hf_startup": rows}, indent=1) + "\n")  # partial rows survive


if __name__ == "__main__":
    main()
