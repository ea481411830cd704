"""Hybrid attention models through Hugging Face ``generate()``: eager's tokens, and the share of decode
calls the backend's graphs served (CPU with emulated graphs, or CUDA).

    python -m benchmarks.hybrid_check --out hybrid.json [--device cpu] [--layers 6] [--window 512]

Gemma 3, OLMo 3, EXAONE 4 and Cohere 2 alternate sliding-window and full-attention layers (their
configurations' own patterns; Gemma 3's five sliding to one full), from small random configurations,
greedy, batches 1 and 3, both caches. A window longer than prompt + new tokens is never full (the
case transformers 5.17 built an unread mask for); a short one fills in a few steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import warnings

import torch
import transformers

import piecewise_backend

ARCHS = {  # config class, model class, what the configuration needs besides the common sizes
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"sliding_window_pattern": 3}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {}),
}
PROMPT = 11


def build(arch: str, layers: int, window: int, device: str):
    config_name, model_name, extra = ARCHS[arch]
    config = getattr(transformers, config_name)(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=window,
        pad_token_id=0,
        **extra,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(device).eval()
    model.generation_config.eos_token_id = None  # every call makes all its tokens
    return model


def check(arch: str, cache: str, layers: int, window: int, tokens: int, device: str, compiler: str) -> dict:
    """One row: the same tokens as eager at each batch, and the decode calls graphs served."""
    torch._dynamo.reset()
    model = build(arch, layers, window, device)
    eager_forward = model.forward
    compiled = torch.compile(eager_forward, backend="piecewise", options={"compiler": compiler})
    known = {g.serial for g in piecewise_backend.compiled_graphs()}
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
    g = torch.Generator().manual_seed(0)
    same, batches = True, (1, 3)
    for batch in batches:
        ids = torch.randint(0, 256, (batch, PROMPT), generator=g).to(device)
        outs = []
        for forward in (compiled, eager_forward):
            model.forward = forward
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outs.append(
                    model.generate(
                        ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False, **kwargs
                    )
                )
        same &= torch.equal(*outs)
    graphs = [g for g in piecewise_backend.compiled_graphs() if g.serial not in known]
    served = sum(sum(g.stats.graph_calls.values()) for g in graphs)
    decode_calls = len(batches) * (tokens - 1)
    return {
        "arch": arch,
        "cache": cache,
        "layers": layers,
        "window": window,
        "layer_types": model.config.layer_types,
        "tokens": tokens,
        "same_tokens": same,
        "decode_calls": decode_calls,
        "decode_share_graphed": round((served - len(batches)) / decode_calls, 3),  # less a prefill per call
        "graphs": len(graphs),
        "captures": sum(g.stats.captures for g in graphs),
        "misses": {str(m): n for g in graphs for m, n in g.stats.misses.items() if n},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--archs", nargs="+", default=list(ARCHS))
    parser.add_argument("--caches", nargs="+", default=["dynamic", "static"])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compiler", default="inductor", help='the option: "inductor" or "eager"')
    args = parser.parse_args()
    rows = []
    with piecewise_backend.emulated_graphs() if args.device == "cpu" else contextlib.nullcontext():
        for arch in args.archs:
            for cache in args.caches:
                rows.append(check(arch, cache, args.layers, args.window, args.tokens, args.device, args.compiler))
                print(json.dumps(rows[-1]), flush=True)
                pathlib.Path(args.out).write_text(
                    json.dumps(
                        {"transformers": transformers.__version__, "torch": torch.__version__, "hybrid": rows}, indent=1
                    )
                )


if __name__ == "__main__":
    main()
