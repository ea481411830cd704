"""Split-key decode attention over a cache prefix whose length is on the device (Triton).

Why a kernel of our own: ``graph_attention`` needs attention that reads its length from device
memory, so one CUDA graph serves every step. PyTorch's kernels that take a device length (the
memory-efficient one's ``seqlen_k``, flash's ``seqused_k``) give each (row, head) one thread block
that walks all its keys in turn; at batch 1 that is 16 blocks for a 132-SM H200, and the walk's
latency is paid once per layer. SDPA's flash kernel splits the keys across blocks when the
length is a host int ("flash-decoding"); this does the same with a device length: the keys are cut
into ``splits`` chunks, each program reduces one (row, head, chunk) to a partial output and its
log-sum-exp, and a second kernel merges the live chunks. Chunks past the live length store
nothing, so the launch is identical at every step while the work follows the length.

The launch is fixed per shape, never per live length (a captured graph cannot follow the length),
and a decode's live prefix is usually a fraction of its buffer, so chunks sized for a full buffer
leave most programs idle. Each program therefore takes one block of keys (``block`` of them,
by the number of (row, head) pairs) and runs as one warp; only buffers longer than
``MAX_SPLITS`` blocks get chunks of several blocks. More warps per program lose: a block's two reductions (over the head dim, then over the keys) cross
warps through shared memory (the block sizes measured: ``benchmarks/README.md``, "Measurement history").
"""

from __future__ import annotations

import inspect
import math

import torch

try:  # Triton ships with CUDA builds of torch; CPU builds run prefix attention as masked SDPA
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

from .kernel_bundle import note  # noqa: E402 - after the optional Triton import

MAX_SPLITS = 256  # chunks per (row, head) at most: the merge reduces them in one block


def available() -> bool:
    return triton is not None


def unspecialised(*names: str) -> dict:
    """``triton.jit`` options that keep Triton from specialising on these integer arguments'
    values (1, divisible by 16), where this Triton has them (3.x)."""
    params = inspect.signature(triton.jit).parameters
    return {k: list(names) for k in ("do_not_specialize", "do_not_specialize_on_alignment") if k in params}


if triton is not None:
    # A Triton kernel reads as its math: kept as written.
    # fmt: off
    @triton.jit(**unspecialised("stride_mb"))  # a row mask broadcast at one row (0) or not: one binary
    def _partial_kernel(q_ptr, k_ptr, v_ptr, length_ptr, out_ptr, lse_ptr, mask_ptr,
                        stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
                        stride_mb, stride_mh, stride_ml, heads, group, chunk, splits, scale,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr):
        row_head = tl.program_id(0)
        split = tl.program_id(1)
        b = row_head // heads
        h = row_head % heads
        kv_h = h // group  # GQA: ``group`` query heads read one cache head
        length = tl.load(length_ptr).to(tl.int32)
        start = split * chunk
        end = tl.minimum(start + chunk, length)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
        k_base = k_ptr + b * stride_kb + kv_h * stride_kh
        v_base = v_ptr + b * stride_vb + kv_h * stride_vh
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
            if HAS_MASK:  # SDPA's attn_mask: False (or -inf) drops a key; a block may lose every key
                m = tl.load(mask_ptr + b * stride_mb + h * stride_mh + n * stride_ml, mask=n_ok, other=0)
                if MASK_BOOL:
                    scores = tl.where(m != 0, scores, float("-inf"))
                else:
                    scores = scores + m.to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(scores, axis=0))
            finite_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a block the mask emptied: no NaN
            weights = tl.exp(scores - finite_max)
            rescale = tl.exp(running_max - finite_max)
            v = tl.load(v_base + n[:, None] * stride_vl + d[None, :], mask=both, other=0.0).to(tl.float32)
            acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
            denominator = denominator * rescale + tl.sum(weights, axis=0)
            running_max = new_max
            n0 += BLOCK
        has_keys = denominator > 0.0
        out = acc / tl.where(has_keys, denominator, 1.0)
        lse = tl.where(has_keys, running_max + tl.log(tl.where(has_keys, denominator, 1.0)), float("-inf"))
        if start < length:  # a chunk past the live prefix stores nothing (the merge skips it)
            slot = row_head * splits + split
            tl.store(out_ptr + slot * HEAD_DIM + d, out, mask=d_ok)
            tl.store(lse_ptr + slot, lse)
    # fmt: on

    @triton.jit
    def _merge_kernel(
        part_ptr,
        lse_ptr,
        out_ptr,
        length_ptr,
        splits,
        chunk,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        row_head = tl.program_id(0)
        length = tl.load(length_ptr).to(tl.int32)
        s = tl.arange(0, BLOCK_S)
        s_ok = s < tl.minimum(splits, (length + chunk - 1) // chunk)  # the live chunks
        lse = tl.load(lse_ptr + row_head * splits + s, mask=s_ok, other=float("-inf"))
        top = tl.max(lse, axis=0)  # -inf only when a mask dropped every key: the output is 0, as SDPA's
        weights = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))
        total = tl.sum(weights, axis=0)
        weights = weights / tl.where(total > 0.0, total, 1.0)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        part = tl.load(
            part_ptr + (row_head * splits + s[:, None]) * HEAD_DIM + d[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        out = tl.sum(weights[:, None] * part, axis=0)
        tl.store(out_ptr + row_head * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


TILE = 128 * 64  # keys x head dims one warp holds at most: the best measured (block 128, head dim 64)
FEW_PAIRS, MANY_PAIRS = 32, 256  # (row, head) pairs up to which blocks of 16, then of 64 keys; past it 128


def block_size(row_heads: int, head_dim: int = 64) -> int:
    """Keys per block for ``row_heads`` (row, head) pairs: small blocks (more programs) when there
    are few pairs, large ones (fewer, longer programs) when there are many (see the table above),
    no larger than one warp's ``TILE`` (a head dim of 128 halves the largest: registers)."""
    block = 16 if row_heads <= FEW_PAIRS else 64 if row_heads <= MANY_PAIRS else 128
    return max(16, min(block, TILE // triton_block_d(head_dim)))


def triton_block_d(head_dim: int) -> int:
    return 1 << max(0, head_dim - 1).bit_length()  # the next power of two (Triton's tiles)


def plan_splits(row_heads: int, buffer_len: int, head_dim: int = 64) -> tuple[int, int, int]:
    """(block, splits, chunk): chunks of one block, or of whole blocks for buffers longer than
    ``MAX_SPLITS`` blocks; ``splits * chunk >= buffer_len``."""
    return _tiling(block_size(row_heads, head_dim), buffer_len)


def _tiling(block: int, buffer_len: int) -> tuple[int, int, int]:
    most = max(1, math.ceil(buffer_len / block))
    chunk = math.ceil(most / MAX_SPLITS) * block
    return block, math.ceil(buffer_len / chunk), chunk


def prefix_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    length: torch.Tensor,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [B, H, 1, D] over positions ``[0, length)`` of ``keys``/``values`` [B, H / G, L, D]
    (last dim contiguous; each group of G query heads reads one cache head); ``length`` a one-element
    integer tensor on the same device, 1 <= length <= L; ``scale`` as SDPA's (None: 1 / sqrt(D));
    ``mask`` SDPA's ``attn_mask`` [B or 1, H or 1, 1, L], bool or additive (a row it drops whole: 0)."""
    batch, heads, _, dim = q.shape
    buffer_len = keys.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("prefix_attention: keys and values need a contiguous last (head) dim")
    block, splits, chunk = plan_splits(batch * heads, buffer_len, dim)
    out = launch(q, keys, values, length, scale, mask, block, splits, chunk)
    _prime(q, keys, values, length, scale, mask, block)
    return out


_PRIMED: set = set()  # (device, dtypes, shapes and strides the binaries depend on): every block size compiled


def _prime(q, keys, values, length, scale, mask, used_block: int) -> None:
    """Launch, on the first row and into scratch outputs, the block sizes this call did not use:
    a later batch size picks its block by its (row, head) pairs (:func:`block_size`), and its
    first step (a request's, or a capture behind the calls) would otherwise compile Triton's
    binary for it. Once per model and device, and never inside a capture."""
    dim = q.shape[-1]
    key = (q.device, q.dtype, keys.dtype, q.shape[1:], keys.shape[1:], keys.stride(), q.stride()[1:])
    key += (None,) if mask is None else (mask.dtype, mask.shape[1:], mask.stride()[1:])
    if not q.is_cuda or key in _PRIMED or torch.cuda.is_current_stream_capturing():  # (not Triton's interpreter)
        return
    _PRIMED.add(key)
    for block in sorted({block_size(pairs, dim) for pairs in (1, FEW_PAIRS + 1, MANY_PAIRS + 1)} - {used_block}):
        one_row_mask = None if mask is None else mask[:1]
        launch(q[:1], keys[:1], values[:1], length, scale, one_row_mask, *_tiling(block, keys.shape[2]))


def launch(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    length: torch.Tensor,
    scale: float | None,
    mask: torch.Tensor | None,
    block: int,
    splits: int,
    chunk: int,
    warps: int = 1,
) -> torch.Tensor:
    """:func:`prefix_attention` with its tiling given (``splits`` programs per head, each over ``chunk``
    keys in blocks of ``block``): one launch path for the op and for the benchmark that tunes it."""
    batch, heads, _, dim = q.shape
    partial = torch.empty(batch * heads * splits, dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(batch * heads * splits, device=q.device, dtype=torch.float32)
    out = torch.empty(batch, heads, 1, dim, device=q.device, dtype=q.dtype)
    block_d = triton_block_d(dim)
    # a broadcast dim of the mask (size 1) is read at stride 0; without a mask, q stands in (never read)
    mask_strides = [0 if mask.shape[i] == 1 else mask.stride(i) for i in (0, 1, 3)] if mask is not None else [0, 0, 0]
    launched = _partial_kernel[(batch * heads, splits)](
        q,
        keys,
        values,
        length,
        partial,
        lse,
        mask if mask is not None else q,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        *mask_strides,
        heads,
        heads // keys.shape[1],
        chunk,
        splits,
        1.0 / math.sqrt(dim) if scale is None else scale,
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        BLOCK=block,
        HAS_MASK=mask is not None,
        MASK_BOOL=mask is not None and mask.dtype == torch.bool,
        num_warps=warps,
    )
    note(launched)  # its binary goes into saved artifacts (kernel_bundle.py)
    launched = _merge_kernel[(batch * heads,)](
        partial, lse, out, length, splits, chunk, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits)
    )
    note(launched)  # its binary goes into saved artifacts (kernel_bundle.py)
    return out
