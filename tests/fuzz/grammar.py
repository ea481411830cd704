"""Random small models from a grammar of the ops that break CUDA-graph backends.

A model is a seeded list of blocks over a hidden state ``x: [B, T, W]`` (``B`` the batch, ``T`` a
few positions per row) and a Python-int KV position ``pos``. The blocks are chosen so that every
class of silent bug has a way in:

* row-wise ops (linear + activation + norm, softmax over features, attention within a row);
* reductions along each dim, the batch dim among them (``x - x.mean(0)``, a cumulative sum, a
  max over features);
* norms with batch statistics (``BatchNorm1d`` without running stats, or in train mode, which also
  writes its running-stat buffers) and with running statistics (row-wise);
* attention idioms: SDPA over a KV-cache prefix written at ``pos`` (``cache[:B, :, pos:pos + 1] = k``,
  the graph-attention path), causal SDPA within a row, attention written by hand within a row, and
  attention over the batch (every row meets every other);
* caches with fewer, as many or more rows than the largest batch, read and written by batch row;
* in-place writes into buffers (a step counter);
* outputs that are views of the input and of a parameter;
* values that cross a piece boundary other than one tensor (``ACROSS``): a ``chunk`` whose second
  half is read only after an attention (the tuple would cross), a ``topk`` likewise, Python numbers
  made from the sizes (a SymInt, a SymFloat of the batch size, a bool) read after an attention;
* graph breaks: ``.item()`` of a buffer, a branch on the data, a ``print``.

About a third of the models are compiled with ``dynamic=True`` (the runner), the rest with the
batch marked dynamic.

The runner (``runner.py``) swaps the weights between calls too. Nothing here knows what the backend
should pad or graph: the fuzzer only compares with eager.
"""

from __future__ import annotations

import dataclasses
import io
import math
import random

import torch
import torch.nn.functional as F
from torch import nn

T = 2  # positions per row
WIDTH = 8
T_MAX = 16  # KV-cache length

ROW_WISE = (
    "mlp",
    "softmax_features",
    "center_positions",
    "max_features",
    "running_norm",
    "attention_in_row",
    "causal_sdpa",
    "select_position",
)
MIXING = ("center_batch", "cumsum_batch", "batch_statistics", "train_norm", "attention_over_batch", "last_row")
CACHED = ("kv_cache", "cache_read")
WRITES = ("counter",)
ACROSS = ("chunk_across", "topk_across", "scalars_across", "break_item", "break_branch", "break_print")
BLOCKS = ROW_WISE + MIXING + CACHED + WRITES + ACROSS
STATELESS = frozenset(
    ROW_WISE
    + ("center_batch", "cumsum_batch", "batch_statistics", "attention_over_batch", "last_row", "cache_read")
    + ACROSS
)  # no buffer written: callable from threads


@dataclasses.dataclass(frozen=True)
class Spec:
    seed: int
    blocks: tuple[str, ...]
    cache_rows: int  # rows of the model's caches (batch sizes are drawn up to it)
    views: tuple[str, ...]  # extra outputs: "input" (x[:, :1]), "weight" (a parameter's transpose)

    def __str__(self) -> str:
        return f"seed {self.seed}: {' > '.join(self.blocks)}; cache rows {self.cache_rows}; views {self.views}"


def random_spec(seed: int, max_batch: int) -> Spec:
    """A model's spec: 2-4 blocks, at least one that mixes rows or reads a cache half the time."""
    rng = random.Random(seed)
    count = rng.randint(2, 4)
    blocks = [rng.choice(ROW_WISE) for _ in range(count)]
    if rng.random() < 0.7:
        blocks[rng.randrange(count)] = rng.choice(MIXING + CACHED + CACHED + WRITES)
    # fewer rows than the largest batch (padding must stop short of them), as many, or more
    cache_rows = rng.choice(
        [max(2, max_batch - rng.randint(1, max(1, max_batch // 3))), max_batch, max_batch + rng.randint(1, 8)]
    )
    views = tuple(v for v in ("input", "weight") if rng.random() < 0.3)
    if rng.random() < 0.5:  # drawn last: the models of earlier seeds keep their other blocks
        blocks.insert(rng.randrange(len(blocks) + 1), rng.choice(ACROSS))
    return Spec(seed, tuple(blocks), cache_rows, views)


def stateless_spec(seed: int, max_batch: int) -> Spec:
    """A spec whose blocks write no buffer (``STATELESS``), for calls from several threads at once:
    eager itself is only thread-safe on such a model."""
    spec = random_spec(seed, max_batch)
    rng = random.Random(seed + 1)
    blocks = tuple(b if b in STATELESS else rng.choice(ROW_WISE + ACROSS) for b in spec.blocks)
    return dataclasses.replace(spec, blocks=blocks)


class _Block(nn.Module):
    def __init__(self, kind: str, rows: int):
        super().__init__()
        self.kind = kind
        w = WIDTH
        self.a = nn.Linear(w, 2 * w)
        self.b = nn.Linear(2 * w, w)
        if kind == "running_norm":
            self.norm = nn.BatchNorm1d(w)
            self.norm.running_mean.uniform_(-0.5, 0.5)
            self.norm.running_var.uniform_(0.5, 2.0)
        elif kind == "batch_statistics":
            self.norm = nn.BatchNorm1d(w, track_running_stats=False)
        elif kind == "train_norm":
            self.norm = nn.BatchNorm1d(w)
        if kind in ("kv_cache", "cache_read"):
            self.register_buffer("k_cache", torch.randn(rows, 1, T_MAX, w) * 0.1)
            self.register_buffer("v_cache", torch.randn(rows, 1, T_MAX, w) * 0.1)
        if kind == "counter":
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        if kind == "break_item":
            self.register_buffer("gain", torch.tensor(1.25))
        if kind == "break_print":
            self.sink = io.StringIO()
        self.eps = 1e-6

    def train(self, mode: bool = True):  # the train-mode norm stays in train mode under model.eval()
        super().train(mode)
        if self.kind == "train_norm":
            self.norm.train(True)
        return self

    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        kind, B = self.kind, x.shape[0]
        if kind == "mlp":
            return x + self.b(F.silu(self.a(F.layer_norm(x, (WIDTH,)))))
        if kind == "softmax_features":
            return torch.softmax(self.b(self.a(x)), dim=-1) * 3 + x
        if kind == "center_positions":
            return x - x.mean(1, keepdim=True)
        if kind == "max_features":
            return x * x.amax(-1, keepdim=True).sigmoid()
        if kind in ("running_norm", "batch_statistics", "train_norm"):
            return self.norm(x.transpose(1, 2)).transpose(1, 2)
        if kind == "attention_in_row":
            q, k = self.a(x).chunk(2, dim=-1)
            weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(WIDTH), dim=-1)
            return x + weights @ x
        if kind == "causal_sdpa":
            q, k = self.a(x).chunk(2, dim=-1)
            out = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), x.unsqueeze(1), is_causal=True)
            return x + out.squeeze(1)
        if kind == "select_position":
            return x + x[:, -1:] * 0.5
        if kind == "center_batch":
            return x - x.mean(0, keepdim=True)
        if kind == "cumsum_batch":
            return x.cumsum(0) / B
        if kind == "attention_over_batch":
            flat = x.reshape(B, T * WIDTH)
            scores = (flat @ flat.T / (T * WIDTH)).exp()
            return x + ((scores / scores.sum(-1, keepdim=True)) @ flat).view(B, T, WIDTH)
        if kind == "last_row":
            return x + x[-1:]
        if kind == "kv_cache":
            q, k = self.a(x[:, -1:]).chunk(2, dim=-1)  # this step's key and query, one position
            self.k_cache[:B, :, pos : pos + 1] = k.unsqueeze(1)
            self.v_cache[:B, :, pos : pos + 1] = x[:, -1:].unsqueeze(1)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(1), self.k_cache[:B, :, : pos + 1], self.v_cache[:B, :, : pos + 1]
            )
            return x + out.squeeze(1)
        if kind == "cache_read":
            return x + self.k_cache[:B, 0, :T] + self.b(self.a(x))
        if kind == "counter":
            self.steps.add_(1)
            return x * 1.5
        return self._across(x)

    def _across(self, x: torch.Tensor) -> torch.Tensor:
        kind, B = self.kind, x.shape[0]
        if kind == "chunk_across":  # the second half is taken from the tuple only after the attention
            h = self.a(x)  # an RMSNorm by a float attribute: under dynamic=True a SymFloat read by .item()
            halves = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).chunk(2, dim=-1)
            a = halves[0].unsqueeze(1)  # keys and values only (the fused QKV's k and v)
            h = F.scaled_dot_product_attention(x.unsqueeze(1), a, a, is_causal=True)
            return x + self.b(torch.cat([h.squeeze(1), halves[1]], dim=-1))
        if kind == "topk_across":
            top = torch.topk(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps), 2, dim=-1)
            h = F.scaled_dot_product_attention(x.unsqueeze(1), x.unsqueeze(1), x.unsqueeze(1))
            return h.squeeze(1) + top.values.mean(-1, keepdim=True) + top.indices.float().mean(-1, keepdim=True) * 0.1
        if kind == "scalars_across":  # numbers from the sizes, made before the attention, read after
            fraction, causal, scale = B / (B + 1), x.shape[1] > 1, x.shape[-1] ** -0.5
            h = F.scaled_dot_product_attention(
                x.unsqueeze(1), x.unsqueeze(1), x.unsqueeze(1), is_causal=causal, scale=scale
            )
            return h.squeeze(1) * fraction + x * B / (B + 2)
        if kind == "break_item":  # .item() ends the graph; the next one starts with a Python float
            return x * self.gain.item()
        if kind == "break_branch":  # a branch on the data: a graph break, then one of two graphs
            return x * 1.5 if bool((x[:, 0, 0] > 0).all()) else x - 0.5
        if kind == "break_print":
            print("step", file=self.sink)
            self.sink.seek(0)
            self.sink.truncate()
            return x + 1
        raise ValueError(kind)


class FuzzModel(nn.Module):
    """``forward(x [B, T, W], pos: int)`` -> ``(y, *views)``."""

    def __init__(self, spec: Spec):
        super().__init__()
        torch.manual_seed(spec.seed)
        self.spec = spec
        self.blocks = nn.ModuleList(_Block(kind, spec.cache_rows) for kind in spec.blocks)
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, pos: int):
        h = x
        for block in self.blocks:
            h = block(h, pos)
        out = [self.head(h)]
        if "input" in self.spec.views:
            out.append(x[:, :1])
        if "weight" in self.spec.views:
            out.append(self.head.weight.T)
        return tuple(out)
