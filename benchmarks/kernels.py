"""Suite ``kernels``: the paged decode kernel against torch's flash SDPA and the memory floor, in µs per call.

    python -m benchmarks kernels [--batches 1,8,32,64,128] [--contexts 1000,4000]
    python -m benchmarks kernels --variants paged-launches   # other launches of the kernel than the chosen
    python -m benchmarks kernels --smoke                     # CPU: tiny sizes, the reference path, no timing

Shapes: Qwen2.5-1.5B's attention (12 query heads, 2 KV heads, head dim 128), bf16, pages of 16
tokens, every row ``context`` cached keys, its pages scattered over the cache. Per (B, context):

* ``paged_us``: ``piecewise_backend.ops.paged_decode_attention`` (what the serving engine calls);
* ``sdpa_us``: ``F.scaled_dot_product_attention`` on the same keys laid out contiguously
  (``[B, 2, context, 128]``, ``enable_gqa=True``) with the flash backend chosen for this row alone
  (``sdpa_backend``: the comparison the kernel is held to); ``sdpa_default_us``: torch's own choice;
* ``floor_us``: the bytes the call must move (every row's keys and values, the queries, the output)
  over the copy bandwidth measured in the same run (``copy_gbs``).

Each time is a CUDA graph of many calls (launch cost out of it), every call reading other copies of
the data, three L2 caches' worth together: each call reads memory, as each layer of a model reads
its own cache, where one copy replayed would be served from L2. Rows are written as they come.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from benchmarks.harness import Suite
from piecewise_backend.ops import paged_decode_attention

HEADS, KV_HEADS, HEAD_DIM, PAGE = 12, 2, 128, 16


@dataclasses.dataclass
class Case:
    """``sets`` copies of one call's data: queries, a paged cache with a table per copy, the same keys
    contiguous for SDPA."""

    q: list
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: list
    lens: torch.Tensor
    keys: list
    values: list
    moved_bytes: int


def make_case(batch: int, context: int, device: str, dtype, sets: int, seed: int = 0) -> Case:
    g = torch.Generator(device=device).manual_seed(seed)
    width = math.ceil(context / PAGE)
    pages = sets * batch * width
    k_cache = torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    v_cache = torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    order = torch.randperm(pages, device=device, generator=g).to(torch.int32).view(sets, batch, width)
    q, keys, values = [], [], []
    for s in range(sets):
        q.append(torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g))
        rows = order[s].long()  # [batch, width] pages -> [batch, KV_HEADS, context, HEAD_DIM]
        keys.append(k_cache[rows].flatten(1, 2)[:, :context].transpose(1, 2).contiguous())
        values.append(v_cache[rows].flatten(1, 2)[:, :context].transpose(1, 2).contiguous())
    lens = torch.full((batch,), context, device=device, dtype=torch.int64)
    return Case(q, k_cache, v_cache, list(order.unbind(0)), lens, keys, values, moved_bytes(batch, context, dtype))


def moved_bytes(batch: int, context: int, dtype) -> int:
    """What one call must read and write at least: every row's keys and values, queries and output."""
    return (2 * batch * context * KV_HEADS * HEAD_DIM + 2 * batch * HEADS * HEAD_DIM) * (torch.finfo(dtype).bits // 8)


def sdpa(case: Case, s: int) -> torch.Tensor:
    return F.scaled_dot_product_attention(case.q[s][:, :, None], case.keys[s], case.values[s], enable_gqa=True)[:, :, 0]


def paged(case: Case, s: int, out: torch.Tensor, launch=None) -> torch.Tensor:
    if launch is None:
        return paged_decode_attention(case.q[s], case.k_cache, case.v_cache, case.tables[s], case.lens, out=out)
    from piecewise_backend.ops import paged_kernel

    return paged_kernel.decode_attention(
        case.q[s], case.k_cache, case.v_cache, case.tables[s], case.lens, out, HEAD_DIM**-0.5, launch
    )


def launch_variants(batch: int) -> dict:
    """Other launches of the kernel than the one chosen: the data behind ``paged_kernel.plan``."""
    from piecewise_backend.ops import paged_kernel

    sms = paged_kernel._multiprocessors(torch.device("cuda"))
    chosen = paged_kernel.plan(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, sms)
    out = {"chosen": chosen}
    for block_n in (32, 64, 128):
        for warps, stages in ((4, 2), (4, 3), (8, 2), (2, 2)):
            out[f"n{block_n}w{warps}s{stages}"] = dataclasses.replace(
                chosen, block_n=block_n, warps=warps, stages=stages
            )
    for splits in {1, max(1, chosen.splits // 2), chosen.splits * 2, chosen.splits * 4}:
        out[f"splits{splits}"] = dataclasses.replace(chosen, splits=splits)
    return out


def measure(batch: int, context: int, bandwidth: float, variants: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.timing import graph_us

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sets = max(2, min(64, math.ceil(3 * l2 / moved_bytes(batch, context, torch.bfloat16))))
    case = make_case(batch, context, "cuda", torch.bfloat16, sets)
    calls = max(sets, 20)
    out = torch.empty_like(case.q[0])
    torch.testing.assert_close(paged(case, 0, out), sdpa(case, 0), atol=2e-2, rtol=2e-2)  # timing a right kernel
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # this row's SDPA only (captured inside)
            flash_us = graph_us(lambda i: sdpa(case, i % sets), calls)
    except RuntimeError as exc:  # no flash kernel for these shapes here: said, not hidden
        flash_us = f"{type(exc).__name__}: {str(exc)[:160]}"
    row = {
        "B": batch,
        "context": context,
        "paged_us": graph_us(lambda i: paged(case, i % sets, out), calls),
        "sdpa_us": flash_us,
        "sdpa_backend": "flash",
        "sdpa_default_us": graph_us(lambda i: sdpa(case, i % sets), calls),
        "floor_us": round(case.moved_bytes / bandwidth * 1e6, 2),
        "copy_gbs": round(bandwidth / 1e9),
        "copies": sets,
    }
    row["vs_sdpa"] = round(row["paged_us"] / flash_us, 2) if isinstance(flash_us, float) else None
    row["vs_floor"] = round(row["paged_us"] / row["floor_us"], 2)
    if variants:
        launches = launch_variants(batch)
        timed = {"chosen_plan": str(launches["chosen"])}
        for name, launch in launches.items():
            try:
                torch.testing.assert_close(paged(case, 0, out, launch), sdpa(case, 0), atol=2e-2, rtol=2e-2)
                timed[name] = graph_us(lambda i: paged(case, i % sets, out, launch), calls)
            except Exception as exc:  # a launch that does not fit (shared memory) is a result too
                timed[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
        row["variants_us"] = timed
    return row


def smoke_row(batch: int, context: int) -> dict:
    """CPU: the reference path against SDPA on a tiny case, the row's schema with no timing."""
    case = make_case(batch, context, "cpu", torch.float32, 1)
    out = torch.empty_like(case.q[0])
    torch.testing.assert_close(paged(case, 0, out), sdpa(case, 0), atol=1e-5, rtol=1e-5)
    return {"B": batch, "context": context, "paged_us": None, "sdpa_us": None, "sdpa_backend": "flash",
            "sdpa_default_us": None, "floor_us": None, "copy_gbs": None, "copies": 1}  # fmt: skip


def rows(variant: str, args) -> Iterator[dict]:
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.smoke or not torch.cuda.is_available():
        for context in contexts:
            for batch in batches:
                yield smoke_row(batch, context)
        return
    from benchmarks.timing import copy_bandwidth

    bandwidth = copy_bandwidth()
    for context in contexts:
        for batch in batches:
            yield measure(batch, context, bandwidth, variants=variant == "paged-launches")


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--contexts", default="1000,4000")


# fmt: off
SUITE = Suite("kernels", "the paged decode kernel against flash SDPA on the same keys and the byte floor (µs per call)",
              ("paged", "paged-launches"), rows, options, default=("paged",), smoke="--batches 1,3 --contexts 40".split())
# fmt: on
