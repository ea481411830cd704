"""Decode step time of a toy Llama: eager vs piecewise, side by side in one process (GPU).

    python benchmarks/decode_step.py --out results.json [--layers 16 --batches 1 8 32]

KV length grows every step (prompt 256); SDPA is pinned to flash/efficient; times come from CUDA
events, median over the second half of the steps. Also records first-call time and captures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import piecewise_backend
from piecewise_backend.toy_models import ToyConfig, ToyLlama, init_weights_, reset_caches, sdpa_backends


def time_decode(step, model, batch: int, prompt: int, steps: int) -> tuple[float, float]:
    """(median step ms over the second half, first call s) for prefill + ``steps`` decode steps."""
    reset_caches(model)
    ids = torch.randint(0, model.cfg.vocab, (batch, prompt), device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    logits = step(ids, 0)
    torch.cuda.synchronize()
    first_call = time.perf_counter() - start
    pos, times = prompt, []
    for _ in range(steps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        logits = step(logits[:, -1:].argmax(-1), pos)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
        pos += 1
    return statistics.median(times[steps // 2:]), first_call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    prompt = 256
    cfg = ToyConfig(vocab=32000, hidden=args.hidden, layers=args.layers, heads=args.heads,
                    intermediate=args.intermediate, max_batch=max(args.batches), max_seq=prompt + args.steps + 8)
    model = init_weights_(ToyLlama(cfg)).to(device="cuda", dtype=torch.bfloat16).eval()
    name = f"llama-{cfg.layers}L-{cfg.hidden}"
    compiled = torch.compile(model, backend="piecewise")
    rows = []
    with torch.inference_mode(), sdpa_backends("cuda"):
        for batch in args.batches:
            for variant, step in (("eager", model), ("piecewise", compiled)):
                step_ms, first_s = time_decode(step, model, batch, prompt, args.steps)
                rows.append({"model": name, "variant": variant, "batch": batch, "step_ms": round(step_ms, 4),
                             "first_call_s": round(first_s, 3)})
                print(f"{name} {variant:10} batch {batch:3d}: {step_ms:8.3f} ms/step  first call {first_s:6.2f} s",
                      flush=True)
    graphs = piecewise_backend.compiled_graphs()
    decode = max(graphs, key=lambda g: g.stats.calls)
    result = {
        "decode": rows,
        "piecewise_decode_graph": {
            "pieces": decode.stats.num_pieces, "compute_pieces": decode.stats.num_compute_pieces,
            "inductor_compiles": decode.stats.inductor_compiles, "captures": decode.stats.captures,
            "captured_keys": sorted(map(list, decode.stats.captured_keys)), "replays": decode.stats.replays,
            "input_copies": sum(p.input_copies for p in decode.stats.pieces.values()),
        },
        "process": piecewise_backend.process_stats(),
    }
    print(json.dumps(result["piecewise_decode_graph"]))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
