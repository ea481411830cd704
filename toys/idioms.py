"""Decoders written in idioms other than the toys' own, for testing and measuring the backend on code
that was not written around it.

:class:`WholeCacheLlama` is a Llama as many people write one: caches sized to the batch
(``[B, heads, max_seq, head_dim]``, made by :meth:`~WholeCacheLlama.set_batch`), the step written with
``k_cache[:, :, t:t + S].copy_(k)``, attention over ``k_cache[:, :, :t + S]`` (the whole batch, no
``[:B]``), RoPE rows gathered by a position tensor, and ``t`` a Python int.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .models import LlamaMLP, RMSNorm, ToyConfig, _rope_tables, _rotate_half


class _WholeCacheAttention(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.out = nn.Linear(h, h, bias=False)
        self.set_batch(cfg.max_batch)

    def set_batch(self, batch: int) -> None:
        shape = (batch, self.cfg.heads, self.cfg.max_seq, self.cfg.head_dim)
        device = self.qkv.weight.device
        self.register_buffer(
            "k_cache", torch.zeros(shape, device=device, dtype=self.qkv.weight.dtype), persistent=False
        )
        self.register_buffer("v_cache", torch.zeros_like(self.k_cache), persistent=False)

    def forward(self, x: torch.Tensor, t: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        q, k, v = (p.view(B, S, self.cfg.heads, -1).transpose(1, 2) for p in self.qkv(x).chunk(3, dim=-1))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        self.k_cache[:, :, t : t + S].copy_(k)
        self.v_cache[:, :, t : t + S].copy_(v)
        if S > 1:  # the prompt, from position 0
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, self.k_cache[:, :, : t + 1], self.v_cache[:, :, : t + 1])
        return self.out(o.transpose(1, 2).reshape(B, S, H))


class _Layer(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.hidden), RMSNorm(cfg.hidden)
        self.attn, self.mlp = _WholeCacheAttention(cfg), LlamaMLP(cfg)

    def forward(self, x, t, cos, sin):
        x = x + self.attn(self.attn_norm(x), t, cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class WholeCacheLlama(nn.Module):
    """``forward(input_ids, t)``: logits; the caches hold exactly ``set_batch(B)`` rows."""

    idiom = "whole-cache"

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = _rope_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def set_batch(self, batch: int) -> None:
        """New, zeroed caches of ``batch`` rows (what a user does per request batch)."""
        for layer in self.layers:
            layer.attn.set_batch(batch)

    def forward(self, input_ids: torch.Tensor, t: int) -> torch.Tensor:
        positions = torch.arange(t, t + input_ids.shape[1], device=input_ids.device)
        cos, sin = self.cos[positions], self.sin[positions]
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, t, cos, sin)
        return self.head(self.norm(x))
