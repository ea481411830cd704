"""Graph-safe paged decode attention for serving engines: what makes a decode step one CUDA graph.

A serving engine keeps its KV cache in pages (``[pages, page_size, kv_heads, head_dim]``) and gives
each request a row of a block table. For a batch of decode tokens to be captured whole
(``cudagraph_mode("full")``), its attention must read everything that changes per step from device
memory at fixed addresses: the engine writes each step's slots, block tables and lengths into
persistent buffers, and these functions read them there. A padded row (a batch of 5 replaying the
graph of 8) has slot -1 and length 0: it writes nowhere and reads nothing (its output is zeros).

* :func:`paged_cache_write` stores the step's keys and values at their slots;
* :func:`paged_decode_attention` attends each row's one query over its ``seq_lens[row]`` keys,
  grouped heads (GQA) included, any head size.

On CUDA with Triton both run Triton kernels (``paged_kernel.py``); elsewhere a gather over the
block table in plain torch (fixed shapes too, so it can be captured; it reads every page of the
table, where the kernel stops at each row's length).
"""

from __future__ import annotations

import math

import torch

from .capturing import capturing

__all__ = ["paged_decode_attention", "paged_cache_write"]


def _kernels(t: torch.Tensor):
    """The Triton kernels' module for a CUDA tensor when Triton is there, else None (imported only
    then: Triton's import is not paid by CPU users, nor at the package's import)."""
    if not t.is_cuda:
        return None
    from . import kernel, paged_kernel

    return paged_kernel if kernel.available() else None


def _check(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"paged_decode_attention: q must be [rows, heads, head_dim] and k_cache/v_cache "
            f"[pages, page_size, kv_heads, head_dim] of one shape; got q {tuple(q.shape)}, k_cache "
            f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != dim or heads % kv_heads:
        raise ValueError(
            f"paged_decode_attention: {heads} query heads of size {dim} cannot read {kv_heads} "
            f"cache heads of size {k_cache.shape[3]} (heads must be a multiple of kv_heads)"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] < rows or seq_lens.dim() != 1 or seq_lens.shape[0] < rows:
        raise ValueError(
            f"paged_decode_attention: block_tables must be [>= {rows}, pages per row] and seq_lens "
            f"[>= {rows}]; got {tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )
    if block_tables.dtype.is_floating_point or seq_lens.dtype.is_floating_point:
        raise TypeError("paged_decode_attention: block_tables and seq_lens must be integer tensors")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_decode_attention: the caches need a contiguous last (head) dim")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of each row's one query over its first ``seq_lens[row]`` cached keys.

    Args:
        q: ``[rows, heads, head_dim]``, one decode token per row.
        k_cache, v_cache: ``[pages, page_size, kv_heads, head_dim]``; ``heads`` a multiple of ``kv_heads``.
        block_tables: ``[>= rows, pages per row]`` integers: key ``n`` of a row is in page
            ``block_tables[row, n // page_size]`` (only the first ``rows`` rows are read).
        seq_lens: ``[>= rows]`` integers, the keys of each row (0: the row reads nothing, outputs 0).
        out: where to write the result (``[rows, heads, head_dim]``, any strides with a contiguous
            last dim); a new tensor when None.
        scale: as SDPA's (None: ``1 / sqrt(head_dim)``).
    Returns ``out``.
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    rows = q.shape[0]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    paged_kernel = _kernels(q)
    if paged_kernel is not None and out.stride(-1) == 1:
        if q.stride(-1) != 1:
            q = q.contiguous()
        return paged_kernel.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out, scale)
    out.copy_(reference_decode_attention(q, k_cache, v_cache, block_tables[:rows], seq_lens[:rows], scale))
    return out


def reference_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same in plain torch: every page of each row's table gathered, keys past its length masked;
    each group of query heads against its one cache head (the keys are not repeated per query head)."""
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    tables = block_tables.long()
    keys = k_cache[tables].reshape(rows, -1, kv_heads, dim).float()  # [rows, pages * page, kv_heads, dim]
    values = v_cache[tables].reshape(rows, -1, kv_heads, dim).float()
    grouped = q.float().view(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("rkgd,rnkd->rkgn", grouped, keys) * scale
    live = torch.arange(keys.shape[1], device=q.device)[None, :] < seq_lens.long()[:, None]  # [rows, keys]
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no keys: zeros, not NaN
    return torch.einsum("rkgn,rnkd->rkgd", weights, values).reshape(rows, heads, dim).to(q.dtype)


def paged_cache_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store row ``i`` of ``k``/``v`` (``[rows, kv_heads, head_dim]``) at slot ``slot_mapping[i]`` of the caches
    (page ``slot // page_size``, offset ``slot % page_size``); a slot of -1 writes nothing."""
    rows = k.shape[0]
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < rows or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"paged_cache_write: k {tuple(k.shape)} must be [rows, kv_heads, head_dim] of the cache's "
            f"{tuple(k_cache.shape[2:])}, slot_mapping [>= rows]; got {tuple(slot_mapping.shape)}"
        )
    slots = slot_mapping[:rows]
    paged_kernel = _kernels(k)
    if paged_kernel is not None and k_cache.is_contiguous() and v_cache.is_contiguous():
        return paged_kernel.cache_write(k, v, k_cache, v_cache, slots)
    if capturing(k):
        return None  # a CUDA capture records the write and runs nothing: an emulated one writes nothing either
    keep = slots >= 0  # plain torch: a data-dependent selection (not capturable, fine off the GPU)
    flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slots[keep].long(), k[keep].to(k_cache.dtype))
    flat_v.index_copy_(0, slots[keep].long(), v[keep].to(v_cache.dtype))
    return None
