"""Triton kernels of paged decode attention: lengths and block tables read from the device.

Why a kernel of our own: a serving engine's decode step is one CUDA graph only if its attention
reads everything that changes per step (each request's length, its pages) from device memory at
fixed addresses. torch 2.11's ``varlen_attn`` takes no block table, and its max lengths are host
ints a graph would freeze. Key ``n`` of a row lives in page ``block_tables[row, n // page]`` of a
cache laid out ``[pages, page, kv_heads, head_dim]`` (vLLM's layout); ``seq_lens[row]`` keys are
live (0: a padded row of a captured batch, which reads nothing and outputs zeros).

The layout is flash-decoding's, as FlashInfer's and FlashAttention's kvcache path have it: a
program owns one (row, KV head) and a share of its keys, and computes *all the query heads of that
KV head's group* against each block of keys it loads, so every key and value is read from memory
once per call, not once per query head (a 6x re-read at 12 query / 2 KV heads). The group's queries form
the rows of a ``tl.dot`` (padded to the 16 rows a tensor-core tile needs; a group larger than 64
is cut into several programs), so scores and the weighted sum of values are tensor-core products.

The number of programs per (row, KV head), ``splits``, follows from the shapes alone (:func:`plan`),
never from the lengths: the launch is identical at every step, so a graph captured once replays
right at every step, while the work follows the lengths. Program ``s`` of a pair takes the key
blocks ``s, s + splits, s + 2 * splits, ...`` below its row's length: the live blocks are dealt
evenly over the pair's programs whatever the length, and a table far wider than the live keys
costs nothing (an engine sizes its tables for the longest request). Few pairs get many programs
each, so that every SM has work at batch 1 as at batch 128; where the pairs alone fill the GPU there
is one program per pair, and it writes the output itself (no merge pass). Otherwise each program
with keys stores its partial output and log-sum-exp, and a second kernel merges them.

``cache_write`` stores a step's keys and values at their slots, skipping slot -1 (a padded row
writes nowhere).

**One compile per model, before the first request.** Triton compiles a kernel anew for each value
class of an integer argument (1, a multiple of 16, anything else) and for each constexpr: a decode
batch meeting a new class compiled on the request path (a third of a second per size, on an H100).
So ``splits``, the one integer that follows the batch, is not specialised on
(``do_not_specialize``), the merge's tile is fixed at ``MAX_SPLITS`` programs whatever ``splits``
is, and the first launch outside a capture also launches, on one row and into a scratch output,
the variant it did not need (``SINGLE`` or not, and the merge): every kernel a later batch size
launches is compiled then (:func:`_prime`), inside the engine's warm-up, and noted for saved
artifacts (``kernel_bundle.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch

from .kernel import triton, triton_block_d, unspecialised
from .kernel_bundle import note

LOG2E = 1.4426950408889634
MAX_SPLITS = 32  # programs per (row, KV head) at most
PROGRAMS_PER_SM = 4  # the programs a launch aims at, per SM, while the pairs are fewer than the SMs
# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) cannot take a loaded value as a loop
# bound (Triton 3.6 under NumPy 2); there the key loop runs over the whole table, masked.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclasses.dataclass(frozen=True)
class Plan:
    """A launch, from the shapes: ``splits`` programs per (row, KV head) dealt blocks of ``block_n``
    keys in turn; ``block_h`` query heads per program (``head_blocks`` programs cover a group)."""

    block_n: int
    block_h: int
    head_blocks: int
    splits: int
    warps: int = 4
    stages: int = 2


@functools.lru_cache(maxsize=1024)  # the engine's eager path asks once a layer a step
def plan(rows: int, kv_heads: int, group: int, head_dim: int, sms: int) -> Plan:
    """The launch for ``rows`` rows of ``kv_heads`` KV heads of ``group`` query heads each, on a GPU of
    ``sms`` multiprocessors: one program per pair (no merge) once the pairs are as many as the SMs;
    below that, as many programs per pair as bring the launch to ``PROGRAMS_PER_SM`` programs an SM,
    ``MAX_SPLITS`` at most. (Measured on an H100, ``benchmarks/README.md``: more programs help while
    they are few, and past one per SM the merge costs more than the programs gain.)"""
    block_n = 64 if head_dim <= 128 else 32  # a K and a V tile of 16 KiB at bf16 either way
    block_h = min(64, max(16, triton_block_d(group)))  # tl.dot takes 16 rows at least
    head_blocks = math.ceil(group / block_h)
    pairs = rows * kv_heads * head_blocks
    splits = 1 if pairs >= sms else min(MAX_SPLITS, math.ceil(PROGRAMS_PER_SM * sms / pairs))
    return Plan(block_n, block_h, head_blocks, splits)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


if triton is not None:
    import triton.language as tl

    # A Triton kernel reads as its math: kept as written.
    # fmt: off
    @triton.jit
    def _attend_block(q, k_ptr, v_ptr, table_row, k_head, v_head, n0, end, d, d_ok, m, l, acc, qk_scale,
                      stride_kp, stride_ks, stride_vp, stride_vs,
                      PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """One block of keys ``[n0, n0 + BLOCK_N)`` (those past ``end`` masked) against the group's
        queries: the online softmax's running max ``m``, denominator ``l`` and output ``acc``, base 2."""
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        page = tl.load(table_row + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        slot = n % PAGE
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (page * stride_kp + slot * stride_ks + k_head)[:, None] + d[None, :], mask=kv_ok, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [heads, keys]
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
        new_m = tl.maximum(m, tl.max(scores, axis=1))
        finite_m = tl.where(new_m == float("-inf"), 0.0, new_m)  # a block of no live key: no NaN
        weights = tl.exp2(scores - finite_m[:, None])
        rescale = tl.exp2(m - finite_m)
        v = tl.load(v_ptr + (page * stride_vp + slot * stride_vs + v_head)[:, None] + d[None, :], mask=kv_ok, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=DOT_PRECISION)
        l = l * rescale + tl.sum(weights, axis=1)
        return new_m, l, acc

    @triton.jit(**unspecialised("splits"))
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr,
                             stride_qn, stride_qh, stride_on, stride_oh, stride_kp, stride_ks, stride_kh,
                             stride_vp, stride_vs, stride_vh, stride_tn, kv_heads, group, head_blocks, splits,
                             qk_scale, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
                             TABLE_TURNS: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Program (row, KV head, head block) x split: the group's queries over key blocks split,
        split + splits, ... below the row's length."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        row_kv = pid // head_blocks
        row = row_kv // kv_heads
        kv_h = row_kv % kv_heads
        g = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)  # query heads within the group
        g_ok = g < group
        heads = kv_h * group + g
        length = tl.load(lens_ptr + row).to(tl.int32)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        hd_ok = g_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + row * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=hd_ok, other=0.0)
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
        table_row = table_ptr + row * stride_tn
        k_head = kv_h * stride_kh
        v_head = kv_h * stride_vh
        stride_n = splits * BLOCK_N  # from one of this program's blocks to its next
        if TABLE_TURNS == 0:  # compiled: this program's blocks below the length (none: none)
            for i in range(0, tl.cdiv(length - split * BLOCK_N, stride_n)):
                m, l, acc = _attend_block(q, k_ptr, v_ptr, table_row, k_head, v_head, split * BLOCK_N + i * stride_n,
                                          length, d, d_ok, m, l, acc, qk_scale, stride_kp, stride_ks, stride_vp,
                                          stride_vs, PAGE, BLOCK_N, DOT_PRECISION)
        else:  # Triton's interpreter: as many turns as the table takes, those past the length masked
            for i in range(0, TABLE_TURNS):
                m, l, acc = _attend_block(q, k_ptr, v_ptr, table_row, k_head, v_head, split * BLOCK_N + i * stride_n,
                                          length, d, d_ok, m, l, acc, qk_scale, stride_kp, stride_ks, stride_vp,
                                          stride_vs, PAGE, BLOCK_N, DOT_PRECISION)
        has_keys = l > 0.0
        out = acc / tl.where(has_keys, l, 1.0)[:, None]  # a row of length 0: zeros
        if SINGLE:
            tl.store(out_ptr + row * stride_on + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=hd_ok)
        elif split * BLOCK_N < length:  # a program with no keys stores nothing (the merge reads only live ones)
            slot = (row * kv_heads * group + heads) * splits + split
            tl.store(part_ptr + slot[:, None] * HEAD_DIM + d[None, :], out, mask=hd_ok)
            tl.store(lse_ptr + slot, m + tl.log2(l), mask=g_ok)

    @triton.jit(**unspecialised("heads", "splits"))
    def _merge_kernel(part_ptr, lse_ptr, out_ptr, lens_ptr, stride_on, stride_oh, heads, splits,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                      S_TILES: tl.constexpr):
        """Program (row, query head): the partial outputs of the programs that had keys, weighted by
        their log-sum-exp (``S_TILES`` tiles of ``BLOCK_S`` of them at most)."""
        row_head = tl.program_id(0)
        row = row_head // heads
        h = row_head % heads
        length = tl.load(lens_ptr + row).to(tl.int32)
        live = tl.minimum(splits, tl.cdiv(length, BLOCK_N))  # the programs with keys (none: zeros out)
        base = row_head * splits
        s = tl.arange(0, BLOCK_S)
        top = tl.full((), float("-inf"), tl.float32)
        for t in range(0, S_TILES):
            lse = tl.load(lse_ptr + base + t * BLOCK_S + s, mask=t * BLOCK_S + s < live, other=float("-inf"))
            top = tl.maximum(top, tl.max(lse, axis=0))
        top = tl.where(top == float("-inf"), 0.0, top)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        total = tl.zeros((), tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for t in range(0, S_TILES):
            idx = t * BLOCK_S + s
            ok = idx < live
            weights = tl.exp2(tl.load(lse_ptr + base + idx, mask=ok, other=float("-inf")) - top)
            part = tl.load(part_ptr + (base + idx)[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None] & d_ok[None, :],
                           other=0.0)
            acc += tl.sum(weights[:, None] * part, axis=0)
            total += tl.sum(weights, axis=0)
        out = acc / tl.where(total > 0.0, total, 1.0)
        tl.store(out_ptr + row * stride_on + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
    # fmt: on

    @triton.jit
    def _cache_write_kernel(
        k_ptr,
        v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slots_ptr,
        stride_kn,
        stride_kh,
        stride_vn,
        stride_vh,
        stride_cp,
        stride_cs,
        stride_ch,
        stride_dp,
        stride_ds,
        stride_dh,
        PAGE: tl.constexpr,
        KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        if slot >= 0:  # -1: a padded row, writes nowhere
            page = slot // PAGE
            within = slot % PAGE
            h = tl.arange(0, BLOCK_H)
            d = tl.arange(0, BLOCK_D)
            ok = (h < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(k_ptr + row * stride_kn + h[:, None] * stride_kh + d[None, :], mask=ok)
            v = tl.load(v_ptr + row * stride_vn + h[:, None] * stride_vh + d[None, :], mask=ok)
            tl.store(
                k_cache_ptr + page * stride_cp + within * stride_cs + h[:, None] * stride_ch + d[None, :],
                k.to(k_cache_ptr.dtype.element_ty),
                mask=ok,
            )
            tl.store(
                v_cache_ptr + page * stride_dp + within * stride_ds + h[:, None] * stride_dh + d[None, :],
                v.to(v_cache_ptr.dtype.element_ty),
                mask=ok,
            )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    launch: Plan | None = None,
) -> torch.Tensor:
    """The Triton path of ``paged_attention.paged_decode_attention`` (arguments checked there);
    ``launch``: a plan to use instead of :func:`plan`'s (the kernel benchmark's variants)."""
    rows, heads, dim = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    if launch is None:
        launch = plan(rows, kv_heads, group, dim, _multiprocessors(q.device))
    if q.dtype != k_cache.dtype:  # a tensor-core product takes one type
        q = q.to(k_cache.dtype)
    single = launch.splits == 1
    partial = lse = out  # one program per pair: it writes ``out`` and never reads these
    if not single:
        partial = torch.empty(rows * heads * launch.splits, dim, device=q.device, dtype=torch.float32)
        lse = torch.empty(rows * heads * launch.splits, device=q.device, dtype=torch.float32)
    block_d = max(16, triton_block_d(dim))  # a tensor-core product takes 16 at least
    launched = _paged_decode_kernel[(rows * kv_heads * launch.head_blocks, launch.splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        partial,
        lse,
        *q.stride()[:2],
        *out.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        kv_heads,
        group,
        launch.head_blocks,
        launch.splits,
        scale * LOG2E,
        PAGE=page,
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        BLOCK_H=launch.block_h,
        BLOCK_N=launch.block_n,
        SINGLE=single,
        TABLE_TURNS=math.ceil(block_tables.shape[1] * page / (launch.splits * launch.block_n)) if INTERPRETED else 0,
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else None,  # fp32: no TF32 rounding
        num_warps=launch.warps,
        num_stages=launch.stages,
    )
    note(launched)  # its binary goes into saved artifacts (kernel_bundle.py)
    if not single:
        _merge(partial, lse, out, seq_lens, launch)
    _prime(q, k_cache, v_cache, block_tables, seq_lens, scale, launch)
    return out


_PRIMED: dict = {}  # (device, dtypes, shapes that are constexprs) -> both variants compiled


def _prime_key(q: torch.Tensor, k_cache: torch.Tensor) -> tuple:
    return (q.device, q.dtype, k_cache.dtype, q.shape[1:], k_cache.shape[1:], k_cache.stride())


def _prime(q, k_cache, v_cache, block_tables, seq_lens, scale: float, launch: Plan) -> None:
    """Launch, on the first row and into a scratch output, the variant this call did not need (one
    program per pair, or split with the merge): both are compiled now, not at a later batch size's
    first step (which may be a request's). Reads the caches and the row's metadata; writes nothing
    of the caller's. Once per model and device, and never inside a capture."""
    key = _prime_key(q, k_cache)
    if not q.is_cuda or key in _PRIMED or torch.cuda.is_current_stream_capturing():  # (not Triton's interpreter)
        return
    _PRIMED[key] = True
    other = dataclasses.replace(launch, splits=2 if launch.splits == 1 else 1)
    scratch = torch.empty_like(q[:1])
    decode_attention(q[:1], k_cache, v_cache, block_tables[:1], seq_lens[:1], scratch, scale, other)


def _merge(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, seq_lens: torch.Tensor, launch: Plan) -> None:
    """The merge pass: one program per (row, query head) over the partial outputs of its programs."""
    rows, heads, dim = out.shape
    block_d = triton_block_d(dim)
    block_s = min(triton.next_power_of_2(MAX_SPLITS), max(1, 4096 // block_d))  # one tile whatever ``splits``
    launched = _merge_kernel[(rows * heads,)](
        partial,
        lse,
        out,
        seq_lens,
        out.stride(0),
        out.stride(1),
        heads,
        launch.splits,
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        BLOCK_N=launch.block_n,
        BLOCK_S=block_s,
        S_TILES=math.ceil(max(MAX_SPLITS, launch.splits) / block_s),
    )
    note(launched)  # its binary goes into saved artifacts (kernel_bundle.py)


def cache_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """The Triton path of ``paged_attention.paged_cache_write``."""
    rows, kv_heads, dim = k.shape
    launched = _cache_write_kernel[(rows,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        PAGE=k_cache.shape[1],
        KV_HEADS=kv_heads,
        HEAD_DIM=dim,
        BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton_block_d(dim),
        num_warps=1 << (max(1, min(4, kv_heads * dim // 256)).bit_length() - 1),
    )  # a power of two
    note(launched)  # its binary goes into saved artifacts (kernel_bundle.py)
