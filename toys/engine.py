"""A small serving engine, written the way serving engines write models, for tests and benchmarks.

The model is what vLLM and nano-vllm hand ``torch.compile``: tokens flattened to ``[num_tokens]``
(every request of the step, prefill chunks and decode tokens, one after the other), fused QKV split
by ``.split``, RMSNorm, SwiGLU, GQA, RoPE rows gathered by a positions tensor, and attention a
``torch.library.custom_op`` that writes a preallocated ``out`` and reads and writes a **paged** KV
cache held outside the graph, through a forward context the engine sets for each step (block
tables, slot mapping, sequence lengths). The backend cannot see inside that op; it must not be
captured (its metadata changes every step), so it is either named in ``extra_splitting_ops`` or
tagged ``torch.Tag.cudagraph_unsafe`` (:data:`TAGGED_ATTENTION`).

The engine (:class:`Engine`) is a continuous-batching loop: a request queue, decode tokens first,
then prefill chunks under a token budget, blocks from a free list, greedy sampling of each request's
last token outside the compiled model.

Two kinds of step, as vLLM's ``FULL_AND_PIECEWISE`` (the engine's default, ``graph_mode``):

* **a step that holds a prefill chunk** builds its metadata on the host each step (the slots of
  every cached key). Attention runs torch's own varlen attention
  (``torch.nn.attention.varlen.varlen_attn``, flash) on CUDA in half precision, over K/V gathered
  from the pages (torch 2.11's varlen_attn takes neither a block table nor grouped heads); elsewhere
  (CPU, fp32) a per-request SDPA with a bottom-right causal mask. Such a step must not be captured
  (its metadata changes every step): the backend runs it piecewise, the op eager between graphs;
* **a step of decode tokens only** writes its metadata into persistent device buffers (slot
  mapping, block tables, sequence lengths: :class:`DecodeMetadata`), and attention is the package's
  paged decode kernel (``piecewise_backend.ops``), which reads them there. Padded rows (a batch of
  5 replaying the graph of 8) have slot -1 and length 0: they write nowhere and read nothing. Such a
  step is graph-safe as a whole, so the engine runs it under ``cudagraph_mode("full")``: one CUDA
  graph per batch size, attention included.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import gc
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import piecewise_backend
from piecewise_backend.ops import capturing, paged_cache_write, paged_decode_attention

__all__ = [
    "EngineConfig",
    "TINY",
    "QWEN2_5_1_5B",
    "EngineModel",
    "Engine",
    "Request",
    "seeded_trace",
    "ATTENTION",
    "TAGGED_ATTENTION",
    "forward_context",
    "DecodeMetadata",
    "GRAPH_MODES",
]

ATTENTION = "engine::attention"  # must be named in extra_splitting_ops
GRAPH_MODES = ("full_and_piecewise", "piecewise")  # Engine(graph_mode=...): vLLM's names
TAGGED_ATTENTION = "engine::attention_tagged"  # the same op, tagged cudagraph_unsafe: found by the backend


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-6
    max_position: int = 2048
    block_size: int = 16
    attention_op: str = ATTENTION

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = EngineConfig()
# Qwen2.5-1.5B's dimensions (random weights): 28 layers, hidden 1536, 12 query heads, 2 KV heads
QWEN2_5_1_5B = EngineConfig(
    vocab=151936, hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, rope_theta=1e6, max_position=4096
)


# -- the forward context: per-step metadata the attention op reads ---------------------------------


@dataclasses.dataclass
class StepMetadata:
    """What one step's attention needs, built by the engine before the forward."""

    kv_caches: list  # per layer (k, v), each [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset) of each token
    query_start: torch.Tensor  # [num_seqs + 1] int32: where each request's tokens start in the step
    key_start: torch.Tensor  # [num_seqs + 1] int32: where each request's keys start in ``kv_slots``
    kv_slots: torch.Tensor  # [total keys] int64: the slots of every request's keys, request after request
    query_lens: list  # host copies, for the loop of the fallback and varlen's max lengths
    seq_lens: list  # keys per request after this step's tokens are written

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


@dataclasses.dataclass
class DecodeMetadata:
    """A decode-only step's metadata, in persistent device buffers at fixed addresses (graph-safe).

    Rows are the step's requests, then padding up to the buffers' capacity: slot -1 and length 0 (a
    captured graph of a larger batch reads those rows; they write nowhere and read nothing)."""

    kv_caches: list
    slot_mapping: torch.Tensor  # [capacity] int64: the slot of each row's new token (-1: none)
    block_tables: torch.Tensor  # [capacity, pages per request] int32
    seq_lens: torch.Tensor  # [capacity] int64: keys per row after this step's token (0: none)
    num_tokens: int  # the step's real rows

    @property
    def capacity(self) -> int:
        return self.slot_mapping.shape[0]


_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("engine_forward_context", default=None)


@contextlib.contextmanager
def forward_context(metadata: StepMetadata):
    token = _CONTEXT.set(metadata)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


_VARLEN_ATTN = _varlen()


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    """Write this step's keys and values into the pages, attend over each request's keys.

    Like any op that reads per-step state from outside its arguments, it is wrong inside a CUDA graph
    (a replay would read the capture step's metadata): it says so if it finds itself captured.
    """
    meta = _CONTEXT.get()
    if isinstance(meta, DecodeMetadata):
        return _decode_attention(q, k, v, out, layer, meta)
    if capturing(q):  # inside a CUDA capture (or the backend's emulated one on CPU, for its tests)
        raise RuntimeError(
            f"{ATTENTION} reads per-step metadata from the engine's forward context and "
            f"must not be captured in a CUDA graph"
        )
    if meta is None or meta.num_tokens != q.shape[0]:
        raise RuntimeError(
            f"{ATTENTION}: called with {q.shape[0]} tokens outside a forward context for them (Engine.step sets it)"
        )
    k_cache, v_cache = meta.kv_caches[layer]
    kv_heads, head_dim = k_cache.shape[-2:]
    k_flat, v_flat = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_flat.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    keys, values = k_flat.index_select(0, meta.kv_slots), v_flat.index_select(0, meta.kv_slots)
    group = q.shape[1] // kv_heads
    if _VARLEN_ATTN is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out.copy_(_varlen_attention(q, keys, values, meta, group))
        return
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    q_start = k_start = 0
    for q_len, k_len in zip(meta.query_lens, meta.seq_lens):
        qi = q[q_start : q_start + q_len].transpose(0, 1)
        ki, vi = keys[k_start : k_start + k_len].transpose(0, 1), values[k_start : k_start + k_len].transpose(0, 1)
        # bottom-right causal: query i sees the keys up to its own position (k_len - q_len + i)
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
        out[q_start : q_start + q_len] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask).transpose(0, 1)
        q_start, k_start = q_start + q_len, k_start + k_len


def _decode_attention(q, k, v, out, layer: int, meta: DecodeMetadata) -> None:
    """The graph-safe path: every row's slot, pages and length read from the persistent buffers, for
    as many rows as ``q`` has (a padded batch has more than the step)."""
    rows = q.shape[0]
    if rows > meta.capacity:
        raise RuntimeError(
            f"{ATTENTION}: a decode batch of {rows} rows, but the engine's decode buffers hold "
            f"{meta.capacity}: raise max_num_tokens, or capture sizes up to it"
        )
    k_cache, v_cache = meta.kv_caches[layer]
    paged_cache_write(k, v, k_cache, v_cache, meta.slot_mapping[:rows])
    paged_decode_attention(q, k_cache, v_cache, meta.block_tables[:rows], meta.seq_lens[:rows], out=out)


_GROUPED_KV = [True]  # whether this torch's varlen kernel took K/V with fewer heads than Q


def _varlen_attention(q, keys, values, meta: StepMetadata, group: int) -> torch.Tensor:
    """torch's varlen (flash) attention, bottom-right causal. Flash takes grouped K/V heads as they
    are (torch 2.11's wrapper has no ``enable_gqa`` flag but passes them on); a torch whose kernel
    refuses them gets them repeated, once found out."""
    lengths = (meta.query_start, meta.key_start, max(meta.query_lens), max(meta.seq_lens))
    if group > 1 and _GROUPED_KV[0]:
        try:
            return _VARLEN_ATTN(q, keys, values, *lengths, window_size=(-1, 0))
        except RuntimeError:
            _GROUPED_KV[0] = False
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    return _VARLEN_ATTN(q, keys, values, *lengths, window_size=(-1, 0))


def _register(name: str, tags: tuple) -> None:
    op = torch.library.custom_op(name, mutates_args=("out",), tags=tags)(_attention_impl)
    op.register_fake(lambda q, k, v, out, layer: None)


_register(ATTENTION, ())
_register(TAGGED_ATTENTION, (torch.Tag.cudagraph_unsafe,))


def _op(name: str):
    namespace, op_name = name.split("::")
    return getattr(getattr(torch.ops, namespace), op_name)


_OPS = {name: _op(name) for name in (ATTENTION, TAGGED_ATTENTION)}


# -- the model -------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, halves rotated (Qwen2/Llama's form); ``cos``/``sin`` are [num_tokens, head_dim // 2]."""
    x1, x2 = x.chunk(2, -1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(x.dtype)


class Layer(nn.Module):
    def __init__(self, cfg: EngineConfig, index: int):
        super().__init__()
        self.index, self.cfg = index, cfg
        self.q_size, self.kv_size = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.input_norm, self.post_norm = RMSNorm(cfg.hidden, cfg.eps), RMSNorm(cfg.hidden, cfg.eps)
        self.qkv = nn.Linear(cfg.hidden, self.q_size + 2 * self.kv_size, bias=True)  # Qwen2: QKV bias
        self.o = nn.Linear(self.q_size, cfg.hidden, bias=False)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)
        # the op's name, not the op: a module attribute is part of what Dynamo guards and torch's AOT
        # route pickles with them, and an op object does not pickle (a global lookup is not guarded);
        # ``attention``: a function to call instead (a hook for a peer without a compiler)
        self.attention_op, self.attention = cfg.attention_op, None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        q, k, v = self.qkv(self.input_norm(h)).split([self.q_size, self.kv_size, self.kv_size], -1)
        q = _rotate(q.view(-1, cfg.heads, cfg.head_dim), cos, sin)
        k = _rotate(k.view(-1, cfg.kv_heads, cfg.head_dim), cos, sin)
        out = torch.empty_like(q)
        (self.attention or _OPS[self.attention_op])(q, k, v.view(-1, cfg.kv_heads, cfg.head_dim), out, self.index)
        h = h + self.o(out.view(-1, self.q_size))
        gate, up = self.gate_up(self.post_norm(h)).chunk(2, -1)
        return h + self.down(F.silu(gate) * up)


class EngineModel(nn.Module):
    """``forward(input_ids [N], positions [N]) -> hidden [N, hidden]``; :meth:`logits` is separate,
    run by the engine on each request's last token only (as vLLM's ``compute_logits``)."""

    def __init__(self, cfg: EngineConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.max_position).float(), inv)
        self.register_buffer("cos_sin", torch.cat((angles.cos(), angles.sin()), -1), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        cos, sin = self.cos_sin.index_select(0, positions).to(h.dtype).chunk(2, -1)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.embed.weight.t()  # tied embeddings, as Qwen2.5-1.5B

    def init_weights_(self, seed: int = 0) -> EngineModel:
        """Random weights scaled so that activations stay O(1) through every layer, drawn where the
        model is (1.5B numbers drawn on the host took longer than compiling)."""
        device = self.embed.weight.device
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    continue
                fan_in = p.shape[-1] if p.dim() > 1 else p.shape[0]
                p.copy_(torch.randn(p.shape, generator=g, device=device) / math.sqrt(fan_in))
        return self


# -- the engine ------------------------------------------------------------------------------------


class _DecodeBuffers:
    """The persistent device buffers of decode-only steps (:class:`DecodeMetadata`), and their writing.

    One ``[4, capacity]`` int64 buffer holds the step's token ids, positions, slots and lengths, so a
    step's metadata is one host-to-device copy; rows past the step are padding (slot -1, length 0),
    rewritten only as far as the previous step wrote. Block tables change only when the batch's
    requests do (a request's pages are all given at admission), so they are written only then. Which
    pages the tables hold is known by the block lists themselves (kept, so compared by identity), not
    by request ids: a later ``run`` may number its requests from 0 again, with other pages.
    """

    def __init__(self, kv_caches: list, capacity: int, pages_per_request: int, device: torch.device):
        self.kv_caches = kv_caches
        self.step = torch.zeros(4, capacity, dtype=torch.int64, device=device)
        self.step[2].fill_(-1)
        self.tables = torch.zeros(capacity, pages_per_request, dtype=torch.int32, device=device)
        self._written = 0  # rows of ``step`` the last write reached
        self._pages: list = []  # the block lists whose pages ``tables`` holds, in row order
        self._row_cache: dict = {}  # id(block list) -> (the list, its row as a tensor)

    def write(self, ids: list, positions: list, slots: list, size: int, requests: list = ()):
        """Write a step of ``size`` rows (the first ``len(ids)`` real, the rest padding); return the
        ids and positions to call the model with (views of the buffer)."""
        real = len(ids)
        reach = max(size, self._written)
        pad = reach - real
        host = torch.tensor(
            [ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad, [p + 1 for p in positions] + [0] * pad],
            dtype=torch.int64,
        )
        self.step[:, :reach].copy_(host, non_blocking=True)
        self._written = size
        pages = [r.blocks for r in requests]
        if len(pages) != len(self._pages) or any(a is not b for a, b in zip(pages, self._pages)):
            self._write_tables(pages)
        return self.step[0, :size], self.step[1, :size]

    def _write_tables(self, pages: list) -> None:
        """The batch's block lists into ``tables``, one row each, in one copy. Each list's row is made
        once, at the table's width (a request's pages are all given at admission), and the rows
        stacked: built element by element, a table of 128 requests took milliseconds of host time
        in every step whose batch changed (rows past the batch are never read: their length is 0)."""
        rows = [self._row(blocks) for blocks in pages]
        self._row_cache = {id(blocks): self._row_cache[id(blocks)] for blocks in pages}
        if rows:
            self.tables[: len(rows)].copy_(torch.stack(rows), non_blocking=True)
        self._pages = pages

    def _row(self, blocks: list) -> torch.Tensor:
        cached = self._row_cache.get(id(blocks))
        if cached is None or cached[0] is not blocks:  # (the list is kept: its id is not reused meanwhile)
            row = torch.zeros(self.tables.shape[1], dtype=torch.int32)
            row[: len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            cached = self._row_cache[id(blocks)] = (blocks, row)
        return cached[1]

    def metadata(self, size: int) -> DecodeMetadata:
        return DecodeMetadata(self.kv_caches, self.step[2], self.tables, self.step[3], size)


@dataclasses.dataclass
class Request:
    id: int
    prompt: list
    max_new_tokens: int
    arrival: float = 0.0  # seconds after the engine's start at which it may be scheduled
    output: list = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose keys are in the cache
    blocks: list = dataclasses.field(default_factory=list)
    token_times: list = dataclasses.field(default_factory=list)  # perf_counter of each output token

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclasses.dataclass
class StepRecord:
    start: float  # perf_counter when the step began
    seconds: float
    num_tokens: int
    num_decode: int
    num_prefill_tokens: int
    keys: int = 0  # cached keys the step's rows attend over, together (a decode step reads them all)
    events: tuple = ()  # with Engine(time_phases=True): CUDA events before the forward, after it, after sampling

    def phase_ms(self) -> tuple[float, float] | None:
        """(forward, logits and sampling) in ms as the GPU saw them (the forward's from the host's call
        to the end of its last kernel); None without events. Waits for the GPU."""
        if not self.events:
            return None
        before, forward, sampled = self.events
        sampled.synchronize()
        return before.elapsed_time(forward), forward.elapsed_time(sampled)


class Engine:
    """Continuous batching over a paged KV cache.

    Args:
        model: the :class:`EngineModel` (its ``logits`` and config are used).
        forward: what runs ``model(input_ids, positions)``: the model itself (eager) or a
            ``torch.compile`` of it.
        max_num_tokens: the token budget of a step (decode tokens first, prefill chunks fill the rest).
        max_num_seqs: requests running at once.
        num_blocks: KV-cache pages (of ``cfg.block_size`` tokens each), per layer.
        mark_dynamic: mark the token count dynamic at every step (``torch._dynamo.mark_dynamic``);
            ``"unbacked"``: ``mark_unbacked`` instead, so that a step of one token takes the same graph
            (Dynamo specialises a backed size of 1: a second trace); ``False``: no mark.
        graph_mode: ``"full_and_piecewise"`` (vLLM's default): a step of decode tokens only takes the
            graph-safe path (:class:`DecodeMetadata`) under ``cudagraph_mode("full")``, one graph of
            the whole step; other steps run piecewise. ``"piecewise"``: every step takes the host
            metadata path, piecewise.
        time_phases: on a GPU, record CUDA events around each step's forward and sampling
            (:meth:`StepRecord.phase_ms`): where a step's time goes, without a wait of its own.
    """

    def __init__(
        self,
        model: EngineModel,
        forward: Callable | None = None,
        *,
        max_num_tokens: int = 64,
        max_num_seqs: int = 8,
        num_blocks: int = 64,
        device="cpu",
        dtype=torch.float32,
        mark_dynamic: bool | str = True,
        graph_mode: str = "full_and_piecewise",
        time_phases: bool = False,
    ):
        if graph_mode not in GRAPH_MODES:
            raise ValueError(f"Engine: graph_mode={graph_mode!r}; use one of {GRAPH_MODES}")
        cfg = model.cfg
        self.model, self.forward = model, model if forward is None else forward
        self.cfg, self.device = cfg, torch.device(device)
        self.max_num_tokens, self.max_num_seqs, self.mark_dynamic = max_num_tokens, max_num_seqs, mark_dynamic
        self.graph_mode = graph_mode
        self.time_phases = time_phases and self.device.type == "cuda"
        self._mode_override: str | None = None  # warm_up's dummy steps run un-graphed
        shape = (num_blocks, cfg.block_size, cfg.kv_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in range(cfg.layers)
        ]
        self.free_blocks = collections.deque(range(num_blocks))
        self.waiting: collections.deque = collections.deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.steps: list[StepRecord] = []
        self._start = time.perf_counter()
        self._decode = (
            _DecodeBuffers(self.kv_caches, max_num_tokens, -(-cfg.max_position // cfg.block_size), self.device)
            if graph_mode == "full_and_piecewise"
            else None
        )

    def add(self, request: Request) -> None:
        needed = -(-(len(request.prompt) + request.max_new_tokens) // self.cfg.block_size)
        if needed > len(self.free_blocks) + sum(len(r.blocks) for r in self.running):
            raise ValueError(
                f"request {request.id} needs {needed} KV blocks; the engine has "
                f"{len(self.free_blocks)} free: raise num_blocks"
            )
        self.waiting.append(request)

    def warm_up(self, freeze_gc: bool = False, decode_sizes=(), capture: bool = False) -> None:
        """What an engine does before it serves (vLLM's dummy runs): one step at the full token budget
        and one decode step of a single token, so that compiling happens here, not at the first
        request. They run un-graphed (``cudagraph_mode("none")``): nothing is captured before the
        first request; the sizes traffic brings are captured behind the calls that meet them
        (``capture_behind``, the backend's default), which are served meanwhile. Every kernel a
        later size launches is compiled here (the paged kernel compiles all its variants at its
        first launch). ``capture``: the dummy steps capture their own sizes too (start-up pays for
        graphs the traffic may never use). ``decode_sizes``: then a dummy decode step of each of
        these sizes (every row padding: it writes and reads nothing), which captures the full graph
        of each size up front; the start waits for those captures. ``freeze_gc``: then move
        every object alive into the collector's permanent generation (``gc.freeze``), as a
        long-running server does after start-up: the compiled code and graphs are never scanned again."""
        dummy = [Request(-1, [0] * self.max_num_tokens, 1), Request(-2, [0], 2)]
        self._mode_override = None if capture else "none"
        try:
            for request in dummy:
                self.run([request])
        finally:
            self._mode_override = None
        self.finished.clear()
        self.steps.clear()
        for size in sorted(decode_sizes or ()):  # smallest first: each is captured, none rides a larger one
            self._dummy_decode(size)
            piecewise_backend.wait_for_captures()  # (captured behind the dummy step: in before the next)
        if capture or decode_sizes:
            piecewise_backend.wait_for_captures()
        if freeze_gc:
            gc.collect()
            gc.freeze()

    def example_calls(self) -> list:
        """The calls Dynamo makes a graph of, one each (``piecewise_backend.save``'s examples): a step
        at the token budget, its size dynamic, and one of a single token (Dynamo specialises a size
        of 1; with ``mark_dynamic="unbacked"``, the first alone). Serve on what was saved from them with
        ``mark_dynamic=False``."""

        def call(n: int, dynamic: bool):
            ids = torch.zeros(n, dtype=torch.int64, device=self.device)
            positions = torch.arange(n, device=self.device)
            if dynamic:
                self._mark(ids, positions)
            return (ids, positions)

        first = call(self.max_num_tokens, True)
        return [first] if self.mark_dynamic == "unbacked" else [first, call(1, False)]

    def _mark(self, *tensors) -> None:
        mark = torch._dynamo.decorators.mark_unbacked if self.mark_dynamic == "unbacked" else torch._dynamo.mark_dynamic
        for t in tensors:
            mark(t, 0)

    def run(self, requests: list[Request], realtime: bool = False) -> list[Request]:
        """Serve ``requests`` to the end; ``realtime``: hold each back until its arrival time."""
        pending = collections.deque(sorted(requests, key=lambda r: r.arrival))
        self._start = time.perf_counter()
        while pending or self.waiting or self.running:
            now = time.perf_counter() - self._start if realtime else math.inf
            while pending and pending[0].arrival <= now:
                self.add(pending.popleft())
            if not (self.waiting or self.running):
                time.sleep(max(0.0, min(pending[0].arrival - now, 0.01)))
                continue
            self.step()
        return sorted(self.finished, key=lambda r: r.id)

    # -- one step ------------------------------------------------------------------------------------

    def _schedule(self) -> list[tuple[Request, int]]:
        """(request, tokens this step): every running request's decode token, then prefill chunks."""
        budget, chosen = self.max_num_tokens, []
        for request in self.running:
            if request.computed >= len(request.prompt) and budget > 0:
                chosen.append((request, 1))
                budget -= 1
        for request in self.running:  # a prompt chunked in an earlier step goes on
            if request.computed < len(request.prompt) and budget > 0:
                n = min(len(request.prompt) - request.computed, budget)
                chosen.append((request, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            needed = -(-(len(request.prompt) + request.max_new_tokens) // self.cfg.block_size)
            if needed > len(self.free_blocks):
                break
            self.waiting.popleft()
            request.blocks = [self.free_blocks.popleft() for _ in range(needed)]
            self.running.append(request)
            n = min(len(request.prompt), budget)
            chosen.append((request, n))
            budget -= n
        return chosen

    def _inputs(self, chosen: list[tuple[Request, int]]):
        """The step's token ids, positions and attention metadata. Slots are computed with vectorised
        CPU ops (a Python loop over every cached token took milliseconds per step at 64 requests of
        1,000 tokens: more than the GPU's step) and sent to the device in one copy each."""
        block = self.cfg.block_size
        ids, q_lens, k_lens, starts = [], [], [], []
        for request, n in chosen:
            start, prompt = request.computed, len(request.prompt)
            ids += (
                request.prompt[start : start + n]
                if start < prompt
                else request.output[start - prompt : start - prompt + n]
            )
            q_lens.append(n)
            k_lens.append(start + n)
            starts.append(start)
        tables = torch.zeros(len(chosen), max(len(r.blocks) for r, _ in chosen), dtype=torch.int64)
        for i, (request, _) in enumerate(chosen):
            tables[i, : len(request.blocks)] = torch.tensor(request.blocks)
        q_counts, k_counts = torch.tensor(q_lens), torch.tensor(k_lens)
        q_start = torch.cat((torch.zeros(1, dtype=torch.int64), q_counts.cumsum(0)))
        k_start = torch.cat((torch.zeros(1, dtype=torch.int64), k_counts.cumsum(0)))
        rows = torch.arange(len(chosen))

        def slots_of(seq, pos):  # the cache slot of each (request, position)
            return tables[seq, pos // block] * block + pos % block

        seq_q = rows.repeat_interleave(q_counts)
        positions = (
            torch.arange(int(q_start[-1]))
            - q_start[:-1].repeat_interleave(q_counts)
            + torch.tensor(starts).repeat_interleave(q_counts)
        )
        seq_k = rows.repeat_interleave(k_counts)
        key_positions = torch.arange(int(k_start[-1])) - k_start[:-1].repeat_interleave(k_counts)
        device = self.device

        def sent(t, dtype=torch.int64):
            return t.to(dtype).to(device, non_blocking=True)

        meta = StepMetadata(
            self.kv_caches,
            sent(slots_of(seq_q, positions)),
            sent(q_start, torch.int32),
            sent(k_start, torch.int32),
            sent(slots_of(seq_k, key_positions)),
            q_lens,
            k_lens,
        )
        return sent(torch.tensor(ids)), sent(positions), meta

    def _decode_inputs(self, chosen: list[tuple[Request, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode-only step's token ids and positions, its metadata written into the persistent buffers."""
        block = self.cfg.block_size
        ids, positions, slots = [], [], []
        for request, _ in chosen:
            position = request.computed
            ids.append(request.output[position - len(request.prompt)])
            positions.append(position)
            slots.append(request.blocks[position // block] * block + position % block)
        return self._decode.write(ids, positions, slots, len(chosen), [r for r, _ in chosen])

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        if self.mark_dynamic:  # as vLLM does: one graph for every token count, not one per first size
            self._mark(ids, positions)
        mode = self._mode_override or ("full" if isinstance(meta, DecodeMetadata) else "piecewise")
        with forward_context(meta), piecewise_backend.cudagraph_mode(mode), torch.inference_mode():
            return self.forward(ids, positions)

    def _dummy_decode(self, size: int) -> None:
        """A decode step of ``size`` padding rows through the graph-safe path (captures its full graph)."""
        if self._decode is not None:
            self._forward(*self._decode.write([], [], [], size), self._decode.metadata(size))

    def step(self) -> None:
        start = time.perf_counter()
        chosen = self._schedule()
        decode_only = self._decode is not None and all(r.computed >= len(r.prompt) for r, _ in chosen)
        if decode_only:
            ids, positions = self._decode_inputs(chosen)
            meta = self._decode.metadata(len(chosen))
        else:
            ids, positions, meta = self._inputs(chosen)
        events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3)) if self.time_phases else ()
        if events:
            events[0].record()
        hidden = self._forward(ids, positions, meta)
        if events:
            events[1].record()
        with torch.inference_mode():
            last, sampling = [], []
            offset = 0
            for request, n in chosen:
                offset += n
                if request.computed + n >= len(request.prompt):  # the prompt is in: its last token samples
                    last.append(offset - 1)
                    sampling.append(request)
            tokens = []
            if last:  # a decode-only step samples every row: no gather
                rows = hidden if len(last) == hidden.shape[0] else hidden[torch.tensor(last, device=self.device)]
                tokens = self.model.logits(rows).argmax(-1)
            if events:
                events[2].record()
            tokens = tokens.tolist() if last else []
        now = time.perf_counter()
        keys = 0
        for request, n in chosen:
            request.computed += n
            keys += request.computed
        for request, token in zip(sampling, tokens):
            request.output.append(token)
            request.token_times.append(now)
        for request in [r for r in self.running if r.done]:
            self.running.remove(request)
            self.free_blocks.extend(request.blocks)
            request.blocks = []
            self.finished.append(request)
        self.steps.append(
            StepRecord(
                start,
                now - start,
                int(ids.shape[0]),
                sum(1 for _, n in chosen if n == 1),
                sum(n for _, n in chosen if n > 1),
                keys,
                events,
            )
        )


def seeded_trace(n: int, seed: int = 0, vocab: int = 256, prompt=(4, 40), output=(2, 12), rate: float = 0.0):
    """``n`` requests with prompt and output lengths uniform in the given ranges (inclusive) and,
    for ``rate`` > 0, Poisson arrivals at ``rate`` requests per second (else all at once)."""
    g = torch.Generator().manual_seed(seed)
    requests, arrival = [], 0.0
    for i in range(n):
        p = int(torch.randint(prompt[0], prompt[1] + 1, (), generator=g))
        o = int(torch.randint(output[0], output[1] + 1, (), generator=g))
        if rate > 0:
            arrival += float(torch.empty(()).exponential_(rate, generator=g))
        requests.append(Request(i, torch.randint(0, vocab, (p,), generator=g).tolist(), o, arrival))
    return requests
