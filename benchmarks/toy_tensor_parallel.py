"""Decode step time of a tensor-parallel toy shard, eager against piecewise, on every rank.

``torchrun --standalone --nproc-per-node 2 -m benchmarks.toy_tensor_parallel`` from the repository
root: the decode check of ``toys/parallel.py`` first (one JSON line per rank), then this timing at
batch 1 and 8 (one JSON line per rank and batch).
"""

from __future__ import annotations

import json

import torch

from benchmarks.timing import time_decode
from toys.models import BENCHMARK_SIZES, ToyConfig, sdpa_backends
from toys.parallel import as_rank, decode_check, toy_and_shard


def time_check(
    rank: int,
    world: int,
    device: str,
    batch: int = 8,
    prompt: int = 256,
    steps: int = 64,
    model: dict = BENCHMARK_SIZES["16L"],
) -> dict:
    """Decode step time of this rank's bf16 shard of the benchmarks' 16-layer toy (hidden 1024), run
    eagerly and compiled with the piecewise backend, side by side (``timing.time_decode``: median
    over the second half of ``steps``, KV growing from ``prompt``).

    Why: on several GPUs every layer adds two all-reduces to the launches a step makes, so the
    host-bound decode step gains at least as much from graphs as on one GPU; this measures it.
    """
    cfg = ToyConfig(**model, max_batch=batch, max_seq=prompt + steps + 1)
    _, shard = toy_and_shard(cfg, rank, world, device, torch.bfloat16)
    compiled = torch.compile(shard, backend="piecewise")
    row = {"rank": rank, "world": world, "batch": batch, "layers": cfg.layers, "hidden": cfg.hidden}
    with torch.no_grad(), sdpa_backends(device):
        for name, step in (("eager", shard), ("piecewise", compiled)):
            torch.manual_seed(1)  # the same prompt on every rank (the ranks' logits are the same)
            ms, first_call = time_decode(step, shard, batch, prompt, steps, device)
            row[f"{name}_step_ms"], row[f"{name}_first_call_s"] = round(ms, 4), round(first_call, 2)
    return row


def _checks(rank: int, world: int, device: str) -> None:
    print(json.dumps(decode_check(rank, world, device)), flush=True)
    for batch in (1, 8):
        print(json.dumps(time_check(rank, world, device, batch=batch)), flush=True)


def main() -> None:
    as_rank(_checks)


if __name__ == "__main__":
    main()
