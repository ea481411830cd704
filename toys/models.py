"""Toy decoders written the plain way, for the demo, the tests and the benchmarks.

They are deliberately *not* written for a compiler: the KV cache is a preallocated buffer that is
sliced with a Python-int position ``pos`` and written with ``cache[:, :, pos:pos + S] = k``, exactly
how people write their first decoder. That is the hard case for a CUDA-graph backend: ``pos`` changes
every decode step, and a naive split would bake it into the captured pieces and recapture every step.

- :class:`ToyLlama`: RMSNorm, RoPE, SwiGLU, SDPA; cache and RoPE tables are module buffers.
- :class:`ToyGPT`: LayerNorm, fused QKV, GELU MLP, learned positions; the KV caches are *forward
  arguments* (user inputs that the graph mutates), to exercise that path.
- :class:`ToyCustomAttentionLlama`: ToyLlama whose attention is a user op registered with
  ``torch.library.custom_op`` (``toyattn::attention``), split on by name.
- :class:`ToyStaticCacheLlama`: the graph-safe way (tensor positions, ``index_copy_`` cache write,
  masked attention over the whole cache), for ``mode="full"``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ToyConfig",
    "ToyLlama",
    "ToyGPT",
    "ToyCustomAttentionLlama",
    "ToyStaticCacheLlama",
    "decode_loop",
    "init_weights_",
    "reset_caches",
    "sdpa_backends",
]


# The toy Llamas the benchmarks and the GPU demo time (the sizes): one definition for the
# suite, the tensor-parallel timing, the demo and the tests that need the same matmul shapes.
BENCHMARK_SIZES = {
    "16L": dict(vocab=32000, hidden=1024, layers=16, heads=16, intermediate=2816),
    "28L": dict(vocab=32000, hidden=1536, layers=28, heads=12, intermediate=8960),
}


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab: int = 128
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    intermediate: int = 128
    max_batch: int = 8
    max_seq: int = 64
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_tables(cfg: ToyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    freqs = torch.outer(torch.arange(cfg.max_seq).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class LlamaAttention(nn.Module):
    """``heads``: how many of the model's heads this module holds (all, or a tensor-parallel share)."""

    def __init__(self, cfg: ToyConfig, attention=sdpa, heads: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.heads = nh = heads or cfg.heads
        h, hd = cfg.hidden, cfg.head_dim
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nh * hd, bias=False)
        self.v_proj = nn.Linear(h, nh * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.register_buffer("k_cache", torch.zeros(cfg.max_batch, nh, cfg.max_seq, hd), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cfg.max_batch, nh, cfg.max_seq, hd), persistent=False)
        self.attention = attention

    def project(self, x, cos, sin):
        """q, k, v as [B, heads, S, head_dim], RoPE applied to q and k."""
        B, S, _ = x.shape
        nh, hd = self.heads, self.cfg.head_dim
        q = self.q_proj(x).view(B, S, nh, hd).transpose(1, 2)
        k = self.k_proj(x).view(B, S, nh, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, S, nh, hd).transpose(1, 2)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def forward(self, x, cos, sin, pos: int):
        B, S, _ = x.shape
        nh, hd = self.heads, self.cfg.head_dim
        q, k, v = self.project(x, cos, sin)
        # The plain way: write this step's keys at `pos`, attend over the prefix [0, pos + S).
        self.k_cache[:B, :, pos : pos + S] = k
        self.v_cache[:B, :, pos : pos + S] = v
        keys = self.k_cache[:B, :, : pos + S]
        values = self.v_cache[:B, :, : pos + S]
        o = self.attention(q, keys, values, True if S > 1 else False)  # prefill starts at pos 0: causal is exact
        return self.o_proj(o.transpose(1, 2).reshape(B, S, nh * hd))


class LlamaMLP(nn.Module):
    """``intermediate``: the width this module holds (all, or a tensor-parallel share)."""

    def __init__(self, cfg: ToyConfig, intermediate: int | None = None):
        super().__init__()
        width = intermediate or cfg.intermediate
        self.gate = nn.Linear(cfg.hidden, width, bias=False)
        self.up = nn.Linear(cfg.hidden, width, bias=False)
        self.down = nn.Linear(width, cfg.hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class StaticCacheAttention(LlamaAttention):
    """Graph-safe attention (HF "static cache" style): the position is a tensor, the cache write is
    an ``index_copy_`` at it, and attention spans the whole cache under a mask. Nothing depends on
    a Python int, so the whole step can be one CUDA graph (``mode="full"``)."""

    def forward(self, x, cos, sin, cache_position: torch.Tensor):
        B, S, _ = x.shape
        nh, hd = self.heads, self.cfg.head_dim
        q, k, v = self.project(x, cos, sin)
        self.k_cache[:B].index_copy_(2, cache_position, k)
        self.v_cache[:B].index_copy_(2, cache_position, v)
        mask = torch.arange(self.cfg.max_seq, device=x.device) <= cache_position.view(-1, 1)
        o = F.scaled_dot_product_attention(q, self.k_cache[:B], self.v_cache[:B], attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, nh * hd))


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ToyConfig, attention=sdpa, attn_cls=LlamaAttention, mlp_cls=LlamaMLP):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = attn_cls(cfg, attention)
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.mlp = mlp_cls(cfg)

    def forward(self, x, cos, sin, pos: int):
        x = x + self.attn(self.attn_norm(x), cos, sin, pos)
        return x + self.mlp(self.mlp_norm(x))


class ToyLlama(nn.Module):
    """A Llama-style decoder: ``forward(input_ids [B, S], pos: int) -> logits [B, S, vocab]``."""

    def __init__(self, cfg: ToyConfig = ToyConfig(), attention=sdpa):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(LlamaLayer(cfg, attention) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = _rope_tables(cfg)
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, pos: int) -> torch.Tensor:
        S = input_ids.shape[1]
        cos = self.cos_cached[pos : pos + S]
        sin = self.sin_cached[pos : pos + S]
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, pos)
        return self.lm_head(self.norm(x))


class ToyStaticCacheLlama(ToyLlama):
    """``forward(input_ids [B, S], cache_position [S] long) -> logits``: ToyLlama with
    :class:`StaticCacheAttention`, for full-graph mode."""

    def __init__(self, cfg: ToyConfig = ToyConfig()):
        super().__init__(cfg)
        self.layers = nn.ModuleList(LlamaLayer(cfg, attn_cls=StaticCacheAttention) for _ in range(cfg.layers))

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        cos = self.cos_cached[cache_position]
        sin = self.sin_cached[cache_position]
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, cache_position)
        return self.lm_head(self.norm(x))


# --- a user's own attention op, registered with torch.library.custom_op --------------------------


@torch.library.custom_op("toyattn::attention", mutates_args=())
def custom_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@custom_attention.register_fake
def _(q, k, v, causal):
    return torch.empty_like(q)


def _call_custom_attention(q, k, v, causal: bool):
    return custom_attention(q, k, v, causal)


class ToyCustomAttentionLlama(ToyLlama):
    """ToyLlama with ``toyattn::attention`` instead of SDPA; split it with
    ``options={"extra_splitting_ops": ["toyattn::attention"]}``."""

    def __init__(self, cfg: ToyConfig = ToyConfig()):
        super().__init__(cfg, attention=_call_custom_attention)


# --- GPT-style: caches are forward arguments --------------------------------------------------------


class GPTBlock(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, cfg.intermediate)
        self.fc_out = nn.Linear(cfg.intermediate, cfg.hidden)

    def forward(self, x, k_cache, v_cache, pos: int):
        B, S, H = x.shape
        nh, hd = self.cfg.heads, self.cfg.head_dim
        q, k, v = self.qkv(self.ln1(x)).split(H, dim=-1)
        q, k, v = (t.view(B, S, nh, hd).transpose(1, 2) for t in (q, k, v))
        k_cache[:B, :, pos : pos + S] = k
        v_cache[:B, :, pos : pos + S] = v
        o = sdpa(q, k_cache[:B, :, : pos + S], v_cache[:B, :, : pos + S], True if S > 1 else False)
        x = x + self.proj(o.transpose(1, 2).reshape(B, S, H))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class ToyGPT(nn.Module):
    """``forward(input_ids, caches, pos)``; ``caches`` is a list of (k, v) tensors the model writes."""

    def __init__(self, cfg: ToyConfig = ToyConfig()):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.max_seq, cfg.hidden)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def new_caches(self, device=None, dtype=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.cfg
        shape = (c.max_batch, c.heads, c.max_seq, c.head_dim)
        return [
            (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in range(c.layers)
        ]

    def forward(self, input_ids, caches, pos: int):
        S = input_ids.shape[1]
        positions = torch.arange(pos, pos + S, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block, (k_cache, v_cache) in zip(self.blocks, caches):
            x = block(x, k_cache, v_cache, pos)
        return self.head(self.ln_f(x))


def sdpa_backends(device: str):
    """Pin SDPA to flash/efficient on CUDA: its default choice re-plans for every new KV length
    (about 3 ms of host time each on the H200). A no-op context elsewhere."""
    import contextlib

    if device != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def reset_caches(model: nn.Module) -> None:
    """Zero every KV cache buffer of a ToyLlama-style model (between runs that must match)."""
    for name, buf in model.named_buffers():
        if name.endswith("_cache"):
            buf.zero_()


def next_tokens(logits: torch.Tensor, mark_batch_dynamic: bool = False) -> torch.Tensor:
    """Greedy next tokens ``[B, 1]`` from logits ``[B, S, vocab]``. ``mark_batch_dynamic``: tell
    Dynamo their batch dim varies, so one decode graph serves every batch size."""
    ids = logits[:, -1:].argmax(-1)
    if mark_batch_dynamic:
        torch._dynamo.maybe_mark_dynamic(ids, 0)
    return ids


def decode_loop(step, input_ids: torch.Tensor, new_tokens: int) -> list[torch.Tensor]:
    """Prefill ``input_ids`` then decode greedily; ``step(ids, pos)`` returns logits.

    Returns every step's logits (cloned), so two runs can be compared step by step.
    """
    outs = []
    logits = step(input_ids, 0)
    outs.append(logits.clone())
    pos = input_ids.shape[1]
    for _ in range(new_tokens):
        logits = step(next_tokens(logits), pos)
        outs.append(logits.clone())
        pos += 1
    return outs


def init_weights_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Deterministic, well-scaled random weights (so argmax decoding is not degenerate)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model
