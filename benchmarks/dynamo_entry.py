"""What Dynamo's entry costs one decode call of transformers' forward, and what ``guard_filter_fn`` cuts.

    python -m benchmarks.dynamo_entry --out entry.json [--layers 4 28] [--device cuda]

The model is transformers' ``Qwen3ForCausalLM`` (hidden 64, random weights) with a static cache,
batch 4, one new token per call. It is compiled with a backend that hands back what its graph
returned once, so the time per call is Dynamo's alone: its guards, the frame's entry and the
rebuilding of transformers' outputs, none of the model's kernels and none of this backend's work.
Variants: guards as Dynamo makes them, and each ``torch.compiler.skip_guard_on_*`` /
``keep_tensor_guards_unsafe`` filter passed as ``options={"guard_filter_fn": ...}`` (a user's
choice: the filtered guards no longer protect against what they checked, e.g. a module attribute
changed after compiling; moved weights are still caught by this backend's address check), and,
compiled with every guard, calls under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``
(only the guards that tell Dynamo's cached graphs apart). Median of 7 rounds of 40 calls.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

FILTERS = (
    "skip_guard_on_inbuilt_nn_modules_unsafe",
    "skip_guard_on_all_nn_modules_unsafe",
    "keep_tensor_guards_unsafe",
    "skip_guard_on_globals_unsafe",
)


def _constant_backend(gm, example_inputs):
    cached = []

    def call(*args):  # what the graph returned once, handed back at every call
        if not cached:
            cached.append(gm(*args))
        return cached[0]

    return call


def entry_us(layers: int, device: str) -> list[dict]:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    model = transformers.Qwen3ForCausalLM(cfg).to(device).eval()
    cache = transformers.StaticCache(config=cfg, max_cache_len=128)
    ids = torch.randint(0, 256, (4, 8), device=device)

    def timed(forward, calls: int) -> float:
        cache.reset()
        forward(input_ids=ids, past_key_values=cache, use_cache=True)
        start = time.perf_counter()
        for _ in range(calls):
            forward(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
        return (time.perf_counter() - start) / calls * 1e6

    rows = []
    variants = {
        "guards": None,
        **{name: getattr(torch.compiler, name) for name in FILTERS if hasattr(torch.compiler, name)},
    }
    with torch.no_grad():
        for name, guard_filter in variants.items():
            torch._dynamo.reset()
            options = {"guard_filter_fn": guard_filter} if guard_filter is not None else None
            forward = torch.compile(model.forward, backend=_constant_backend, options=options)
            timed(forward, 3)
            rows.append(
                {
                    "model": "qwen3",
                    "layers": layers,
                    "variant": name,
                    "entry_us": round(statistics.median(timed(forward, 40) for _ in range(7)), 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        # after warm-up, a server's switch instead of a filter: Dynamo checks only the guards that
        # tell its cached graphs apart (compiled with every guard, as in the first row)
        torch._dynamo.reset()
        forward = torch.compile(model.forward, backend=_constant_backend)
        timed(forward, 3)
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            rows.append(
                {
                    "model": "qwen3",
                    "layers": layers,
                    "variant": "set_stance(skip_guard_eval_unsafe=True)",
                    "entry_us": round(statistics.median(timed(forward, 40) for _ in range(7)), 1),
                }
            )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 28])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    rows = [row for layers in args.layers for row in entry_us(layers, args.device)]
    pathlib.Path(args.out).write_text(json.dumps({"rows": rows, "device": args.device}, indent=1) + "\n")


if __name__ == "__main__":
    main()
