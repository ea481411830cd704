"""graph_attention: decode SDPA over a growing cache prefix becomes graph-safe, the step one graph.

On CPU with emulated graphs (``prefix_attention``'s CPU path is masked SDPA); the CUDA kernels (the
split-key Triton one, and the memory-efficient one in variable-length form used without Triton)
are checked here against SDPA (marked ``cuda``; the Triton kernel also in Triton's interpreter
when Triton is installed) and on a whole model in test_cuda_capture.py.
"""

import copy
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import piecewise_backend
from piecewise_backend.ops.prefix_attention import prefix_attention
from piecewise_backend.runtime.step_scalars import StepScalars
from toys.models import ToyConfig, ToyLlama

from .helpers import (
    assert_close_steps,
    assert_results_close,
    busiest_graph,
    compile_with_reference,
    decode_at_sizes,
    graphs_since,
    last_serial,
    llama_decode,
)

CFG = ToyConfig(layers=2, max_batch=8, max_seq=32)
OPTIONS = {"capture_sizes": [2, 4, 8]}  # graph_attention is the default: these tests also check that it is
pytestmark = pytest.mark.usefixtures("emulated_graphs")


def _attention_case(device, buffer_len, batch=3, heads=4, dim=64, dtype=torch.float32, kv_heads=None):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, 1, dim, generator=g).to(device, dtype)
    k_cache, v_cache = (
        torch.randn(2, batch + 2, kv_heads or heads, buffer_len, dim, generator=g).to(device, dtype).unbind(0)
    )
    return q, k_cache.contiguous(), v_cache.contiguous()


PREFIXES = [(20, 1), (20, 7), (20, 20), (300, 1), (300, 65), (300, 300)]  # (buffer length, live length)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("buffer_len,length", PREFIXES)
@pytest.mark.parametrize("kv_heads,scale", [(4, None), (2, None), (1, 0.3)])  # GQA: 2 and 4 query heads per cache head
def test_prefix_attention_is_attention_over_the_prefix(device, buffer_len, length, kv_heads, scale):
    q, k_cache, v_cache = _attention_case(device, buffer_len, kv_heads=kv_heads)
    got = prefix_attention(q, k_cache, v_cache, torch.tensor(length, device=device), scale)
    want = F.scaled_dot_product_attention(
        q, k_cache[:3, :, :length], v_cache[:3, :, :length], scale=scale, enable_gqa=kv_heads != 4
    )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("per,kind", [("row", "bool"), ("head", "float"), ("row", "float")])
def test_prefix_attention_takes_a_mask_over_the_buffer(device, per, kind):
    q, k_cache, v_cache = _attention_case(device, 40, kv_heads=2)
    g = torch.Generator().manual_seed(1)
    shape = (5, 1, 1, 40) if per == "row" else (1, 4, 1, 40)  # per row: 2 rows more than the batch
    mask = torch.rand(shape, generator=g) > 0.4 if kind == "bool" else torch.randn(shape, generator=g)
    if kind == "bool":
        mask[0, ..., :9] = False  # left padding
    mask = mask.to(device)
    got = prefix_attention(q, k_cache, v_cache, torch.tensor(23, device=device), None, mask)
    want = F.scaled_dot_product_attention(
        q,
        k_cache[:3, :, :23],
        v_cache[:3, :, :23],
        enable_gqa=True,
        attn_mask=mask[: 3 if per == "row" else 1, ..., :23],
    )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["split_key_triton", "efficient_varlen"])
@pytest.mark.parametrize("buffer_len,length", PREFIXES)
def test_each_cuda_kernel_is_attention_over_the_prefix(kernel, buffer_len, length):
    from piecewise_backend.ops import kernel as decode_kernel
    from piecewise_backend.ops.prefix_attention import _efficient_prefix_attention

    if kernel == "split_key_triton" and not decode_kernel.available():
        pytest.skip("Triton is not installed")
    run = decode_kernel.prefix_attention if kernel == "split_key_triton" else _efficient_prefix_attention
    cases = (
        (1, torch.float32, 1e-4, 16, None),
        (3, torch.bfloat16, 2e-2, 16, None),
        (20, torch.bfloat16, 2e-2, 16, None),
        (3, torch.bfloat16, 2e-2, 4, 0.3),
    )  # the last: GQA (4 query heads per cache head) and a scale
    for batch, dtype, tol, kv_heads, scale in cases:
        q, k_cache, v_cache = _attention_case("cuda", buffer_len, batch=batch, heads=16, dtype=dtype, kv_heads=kv_heads)
        got = run(q, k_cache[:batch], v_cache[:batch], torch.tensor([length], device="cuda"), scale)
        want = F.scaled_dot_product_attention(
            q, k_cache[:batch, :, :length], v_cache[:batch, :, :length], scale=scale, enable_gqa=kv_heads != 16
        )
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("masked", [False, True])
def test_the_first_launch_compiles_every_block_size_a_later_batch_picks(masked):
    """A batch size picks its block by its (row, head) pairs: its first step must not compile a
    Triton binary (on the request path, or in a capture behind the calls where that fails)."""
    from piecewise_backend.ops import kernel as decode_kernel

    if not decode_kernel.available():
        pytest.skip("Triton is not installed")

    def binaries():
        caches = [
            getattr(k, "device_caches", None) for k in (decode_kernel._partial_kernel, decode_kernel._merge_kernel)
        ]
        if None in caches:
            pytest.skip("this Triton keeps its compiled kernels elsewhere")
        return sum(len(entry[0]) for cache in caches for entry in cache.values())

    dim = 40 + masked * 8  # head dims no other test uses: this test's binaries are new to the process
    q, k_cache, v_cache = _attention_case("cuda", 300, batch=20, heads=16, dim=dim, dtype=torch.bfloat16)
    mask = (torch.rand(20, 1, 1, 300, device="cuda") > 0.2) if masked else None
    length = torch.tensor([250], device="cuda")
    blocks = {decode_kernel.block_size(16 * batch, dim) for batch in (1, 3, 20)}
    assert len(blocks) == 3, blocks
    before = binaries()
    for batch in (1, 3, 20):  # 16, 48 and 320 (row, head) pairs: blocks of 16, 64, 128 keys
        got = decode_kernel.prefix_attention(
            q[:batch], k_cache[:batch], v_cache[:batch], length, None, None if mask is None else mask[:batch]
        )
        want = F.scaled_dot_product_attention(
            q[:batch],
            k_cache[:batch, :, :250],
            v_cache[:batch, :, :250],
            attn_mask=None if mask is None else mask[:batch, ..., :250],
        )
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        if batch == 1:
            after_first = binaries()
    assert after_first - before == 2 * len(blocks)  # a partial and a merge binary per block size
    assert binaries() == after_first  # the later batch sizes compiled nothing


INTERPRETED_CHECK = """
import torch, torch.nn.functional as F
from piecewise_backend.ops import kernel as decode_kernel
g = torch.Generator().manual_seed(0)
cases = [(1, 4, 300, 64, 1), (1, 4, 300, 64, 65), (2, 3, 130, 32, 130), (3, 2, 40, 48, 17), (1, 16, 304, 64, 280),
         (4, 16, 200, 64, 131), (20, 16, 150, 32, 150),  # blocks of 64 and of 128 keys
         (20, 4, 150, 128, 99),  # a head dim of 128: blocks of 64 keys
         (2, 8, 100, 32, 77, 2, 0.3), (3, 4, 70, 64, 70, 1, None),  # GQA (4 query heads per cache head), a scale
         (2, 2, 16 * 300, 32, 16 * 300 - 5), (1, 2, 16 * 300, 32, 200)]  # the last two: chunks of several blocks
for batch, heads, buffer_len, dim, length, *gqa in cases:
    kv_heads, scale = gqa or (heads, None)
    block, splits, chunk = decode_kernel.plan_splits(batch * heads, buffer_len, dim)
    assert block == decode_kernel.block_size(batch * heads, dim) and chunk % block == 0, (block, chunk)
    assert block * decode_kernel.triton_block_d(dim) <= decode_kernel.TILE
    assert splits * chunk >= buffer_len > (splits - 1) * chunk and splits <= decode_kernel.MAX_SPLITS, (splits, chunk)
    assert chunk == block or buffer_len > block * decode_kernel.MAX_SPLITS
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(batch, heads, 1, dim, generator=g).to(dtype)
        k, v = torch.randn(2, batch + 1, kv_heads, buffer_len, dim, generator=g).to(dtype)[:, :batch].unbind(0)
        got = decode_kernel.prefix_attention(q, k, v, torch.tensor([length]), scale)
        want = F.scaled_dot_product_attention(q, k[:, :, :length], v[:, :, :length], scale=scale,
                                              enable_gqa=kv_heads != heads)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
# SDPA's attn_mask over the whole buffer: per row (left padding: a row's first chunks lose every key;
# a row that loses all: 0, as SDPA) or per head, bool or additive; one with chunks of several blocks
for batch, heads, buffer_len, dim, length, per, kind in [
        (3, 4, 300, 64, 200, "row", "bool"), (2, 4, 130, 32, 130, "head", "float"),
        (20, 16, 150, 32, 99, "row", "float"), (2, 2, 16 * 300, 32, 16 * 300 - 5, "row", "bool")]:
    shape = (batch, 1, 1, buffer_len) if per == "row" else (1, heads, 1, buffer_len)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(batch, heads, 1, dim, generator=g).to(dtype)
        k, v = torch.randn(2, batch, heads, buffer_len, dim, generator=g).to(dtype).unbind(0)
        if kind == "bool":
            mask = torch.rand(shape, generator=g) > 0.3
            mask[0] = False
            mask[-1, ..., :length // 2] = False
        else:
            mask = torch.randn(shape, generator=g)
            mask = mask.masked_fill(mask < -1, float("-inf")).to(dtype)
            mask[0, ..., :length // 2] = float("-inf")
        got = decode_kernel.prefix_attention(q, k, v, torch.tensor([length]), None, mask)
        want = F.scaled_dot_product_attention(q, k[:, :, :length], v[:, :, :length], attn_mask=mask[..., :length])
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CUDA builds have it)")
def test_split_key_kernel_in_tritons_interpreter():
    """The Triton kernel on CPU tensors, run by Triton's interpreter (set before the kernel module
    is imported, hence a fresh process): several splits, chunks past the length (they store nothing:
    the merge must skip them), odd head dims, each block size, a buffer long enough for chunks of
    several blocks."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETED_CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.fixture(scope="module")
def one_graph_decode():
    compiled, reference, start = compile_with_reference(ToyLlama, CFG, OPTIONS)
    with torch.no_grad():
        results = decode_at_sizes(compiled, reference, (3, 2, 5, 8, 7, 4))
    return compiled, reference, start, results


def test_decode_step_is_one_graph_and_matches_eager(one_graph_decode):
    compiled, reference, start, results = one_graph_decode
    assert_results_close(results)
    graph = busiest_graph(start)
    # no attention piece, no eager RoPE prologue: the whole step is one compute piece
    assert graph.stats.num_pieces == 1 and graph.stats.num_compute_pieces == 1, graph.stats.summary()
    # 3 -> 4, 5 -> 8; 2 rides 4 (within 2x of it: capture_deferral.py)
    assert "padded" in graph.stats.padding and graph.captured == {(4,), (8,)}
    copies = sum(p.input_copies for p in graph.stats.pieces.values())
    assert copies == graph.stats.replays  # only the token ids are copied in, once per step
    for mine, theirs in zip(compiled._orig_mod.layers, reference.layers):
        torch.testing.assert_close(mine.attn.k_cache, theirs.attn.k_cache)


def test_prefill_attention_is_left_alone():
    compiled, reference, start = compile_with_reference(ToyLlama, CFG, OPTIONS)
    with torch.no_grad():
        got = llama_decode(compiled, compiled._orig_mod, batch=2, prompt=5, new_tokens=3)
        want = llama_decode(reference, reference, batch=2, prompt=5, new_tokens=3)
    assert_close_steps(got, want)
    prefill = graphs_since(start)[0]  # causal attention over 5 positions: split out and eager, as before
    assert prefill.stats.num_split_pieces == CFG.layers


def test_an_attention_length_past_the_buffer_is_refused(one_graph_decode):
    graph = max(graphs_since(one_graph_decode[2]), key=lambda g: g.stats.calls)
    scalars = graph.step_scalars
    # one slot for pos, read by the RoPE row, the write at pos and (plus one) the attention's length:
    # one fill_ per step, with the tightest bounds of the three
    assert [(s.low, s.high) for s in scalars.slots] == [(0, CFG.max_seq - 1)], scalars.slots
    position = scalars.slots[0]
    args = [None] * (1 + position.arg)
    args[position.arg] = CFG.max_seq
    with pytest.raises(IndexError, match=rf"needs 0 <= {position.name} <= 31; got {position.name} = 32.*outside"):
        scalars.refresh(tuple(args))  # the read of the RoPE row and the write at pos refuse first


def test_the_next_decode_position_is_written_ahead_of_its_call(one_graph_decode, monkeypatch):
    """From a sequence's third decode step on, a step's position is already on the device when the
    step is called (written while the step before ran), and the step writes only the next one."""
    compiled, reference, start, _ = one_graph_decode
    scalars = busiest_graph(start).step_scalars
    log = []
    refresh, write = StepScalars.refresh, StepScalars._write

    def logged_refresh(self, args):
        if self is scalars:
            log.append(("call", [args[s.arg] for s in self.slots]))
        return refresh(self, args)

    def logged_write(self, values):
        if self is scalars:
            log.append(("write", list(values)))
        write(self, values)

    monkeypatch.setattr(StepScalars, "refresh", logged_refresh)
    monkeypatch.setattr(StepScalars, "_write", logged_write)
    with torch.no_grad(), pytest.warns(UserWarning, match="are at new addresses") as said:  # reset caches: new ones
        got = llama_decode(compiled, compiled._orig_mod, batch=2, prompt=5, new_tokens=7)
        want = llama_decode(reference, reference, batch=2, prompt=5, new_tokens=7)
    assert all("are at new addresses" in str(w.message) for w in said)
    assert_close_steps(got, want)
    j = next(j for j, s in enumerate(scalars.slots) if s.high == CFG.max_seq - 1)  # pos (the other: the batch)
    calls = [i for i, (kind, _) in enumerate(log) if kind == "call"]
    assert [log[i][1][j] for i in calls] == list(range(5, 5 + len(calls))) and len(calls) >= 5, log
    for i in calls[2:]:
        values = log[i][1]
        ahead = values[:j] + [values[j] + 1] + values[j + 1 :]
        assert log[i - 1] == ("write", values), log  # written ahead, by the step before
        assert log[i + 1] == ("write", ahead), log  # no write of its own: only the next one's
    assert scalars.tensor[1 + j].item() == log[calls[-1]][1][j] + 1


def test_a_position_is_not_written_ahead_past_its_bound(one_graph_decode):
    scalars = busiest_graph(one_graph_decode[2]).step_scalars
    j = next(j for j, s in enumerate(scalars.slots) if s.high == CFG.max_seq - 1)
    args = [None] * (1 + max(s.arg for s in scalars.slots))
    for slot in scalars.slots:
        args[slot.arg] = slot.low
    last = CFG.max_seq - 1
    # a repeated position is not a step; the last position's next would be past the buffer
    for position, expected in ((last - 2, last - 2), (last - 2, last - 2), (last - 1, last), (last, last)):
        args[scalars.slots[j].arg] = position
        scalars.refresh(tuple(args))
        scalars.write_ahead()
        held = scalars.tensor[1:].tolist()
        assert held[j] == expected, (position, held)
        assert all(held[k] == scalars.slots[k].low for k in range(len(held)) if k != j)


class _GqaDecode(torch.nn.Module):
    """Decode over a growing cache prefix with fewer cache heads than query heads and a ``scale``:
    GQA by ``enable_gqa``, ``repeat_interleave`` or transformers' ``repeat_kv``, all taken by the
    graph-safe kernel, so the step stays one graph."""

    def __init__(self, form: str, heads=4, kv_heads=2, dim=8, rows=4, max_seq=32):
        super().__init__()
        self.form, self.heads, self.kv_heads, self.dim = form, heads, kv_heads, dim
        self.q, self.kv = torch.nn.Linear(16, heads * dim), torch.nn.Linear(16, 2 * kv_heads * dim)
        self.out = torch.nn.Linear(heads * dim, 16)
        self.register_buffer("k_cache", torch.zeros(rows, kv_heads, max_seq, dim))
        self.register_buffer("v_cache", torch.zeros(rows, kv_heads, max_seq, dim))

    def forward(self, x, t: int):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.heads, self.dim).transpose(1, 2)
        k, v = (p.view(B, S, self.kv_heads, self.dim).transpose(1, 2) for p in self.kv(x).chunk(2, dim=-1))
        self.k_cache[:B, :, t : t + S] = k
        self.v_cache[:B, :, t : t + S] = v
        keys, values = self.k_cache[:B, :, : t + S], self.v_cache[:B, :, : t + S]
        groups = self.heads // self.kv_heads
        if self.form == "repeat_interleave":
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        elif self.form == "repeat_kv":
            b, h, n, d = keys.shape
            keys, values = (
                x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d) for x in (keys, values)
            )
        o = F.scaled_dot_product_attention(q, keys, values, scale=0.25, enable_gqa=self.form == "enable_gqa")
        return self.out(o.transpose(1, 2).reshape(B, S, self.heads * self.dim))


def _decode_beside_eager(model, device, first: int):
    """Decode steps from position ``first`` at batch sizes 2, 2, 2, 3, 3, 2 (marked dynamic), each
    compiled step against a deep copy of ``model`` run eagerly; returns that copy."""
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="piecewise", options={"capture_sizes": [2, 4]})
    with torch.no_grad():
        for t, batch in enumerate((2, 2, 2, 3, 3, 2), start=first):
            x = torch.randn(batch, 1, 16, device=device)
            torch._dynamo.maybe_mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x, t), reference(x, t), atol=1e-5, rtol=1e-5)
            piecewise_backend.wait_for_captures()  # (captured behind the call: in before the next, on a busy host too)
    return reference


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("form", ["enable_gqa", "repeat_interleave", "repeat_kv"])
def test_gqa_and_scale_decode_is_one_graph_and_matches_eager(device, form):
    torch._dynamo.reset()
    start = last_serial()
    torch.manual_seed(0)
    model = _GqaDecode(form).to(device).eval()
    reference = _decode_beside_eager(model, device, first=0)
    torch.testing.assert_close(model.k_cache, reference.k_cache)
    graph = busiest_graph(start)
    assert graph.stats.num_pieces == 1 and graph.stats.replays > 0, graph.stats.summary()
    assert list(graph.stats.attention) == ["graph: the graph-safe decode kernel"], graph.stats.attention


class _PaddedDecode(torch.nn.Module):
    """Decode with a padding mask kept in a buffer (left-padded prompts of different lengths) and
    read up to the keys' length: ``attn_mask=pad_mask[:B, :, :, :t + 1]``. ``built``: the mask is
    made at each step instead, which the graph-safe kernel cannot read."""

    def __init__(self, built=False, heads=4, dim=8, rows=4, max_seq=32):
        super().__init__()
        self.built, self.heads, self.dim = built, heads, dim
        self.qkv, self.out = torch.nn.Linear(16, 3 * heads * dim), torch.nn.Linear(heads * dim, 16)
        self.register_buffer("k_cache", torch.zeros(rows, heads, max_seq, dim))
        self.register_buffer("v_cache", torch.zeros(rows, heads, max_seq, dim))
        self.register_buffer("pad_mask", torch.ones(rows, 1, 1, max_seq, dtype=torch.bool))

    def forward(self, x, t: int):
        B, S, _ = x.shape
        q, k, v = (p.view(B, S, self.heads, self.dim).transpose(1, 2) for p in self.qkv(x).chunk(3, dim=-1))
        self.k_cache[:B, :, t : t + S] = k
        self.v_cache[:B, :, t : t + S] = v
        mask = (
            torch.ones(B, 1, 1, t + S, dtype=torch.bool, device=x.device)
            if self.built
            else self.pad_mask[:B, :, :, : t + S]
        )
        o = F.scaled_dot_product_attention(
            q, self.k_cache[:B, :, : t + S], self.v_cache[:B, :, : t + S], attn_mask=mask
        )
        return self.out(o.transpose(1, 2).reshape(B, S, self.heads * self.dim))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_padding_mask_read_up_to_the_keys_length_keeps_the_step_one_graph(device):
    torch._dynamo.reset()
    start = last_serial()
    torch.manual_seed(0)
    model = _PaddedDecode().to(device).eval()
    model.pad_mask[0, ..., :3] = False  # rows 0 and 2: prompts left-padded by 3 and 5 positions
    model.pad_mask[2, ..., :5] = False
    _decode_beside_eager(model, device, first=5)  # the prompts fill positions 0..4
    graph = busiest_graph(start)
    assert graph.stats.num_pieces == 1 and graph.stats.replays > 0, graph.stats.summary()
    assert list(graph.stats.attention) == ["graph: the graph-safe decode kernel"], graph.stats.attention


def test_a_mask_built_at_each_step_stays_eager_and_says_why():
    torch._dynamo.reset()
    start = last_serial()
    model = _PaddedDecode(built=True).eval()
    compiled = torch.compile(model, backend="piecewise", options={"capture_sizes": [2, 4]})
    with torch.no_grad():
        for t in (5, 6, 7):
            torch.testing.assert_close(compiled(torch.ones(2, 1, 16), t), model(torch.ones(2, 1, 16), t))
    reasons = " ".join(busiest_graph(start).stats.attention)
    assert "attn_mask is not mask[:B, :, :, :t + c]" in reasons, reasons
