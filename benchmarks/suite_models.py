"""The suite's models: the toy Llamas at the benchmark sizes, and the same sizes in another idiom.

``MODELS`` and ``IDIOMS`` name them (``--models``); :func:`toy_model` builds one with the weights
every benchmark compares on, :func:`models_for` a model with its graph-safe twin.
"""

from __future__ import annotations

import torch

from toys.idioms import WholeCacheLlama
from toys.models import BENCHMARK_SIZES, ToyConfig, ToyLlama, ToyStaticCacheLlama, init_weights_, next_tokens

MODELS = {
    **BENCHMARK_SIZES,
    "tiny": dict(vocab=256, hidden=64, layers=2, heads=4, intermediate=128),  # CPU smoke runs
}


# the same sizes, written in an idiom other than the toys' own (``toys/idioms.py``): key -> (size, class)
IDIOMS = {f"{size}-whole-cache": (size, WholeCacheLlama) for size in ("16L", "28L", "tiny")}


def toy_model(key: str, device: str, model_cls=ToyLlama, **sizes):
    """``model_cls`` at ``MODELS[key]`` (``sizes`` override or add config fields), with the
    deterministic weights every benchmark compares on: bf16 on a GPU, fp32 on a CPU."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return init_weights_(model_cls(ToyConfig(**{**MODELS[key], **sizes}))).to(device=device, dtype=dtype).eval()


def next_ids(logits: torch.Tensor) -> torch.Tensor:
    """Greedy next tokens, their batch dim marked dynamic (one decode graph for every batch size)."""
    return next_tokens(logits, mark_batch_dynamic=True)


def model_name(model) -> str:
    idiom = getattr(model, "idiom", None)
    return f"llama-{model.cfg.layers}L-{model.cfg.hidden}" + (f"-{idiom}" if idiom else "")


def models_for(key: str, args, device: str):
    """The model sized for the run, and its graph-safe twin with the same weights."""
    if key in IDIOMS:  # no graph-safe twin: the full-static variants are the toys' own
        size, cls = IDIOMS[key]
        return toy_model(size, device, cls, max_batch=max(args.batches), max_seq=args.prompt + args.steps + 8), None
    model = toy_model(key, device, max_batch=max(args.batches), max_seq=args.prompt + args.steps + 8)
    twin = toy_model(key, device, ToyStaticCacheLlama, max_batch=model.cfg.max_batch, max_seq=model.cfg.max_seq)
    twin.load_state_dict(model.state_dict())
    return model, twin


def size_caches(model, batch: int) -> None:
    """A model whose caches hold exactly the batch (``toys/idioms.py``) gets new ones per batch."""
    if hasattr(model, "set_batch"):
        model.set_batch(batch)
