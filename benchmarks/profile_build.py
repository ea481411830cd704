"""Where the backend's own build time goes on a Hugging Face model's first ``generate()``: a cProfile
of :func:`piecewise_backend.backend.build` only (Dynamo's tracing left out).

    python -m benchmarks.profile_build [--model qwen3-8L-1.5b] [--cache static] [--device cuda] [--top 40] [--save F]

Prints the build time, its Inductor share and the backend's functions by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
import warnings

import torch

from benchmarks import hf_generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8L-1.5b")
    p.add_argument("--cache", default="static", choices=("static", "dynamic"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--save", help="also write the cProfile stats to this file (pstats format)")
    args = p.parse_args()
    import piecewise_backend
    from piecewise_backend import backend

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = hf_generate.build_model(args.model, args.device, dtype)
    model.generation_config.disable_compile = True
    model.forward = torch.compile(model.forward, backend="piecewise", dynamic=True if args.cache == "dynamic" else None)
    kwargs = {"cache_implementation": "static", "max_cache_len": 256} if args.cache == "static" else {}
    profile, build = cProfile.Profile(), backend.build

    def profiled_build(*a, **k):
        profile.enable()
        try:
            return build(*a, **k)
        finally:
            profile.disable()

    backend.build = profiled_build
    ids = torch.randint(3, model.config.vocab_size, (1, hf_generate.PROMPT), device=args.device)
    emulate = piecewise_backend.emulated_graphs(args.device == "cpu")  # the CUDA path on CPU too
    start = time.perf_counter()
    with emulate, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, **kwargs)
    graphs = piecewise_backend.compiled_graphs()
    print(
        f"generate {time.perf_counter() - start:.2f} s; build {sum(g.stats.build_seconds for g in graphs):.2f} s, "
        f"Inductor {sum(g.stats.inductor_seconds for g in graphs):.2f} s, "
        f"{sum(g.stats.inductor_compiles for g in graphs)} compiles, {len(graphs)} graphs",
        flush=True,
    )
    if args.save:
        profile.dump_stats(args.save)
    stats = pstats.Stats(profile).sort_stats("cumulative")
    stats.print_stats(r"piecewise_backend", args.top)
    stats.sort_stats("tottime").print_stats(args.top // 2)


if __name__ == "__main__":
    main()
