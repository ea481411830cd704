"""Where a Hugging Face decode step's time goes: ``generate()``'s own work, the forward's host path,
the forward's GPU time; eager beside this backend.

    python -m benchmarks.hf_step_breakdown --out step.json [--models qwen3-4L-512] [--cache static]
        [--batches 1 4] [--tokens 48] [--dtype bfloat16] [--profile]

Why: a shallow model (4 layers) can be slower through a compiled forward than eagerly although its
decode step is one CUDA graph; the per-token figure alone does not say which part costs. Per model,
cache, batch and variant (``hf_generate.py``'s models; torch's and transformers' defaults):

* ``ms_per_token``: as ``hf_generate.py`` measures it (the better of two runs after a warm-up);
* ``forward_host_us``: the median host time of one decode call of ``model.forward`` (from the call
  to its return, no synchronisation): Dynamo's entry, the backend's work and the launches;
* ``forward_gpu_us``: the median GPU time between CUDA events recorded around that call (a separate
  run, the events' own cost kept out of the others);
* ``rest_us``: ``ms_per_token`` less the forward's host time: ``generate()``'s own work per step and
  whatever GPU time is not hidden behind the host.

Variants: ``eager``; ``piecewise`` (``torch.compile(model.forward, backend="piecewise")``); and the
same under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` after the warm-up
(``piecewise+skip-guard-eval``, a user's choice the row names). ``--profile`` adds, per variant,
torch.profiler's ten busiest host ops over the timed run (``profile`` in the row).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import time
import warnings

import torch
import transformers

from benchmarks import hf_generate  # (models, the per-token clock)
from benchmarks.record import code_hash

VARIANTS = ("eager", "piecewise", "piecewise+skip-guard-eval")


class ForwardClock:
    """Wraps ``model.forward``: host time of each decode call, or (``events``) its GPU time between
    events; prefill calls (more than one position) pass through untimed."""

    def __init__(self, forward, events: bool):
        self.forward, self.events = forward, events
        self.host_us: list[float] = []
        self.pairs: list = []

    def __call__(self, *args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[-1] > 1:  # a prefill: not a decode step
            return self.forward(*args, **kwargs)
        if self.events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.forward(*args, **kwargs)
            end.record()
            self.pairs.append((start, end))
            return out
        begin = time.perf_counter()
        out = self.forward(*args, **kwargs)
        self.host_us.append((time.perf_counter() - begin) * 1e6)
        return out

    def gpu_us(self) -> list[float]:
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in self.pairs]


def _profile_table(run) -> list:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return [[e.key, e.count, round(e.self_cpu_time_total / max(e.count, 1), 1)] for e in rows]


def breakdown(key: str, cache: str, batches, tokens: int, dtype, device: str, profile: bool) -> list[dict]:
    model = hf_generate.build_model(key, device, dtype)
    model.generation_config.disable_compile = True
    eager_forward = model.forward
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
    g = torch.Generator().manual_seed(0)
    _, _, name, layers = hf_generate.model_config(key)
    rows = []
    for variant in VARIANTS:
        torch._dynamo.reset()
        forward = eager_forward if variant == "eager" else torch.compile(eager_forward, backend="piecewise")
        stance = (
            torch.compiler.set_stance(skip_guard_eval_unsafe=True)
            if variant.endswith("skip-guard-eval")
            else contextlib.nullcontext()
        )
        for batch in batches:
            ids = torch.randint(3, model.config.vocab_size, (batch, hf_generate.PROMPT), generator=g).to(device)
            row = {
                "model": name,
                "layers": layers,
                "cache": cache,
                "batch": batch,
                "variant": variant,
                "dtype": str(dtype).removeprefix("torch."),
                "tokens": tokens,
            }
            try:
                model.forward = forward
                for _ in range(2):  # compiles and captures (a reused static cache's prefill compiles anew)
                    hf_generate.run(model, ids, tokens, kwargs)
                with stance:
                    host = ForwardClock(forward, events=False)
                    model.forward = host
                    ms = min(hf_generate.run(model, ids, tokens, kwargs)[1] for _ in range(2))
                    forward_host = statistics.median(host.host_us)
                    row.update(
                        ms_per_token=round(ms, 3),
                        forward_host_us=round(forward_host, 1),
                        rest_us=round(ms * 1e3 - forward_host, 1),
                    )
                    if device == "cuda":  # a run of its own: the events' cost stays out of the times above
                        gpu = ForwardClock(forward, events=True)
                        model.forward = gpu
                        hf_generate.run(model, ids, tokens, kwargs)
                        row["forward_gpu_us"] = round(statistics.median(gpu.gpu_us()), 1)
                    if profile:
                        model.forward = forward
                        row["profile"] = _profile_table(lambda: hf_generate.run(model, ids, tokens, kwargs))
            except Exception as exc:  # a failing variant is a row too
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            model.forward = eager_forward
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="+", default=["qwen3-4L-512"])
    parser.add_argument("--cache", default="static", choices=["static", "dynamic"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    rows = []
    for key in args.models:
        rows += breakdown(
            key, args.cache, args.batches, args.tokens, getattr(torch, args.dtype), args.device, args.profile
        )
        pathlib.Path(args.out).write_text(
            json.dumps(
                {
                    "code_hash": code_hash(),
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "hf_step_breakdown": rows,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main()
