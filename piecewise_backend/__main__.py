"""``python -m piecewise_backend``: compile a toy Llama, show its pieces, captures and step times.

On a machine without CUDA it runs the same pieces compiled but un-graphed, and says so.
"""

from __future__ import annotations

import argparse
import time

import torch

from . import compiled_graphs
from .timing import time_decode
from .toy_models import BENCHMARK_SIZES, ToyConfig, ToyLlama, init_weights_, next_tokens, reset_caches, sdpa_backends


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cfg = (ToyConfig(**{**BENCHMARK_SIZES["16L"], "layers": args.layers or 16},
                     max_batch=max(args.batches), max_seq=256 + args.steps + 8)
           if cuda else
           ToyConfig(vocab=256, hidden=64, layers=args.layers or 4, heads=4, intermediate=128,
                     max_batch=max(args.batches), max_seq=64))
    dtype = torch.bfloat16 if cuda else torch.float32
    model = init_weights_(ToyLlama(cfg)).to(device=device, dtype=dtype).eval()
    prompt = 256 if cuda else 8
    print(f"toy Llama: {cfg.layers} layers, hidden {cfg.hidden}, {dtype}, on {device}")
    if not cuda:
        print("No CUDA here: pieces run compiled with Inductor but un-graphed (same API, same results).")

    compiled = torch.compile(model, backend="piecewise")
    with torch.inference_mode(), sdpa_backends(device):
        start = time.perf_counter()
        reset_caches(model)
        ids = torch.randint(0, cfg.vocab, (1, prompt), device=device)
        first = compiled(ids, 0)
        compiled(next_tokens(first), prompt)
        print(f"first calls (compile + prefill + first decode): {time.perf_counter() - start:.1f} s")
        rows = []
        for batch in args.batches:
            eager = time_decode(model, model, batch, prompt, args.steps, device)[0] / 1e3
            piecewise = time_decode(compiled, model, batch, prompt, args.steps, device)[0] / 1e3
            rows.append((batch, eager, piecewise))

    graph = compiled_graphs()[-1]  # the decode graph (dynamic in batch and position)
    print("\npieces of the decode graph, in order:")
    for p in graph.pieces:
        what = ", ".join(p.split_ops) or ("eager: " + "; ".join(p.eager_reasons[:2]) if p.kind != "compute" else "")
        shared = ""
        if p.kind == "compute":
            first = graph.compiled[p.name].shared_with
            shared = "compiled" if first == p.name else f"reuses {first}'s code"
        print(f"  {p.name:>10}  {p.kind:8} {p.num_ops:4} ops  {shared or what}")
    for g in compiled_graphs():
        print(f"\ngraph {g.serial}:\n  " + g.stats.summary().replace("\n", "\n  "))
        if g.stats.events:
            print("  " + g.stats.table().replace("\n", "\n  "))
    print("\ndecode step time (median):")
    print(f"  {'batch':>5}  {'eager ms':>9}  {'piecewise ms':>12}  {'speed-up':>8}")
    for batch, eager, piecewise in rows:
        print(f"  {batch:5d}  {eager * 1e3:9.2f}  {piecewise * 1e3:12.2f}  {eager / piecewise:7.2f}x")


if __name__ == "__main__":
    main()
