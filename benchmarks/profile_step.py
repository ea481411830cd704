"""Where a decode step's time goes: torch.profiler over a few steps of one variant.

    python -m benchmarks.profile_step --variant piecewise [--model 16L --batch 8 --steps 6 --out prof/]

Prints the top ops by self host time and by device time, and the host time of the whole step vs
its device time (a step is host-bound when the host time is the larger); with ``--out`` writes a
Chrome trace (open in https://ui.perfetto.dev). Variants as in suite.py.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.plot import PINNED, base_variant
from benchmarks.suite_models import MODELS, next_ids, toy_model
from benchmarks.suite_variants import compiled_variant, sdpa_setting
from piecewise_backend.runtime.devices import synchronize
from toys.models import ToyLlama, ToyStaticCacheLlama, reset_caches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--variant",
        default="piecewise",
        choices=[
            "eager",
            "inductor",
            "reduce-overhead",
            "reduce-overhead+partition",
            "piecewise",
            "piecewise-eager-attention",
            "piecewise-full",
            "piecewise-full-static",
        ],
    )
    parser.add_argument("--model", default="16L", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    variant = base_variant(args.variant)
    tensor_pos = variant == "piecewise-full-static"
    model = toy_model(
        args.model,
        device,
        ToyStaticCacheLlama if tensor_pos else ToyLlama,
        max_batch=args.batch,
        max_seq=args.prompt + args.warmup + args.steps + 8,
    )
    cfg = model.cfg
    step = model if variant == "eager" else compiled_variant(variant, model, args.variant.endswith(PINNED))

    def where(p, n):
        return torch.arange(p, p + n, device=device) if tensor_pos else p

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.inference_mode(), sdpa_setting(args.variant, device):
        reset_caches(model)
        logits = step(torch.randint(0, cfg.vocab, (args.batch, args.prompt), device=device), where(0, args.prompt))
        pos = args.prompt

        def decode(n: int) -> None:
            nonlocal logits, pos
            for _ in range(n):
                logits = step(next_ids(logits), where(pos, 1))
                pos += 1
            synchronize(device)

        decode(args.warmup)
        with profile(activities=activities) as prof:
            decode(args.steps)
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25))
    if device == "cuda":
        print(averages.table(sort_by="self_cuda_time_total", row_limit=15))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.out, f"{args.variant}-{args.model}-b{args.batch}.json"))


if __name__ == "__main__":
    main()
