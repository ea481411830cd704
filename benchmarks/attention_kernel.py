"""GPU time of the graph-safe decode attention kernel (``ops/kernel.py``) per launch config, vs SDPA.

    python -m benchmarks.attention_kernel --json kernel.json      (a GPU with Triton; ~30 s)

Why: the kernel's launch (keys per block, one warp per program) is a fixed rule by batch and head
dim (``kernel.plan_splits``); this is the measurement the rule comes from, and the check that it
still holds. Per case (batch, 16 heads, live keys of a longer buffer, bf16): µs per call, every
call captured in a CUDA graph (so the time is the GPU's, not the launch's), best of five replays of
50 calls; ``chosen`` is what the package launches, ``sdpa`` torch's own choice over the live
prefix, ``b{block}w{warps}`` the kernels launched with that block and warp count.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import torch.nn.functional as F

from benchmarks.timing import graph_us
from piecewise_backend.ops import kernel

CASES = [(1, 300, 336), (8, 300, 336), (32, 300, 336), (32, 1000, 1100), (1, 2000, 4096)]  # batch, live, buffer
HEADS, HEAD_DIM = 16, 64


def launch_with(q, keys, values, length, block: int, warps: int):
    """``kernel.prefix_attention`` with the block and warp count given instead of chosen."""
    splits = math.ceil(keys.shape[2] / block)
    return lambda: kernel.launch(q, keys, values, length, None, None, block, splits, block, warps)


def measure(batch: int, live: int, buffer: int) -> dict:
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    keys, values = torch.randn(2, batch, HEADS, buffer, HEAD_DIM, device="cuda", dtype=torch.bfloat16).unbind(0)
    length = torch.tensor([live], device="cuda")
    want = F.scaled_dot_product_attention(q, keys[:, :, :live], values[:, :, :live])
    us = {
        "sdpa": graph_us(lambda i: F.scaled_dot_product_attention(q, keys[:, :, :live], values[:, :, :live])),
        "chosen": graph_us(lambda i: kernel.prefix_attention(q, keys, values, length)),
    }
    for block, warps in itertools.product((16, 64, 128), (1, 2, 4)):
        run = launch_with(q, keys, values, length, block, warps)
        torch.testing.assert_close(run(), want, atol=2e-2, rtol=2e-2)
        us[f"b{block}w{warps}"] = graph_us(lambda i: run())
    chosen_block = kernel.plan_splits(batch * HEADS, buffer, HEAD_DIM)[0]
    return {
        "batch": batch,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "live": live,
        "buffer": buffer,
        "chosen_block": chosen_block,
        "us": us,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for case in CASES:
        rows.append(measure(*case))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
