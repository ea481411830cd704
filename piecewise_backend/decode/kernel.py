"""Split-key decode attention over a cache prefix whose length is on the device (Triton).

Why a kernel of our own: ``graph_attention`` needs attention that reads its length from device
memory, so one CUDA graph serves every step. PyTorch's kernels that take a device length (the
memory-efficient one's ``seqlen_k``, flash's ``seqused_k``) give each (row, head) one thread block
that walks all its keys in turn; at batch 1 that is 16 blocks for a 132-SM H200, and the walk's
latency is paid once per layer. SDPA's flash kernel splits the keys across blocks when the
length is a host int ("flash-decoding"); this does the same with a device length: the keys are cut
into ``splits`` chunks, each program reduces one (row, head, chunk) to a partial output and its
log-sum-exp, and a second kernel merges the chunks. Chunks past the live length exit at once, so
the launch is identical at every step while the work follows the length.

The split count is fixed per shape (batch, heads, buffer length), chosen to give about two
programs per SM; it never depends on the length, which a captured graph could not follow.
"""

from __future__ import annotations

import functools
import math

import torch

try:  # Triton ships with CUDA builds of torch; CPU builds run prefix attention as masked SDPA
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_N = 64  # keys per inner step


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _partial_kernel(q_ptr, k_ptr, v_ptr, length_ptr, out_ptr, lse_ptr,
                        stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
                        heads, chunk, splits, scale,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
        row_head = tl.program_id(0)
        split = tl.program_id(1)
        b = row_head // heads
        h = row_head % heads
        length = tl.load(length_ptr).to(tl.int32)
        start = split * chunk
        end = tl.minimum(start + chunk, length)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
        k_base = k_ptr + b * stride_kb + h * stride_kh
        v_base = v_ptr + b * stride_vb + h * stride_vh
        running_max = tl.full((), float("-inf"), tl.float32)
        denominator = tl.full((), 0.0, tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        n0 = start
        while n0 < end:  # (a while, not range(start, end): Triton 3.6's interpreter cannot take a
            n = n0 + tl.arange(0, BLOCK)  # loaded value as a range bound under NumPy 2)
            n_ok = n < end
            both = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + n[:, None] * stride_kl + d[None, :], mask=both, other=0.0).to(tl.float32)
            scores = tl.where(n_ok, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=0))
            weights = tl.exp(scores - new_max)
            rescale = tl.exp(running_max - new_max)
            v = tl.load(v_base + n[:, None] * stride_vl + d[None, :], mask=both, other=0.0).to(tl.float32)
            acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
            denominator = denominator * rescale + tl.sum(weights, axis=0)
            running_max = new_max
            n0 += BLOCK
        has_keys = denominator > 0.0
        out = acc / tl.where(has_keys, denominator, 1.0)
        lse = tl.where(has_keys, running_max + tl.log(tl.where(has_keys, denominator, 1.0)), float("-inf"))
        slot = row_head * splits + split
        tl.store(out_ptr + slot * HEAD_DIM + d, out, mask=d_ok)
        tl.store(lse_ptr + slot, lse)

    @triton.jit
    def _merge_kernel(part_ptr, lse_ptr, out_ptr, splits,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        row_head = tl.program_id(0)
        s = tl.arange(0, BLOCK_S)
        s_ok = s < splits
        lse = tl.load(lse_ptr + row_head * splits + s, mask=s_ok, other=float("-inf"))
        weights = tl.exp(lse - tl.max(lse, axis=0))  # chunk 0 always holds key 0: the max is finite
        weights = weights / tl.sum(weights, axis=0)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        part = tl.load(part_ptr + (row_head * splits + s[:, None]) * HEAD_DIM + d[None, :],
                       mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        out = tl.sum(weights[:, None] * part, axis=0)
        tl.store(out_ptr + row_head * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@functools.lru_cache(maxsize=None)
def _processors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_splits(row_heads: int, buffer_len: int, processors: int) -> tuple[int, int]:
    """(splits, chunk): about two programs per SM, chunks whole multiples of BLOCK_N keys."""
    most = max(1, math.ceil(buffer_len / BLOCK_N))
    splits = min(most, max(1, math.ceil(2 * processors / row_heads)))
    chunk = math.ceil(math.ceil(buffer_len / splits) / BLOCK_N) * BLOCK_N
    return math.ceil(buffer_len / chunk), chunk


def prefix_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor,
                     processors: int | None = None) -> torch.Tensor:
    """Attention of ``q`` [B, H, 1, D] over positions ``[0, length)`` of ``keys``/``values`` [B, H, L, D]
    (last dim contiguous); ``length`` a one-element integer tensor on the same device, 1 <= length <= L."""
    batch, heads, _, dim = q.shape
    buffer_len = keys.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("prefix_attention: keys and values need a contiguous last (head) dim")
    if processors is None:
        processors = _processors(q.device.index if q.device.index is not None else torch.cuda.current_device())
    splits, chunk = plan_splits(batch * heads, buffer_len, processors)
    partial = torch.empty(batch * heads * splits, dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(batch * heads * splits, device=q.device, dtype=torch.float32)
    out = torch.empty(batch, heads, 1, dim, device=q.device, dtype=q.dtype)
    block_d = triton.next_power_of_2(dim)
    _partial_kernel[(batch * heads, splits)](
        q, keys, values, length, partial, lse,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        heads, chunk, splits, 1.0 / math.sqrt(dim),
        HEAD_DIM=dim, BLOCK_D=block_d, BLOCK=BLOCK_N)
    _merge_kernel[(batch * heads,)](partial, lse, out, splits, HEAD_DIM=dim, BLOCK_D=block_d,
                                    BLOCK_S=triton.next_power_of_2(splits))
    return out
