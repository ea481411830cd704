"""Weights that move: re-capture graphs for the new addresses, or run un-graphed? Measured side by side.

After ``load_state_dict(assign=True)`` the backend captures new graphs for the new addresses
(``weight_sets.py``) until ``max_weight_sets``; past it, calls run un-graphed. This times, on one
toy Llama in one process, a decode step replayed from graphs, the first step after new weights
are loaded (it captures), and a step run un-graphed (a second compile with ``max_weight_sets=1``),
so the break-even (re-capture cost over the per-step saving) is a measured number.

    python -m benchmarks.moved_weights --out moved_weights.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from pathlib import Path

import torch

from benchmarks.timing import timed
from toys.models import ToyConfig, ToyLlama, init_weights_, next_tokens, reset_caches

SIZE = dict(vocab=32000, hidden=1024, layers=8, heads=16, intermediate=2816)


def _new_weights(model) -> None:
    model.load_state_dict({k: v.clone() for k, v in model.named_parameters()}, assign=True, strict=False)


def _steps(compiled, ids, pos: int, count: int, device: str) -> tuple[list[float], torch.Tensor]:
    times = []
    for i in range(count):
        logits, ms = timed(lambda: compiled(ids, pos + i), device)
        times.append(ms)
        ids = next_tokens(logits, True)
    return times, ids


def measure(device: str, batch: int, steps: int, size: dict = SIZE) -> dict:
    cfg = ToyConfig(**size, max_batch=batch, max_seq=64 + 3 * steps + 8)
    model = init_weights_(ToyLlama(cfg)).to(device=device, dtype=torch.bfloat16).eval()
    out = {"model": f"toy Llama {size['layers']}L/{size['hidden']}", "batch": batch, "dtype": "bf16", "device": device}
    for variant, options in (("recapture", {}), ("ungraphed", {"max_weight_sets": 1})):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="piecewise", options=options)
        reset_caches(model)
        ids = torch.randint(0, cfg.vocab, (batch, 64), device=device)
        torch._dynamo.mark_dynamic(ids, 0)
        ids = next_tokens(compiled(ids, 0), True)
        replayed, ids = _steps(compiled, ids, 64, steps, device)
        _new_weights(model)
        after, _ = _steps(compiled, ids, 64 + steps, steps, device)
        if variant == "recapture":
            out["replay_ms"] = statistics.median(replayed[steps // 2 :])
            out["first_step_after_new_weights_ms"] = after[0]
            out["replay_after_new_weights_ms"] = statistics.median(after[steps // 2 :])
        else:
            out["ungraphed_ms"] = statistics.median(after[steps // 2 :])
    saving = out["ungraphed_ms"] - out["replay_after_new_weights_ms"]
    out["break_even_steps"] = round(out["first_step_after_new_weights_ms"] / saving, 1) if saving > 0 else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer toy (a CPU smoke run)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = dict(vocab=128, hidden=64, layers=2, heads=4, intermediate=128) if args.tiny else SIZE
    with torch.no_grad():  # not inference_mode: the loaded weights become parameters again
        result = measure(device, args.batch, args.steps, size)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
