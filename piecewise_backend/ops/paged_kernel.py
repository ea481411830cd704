"""Triton kernels of paged decode attention: lengths and block tables read from the device.

Why a kernel of our own: a serving engine's decode step is one CUDA graph only if its attention
reads everything that changes per step (each request's length, its pages) from device memory at
fixed addresses. torch 2.11's ``varlen_attn`` takes no block table, and its max lengths are host
ints a graph would freeze. This is the split-key scheme of ``kernel.py`` (flash-decoding: each
program reduces one block of keys to a partial output and its log-sum-exp, a second kernel merges
them) with two changes: every row has its own length (``seq_lens[row]``; 0 reads nothing and
outputs zeros, which is what a padded row of a captured batch gets), and key ``n`` of a row lives
in page ``block_tables[row, n // page]`` of a cache laid out ``[pages, page, kv_heads, head_dim]``
(vLLM's layout). The launch depends on the shapes alone, never on the lengths, so a graph
captured once replays right at every step.

``cache_write`` stores a step's keys and values at their slots, skipping slot -1 (a padded row
writes nowhere).
"""

from __future__ import annotations

import torch

from .kernel import plan_splits, triton, triton_block_d

if triton is not None:
    import triton.language as tl

    # A Triton kernel reads as its math: kept as written.
    # fmt: off
    @triton.jit
    def _paged_partial_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr,
                              stride_qn, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                              stride_tn, heads, group, chunk, splits, scale,
                              PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
        row_head = tl.program_id(0)
        split = tl.program_id(1)
        row = row_head // heads
        h = row_head % heads
        kv_h = h // group
        length = tl.load(lens_ptr + row).to(tl.int32)
        start = split * chunk
        end = tl.minimum(start + chunk, length)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + row * stride_qn + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
        running_max = tl.full((), float("-inf"), tl.float32)
        denominator = tl.full((), 0.0, tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        n0 = start
        while n0 < end:  # a while: the bound is a loaded value (see kernel.py)
            n = n0 + tl.arange(0, BLOCK)
            n_ok = n < end
            page = tl.load(table_ptr + row * stride_tn + n // PAGE, mask=n_ok, other=0).to(tl.int64)
            slot = n % PAGE
            both = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + (page * stride_kp + slot * stride_ks + kv_h * stride_kh)[:, None] + d[None, :],
                        mask=both, other=0.0).to(tl.float32)
            scores = tl.where(n_ok, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=0))
            weights = tl.exp(scores - new_max)
            rescale = tl.exp(running_max - new_max)
            v = tl.load(v_ptr + (page * stride_vp + slot * stride_vs + kv_h * stride_vh)[:, None] + d[None, :],
                        mask=both, other=0.0).to(tl.float32)
            acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
            denominator = denominator * rescale + tl.sum(weights, axis=0)
            running_max = new_max
            n0 += BLOCK
        if start < length:  # a chunk past the row's length stores nothing (the merge skips it)
            slot_out = row_head * splits + split
            tl.store(out_ptr + slot_out * HEAD_DIM + d, acc / denominator, mask=d_ok)
            tl.store(lse_ptr + slot_out, running_max + tl.log(denominator))
    # fmt: on

    @triton.jit
    def _paged_merge_kernel(
        part_ptr,
        lse_ptr,
        out_ptr,
        lens_ptr,
        stride_on,
        stride_oh,
        heads,
        splits,
        chunk,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        row_head = tl.program_id(0)
        row = row_head // heads
        h = row_head % heads
        length = tl.load(lens_ptr + row).to(tl.int32)
        s = tl.arange(0, BLOCK_S)
        s_ok = s < tl.minimum(splits, (length + chunk - 1) // chunk)  # the live chunks (none: length 0)
        lse = tl.load(lse_ptr + row_head * splits + s, mask=s_ok, other=float("-inf"))
        top = tl.max(lse, axis=0)
        weights = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))
        total = tl.sum(weights, axis=0)
        weights = weights / tl.where(total > 0.0, total, 1.0)  # a row of length 0 gets zeros
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        part = tl.load(
            part_ptr + (row_head * splits + s[:, None]) * HEAD_DIM + d[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        out = tl.sum(weights[:, None] * part, axis=0)
        tl.store(out_ptr + row * stride_on + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)

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
) -> torch.Tensor:
    """The Triton path of ``paged_attention.paged_decode_attention`` (arguments checked there)."""
    rows, heads, dim = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    block, splits, chunk = plan_splits(rows * heads, block_tables.shape[1] * page, dim)
    partial = torch.empty(rows * heads * splits, dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(rows * heads * splits, device=q.device, dtype=torch.float32)
    block_d = triton_block_d(dim)
    _paged_partial_kernel[(rows * heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        partial,
        lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        heads,
        heads // kv_heads,
        chunk,
        splits,
        scale,
        PAGE=page,
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        BLOCK=block,
        num_warps=1,
    )
    _paged_merge_kernel[(rows * heads,)](
        partial,
        lse,
        out,
        seq_lens,
        out.stride(0),
        out.stride(1),
        heads,
        splits,
        chunk,
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(splits),
    )
    return out


def cache_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """The Triton path of ``paged_attention.paged_cache_write``."""
    rows, kv_heads, dim = k.shape
    _cache_write_kernel[(rows,)](
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
