"""``piecewise::prefix_attention``: decode attention over a cache prefix whose length is on the device.

The op the decode rewrite (``rewrite/graph_attention.py``) puts in place of SDPA, so that one CUDA
graph serves every step: it reads the live length from a tensor, never from a host int. On CUDA it
runs the split-key Triton kernel of ``kernel.py``, or without Triton the memory-efficient kernel in
its variable-length form; elsewhere (and for a caller's mask without Triton) SDPA over the whole
buffer with the positions past the length masked out. Registered with ``torch.library`` when this
module is imported: rewritten graphs call it at run time, so it lives apart from the rewrite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..op_names import GRAPH_ATTENTION_OP


@torch.library.custom_op(GRAPH_ATTENTION_OP, mutates_args=())
def prefix_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [B, H, S, D] over positions ``[0, length)`` of ``k_cache[:B]``, ``v_cache[:B]``
    ([B, H / G, L, D]: each group of G query heads reads one cache head, as ``enable_gqa=True``);
    ``mask``: SDPA's ``attn_mask`` over the whole buffer, [B or more rows, or 1; H or 1; 1; L] (its
    rows past B and its positions past the length are not read)."""
    batch = q.shape[0]
    keys, values = k_cache[:batch], v_cache[:batch]
    if mask is not None and mask.shape[0] != 1:
        mask = mask[:batch]
    if q.is_cuda:
        from . import kernel  # imports Triton: only when a GPU step needs it

        if kernel.available():
            return kernel.prefix_attention(q, keys, values, length, scale, mask)
        if mask is None:
            return _efficient_prefix_attention(q, keys, values, length, scale)
    return _masked_prefix_attention(q, keys, values, length, scale, mask)


def _masked_prefix_attention(q, keys, values, length, scale=None, mask=None):
    """SDPA over the whole buffer, the positions past ``length`` masked out: the CPU path (and the
    CUDA one for a caller's mask without Triton). Fixed shapes, so it can be captured; it reads the
    whole buffer, where the kernels stop at the length."""
    live = torch.arange(keys.shape[2], device=q.device) < length
    if mask is None:
        combined = live.view(1, -1)
    elif mask.dtype == torch.bool:
        combined = mask & live
    else:
        combined = mask.masked_fill(~live, float("-inf"))
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=combined, scale=scale, enable_gqa=q.shape[1] != keys.shape[1]
    ).contiguous()


PREFIX_ATTENTION = torch.ops.piecewise.prefix_attention.default  # what the rewritten graphs call


def _efficient_prefix_attention(q, keys, values, length, scale=None):
    """The memory-efficient kernel in its variable-length form, one "sequence" per (row, head).

    The kernel honours ``seqlen_k`` (a device tensor) only together with ``cu_seqlens_q/k``: without
    them it attends over the whole buffer (seen on the H200, torch 2.11: wrong logits). The varlen
    form wants every sequence's keys at one stride; a contiguous ``[B, H, L, D]`` cache is exactly
    ``B * H`` sequences of ``L`` keys each with one head, so the cache is read in place (no copy),
    but for GQA, whose cache heads are repeated for it (a copy: this path is for CUDA without Triton).
    """
    batch, heads, _, dim = q.shape
    if keys.shape[1] != heads:
        keys, values = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (keys, values))
    size = keys.shape[2]
    sequences = batch * heads
    starts = torch.arange(sequences + 1, device=q.device, dtype=torch.int32)
    seqlen = length.to(torch.int32).reshape(1).expand(sequences).contiguous()
    out = torch.ops.aten._efficient_attention_forward(
        q.reshape(1, sequences, 1, dim),
        keys.reshape(1, sequences * size, 1, dim),
        values.reshape(1, sequences * size, 1, dim),
        None,
        starts,
        starts * size,
        1,
        size,
        0.0,
        0,
        False,
        scale=scale,
        seqlen_k=seqlen,
    )[0]
    return out.reshape(batch, heads, 1, dim)


@prefix_attention.register_fake
def _(q, k_cache, v_cache, length, scale=None, mask=None):
    return q.new_empty(q.shape)
