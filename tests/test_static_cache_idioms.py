"""The static-cache decode idioms take the graph path: each write, GQA form and mask below, over a
whole preallocated cache the caller passes, makes the decode step one graph and matches eager
(outputs and the caller's caches, step after step).

Writes at a tensor position: ``index_copy_``, ``index_put_``, ``scatter_``, ``cache[:, :, pos] = k``.
GQA: none, ``repeat_interleave``, ``expand`` + ``reshape`` (transformers' ``repeat_kv``), ``enable_gqa``.
Masks: causal by position, a sliding window, causal and a padding mask.
CPU, graphs emulated.
"""

import pytest
import torch
import torch.nn.functional as F

import piecewise_backend

from .helpers import busiest_graph, graphed_but_behind, last_serial

pytestmark = pytest.mark.usefixtures("emulated_graphs")

HEADS, KV_HEADS, DIM, LENGTH = 4, 2, 8, 16


def _write(kind: str, cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> None:
    if kind == "index_copy_":
        cache.index_copy_(2, pos, new)
    elif kind == "index_put_":
        b, h = new.shape[:2]
        cache.index_put_((torch.arange(b).view(-1, 1, 1), torch.arange(h).view(1, -1, 1), pos.view(1, 1, -1)), new)
    elif kind == "scatter_":
        cache.scatter_(2, pos.view(1, 1, 1, 1).expand_as(new), new)
    elif kind == "setitem":
        cache[:, :, pos] = new
    else:
        raise ValueError(kind)


def _expand_kv(kind: str, kv: torch.Tensor) -> tuple[torch.Tensor, dict]:
    groups = HEADS // kv.shape[1]
    if kind in ("none", "enable_gqa") or groups == 1:
        return kv, ({"enable_gqa": True} if kind == "enable_gqa" else {})
    if kind == "repeat_interleave":
        return kv.repeat_interleave(groups, dim=1), {}
    b, h, t, d = kv.shape  # repeat_kv
    return kv[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d), {}


def _mask(kind: str, pos: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    keys = torch.arange(LENGTH)
    causal = keys <= pos.view(-1, 1)
    if kind == "causal":
        return causal
    if kind == "sliding":
        return causal & (keys > pos.view(-1, 1) - 4)
    if kind == "padding":
        return causal & padding[:, None, None, :]
    raise ValueError(kind)


class StaticCacheStep(torch.nn.Module):
    """One attention layer decoding over whole caches ``[B, kv_heads, LENGTH, DIM]`` the caller owns."""

    def __init__(self, write: str, gqa: str, mask: str):
        super().__init__()
        self.write, self.gqa, self.mask = write, gqa, mask
        self.kv_heads = HEADS if gqa == "none" else KV_HEADS
        self.q = torch.nn.Linear(HEADS * DIM, HEADS * DIM)
        self.kv = torch.nn.Linear(HEADS * DIM, 2 * self.kv_heads * DIM)

    def forward(self, x, k_cache, v_cache, pos, padding):
        b = x.shape[0]
        q = self.q(x).view(b, 1, HEADS, DIM).transpose(1, 2)
        k, v = (t.view(b, 1, self.kv_heads, DIM).transpose(1, 2) for t in self.kv(x).chunk(2, dim=-1))
        _write(self.write, k_cache, pos, k)
        _write(self.write, v_cache, pos, v)
        keys, extra = _expand_kv(self.gqa, k_cache)
        values, _ = _expand_kv(self.gqa, v_cache)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=_mask(self.mask, pos, padding), **extra)
        return o.transpose(1, 2).reshape(b, 1, HEADS * DIM)


CASES = (
    [(write, "repeat_kv", "causal") for write in ("index_copy_", "index_put_", "scatter_", "setitem")]
    + [("index_copy_", gqa, "causal") for gqa in ("none", "repeat_interleave", "enable_gqa")]
    + [("index_copy_", "repeat_kv", mask) for mask in ("sliding", "padding")]
)


@pytest.mark.parametrize("write,gqa,mask", CASES)
def test_static_cache_decode_step_is_one_graph_and_matches_eager(write, gqa, mask):
    torch._dynamo.reset()
    start = last_serial()
    torch.manual_seed(0)
    model = StaticCacheStep(write, gqa, mask).eval()
    compiled = torch.compile(model, backend="piecewise")
    shape = (2, model.kv_heads, LENGTH, DIM)
    mine = [torch.zeros(shape), torch.zeros(shape)]
    theirs = [torch.zeros(shape), torch.zeros(shape)]
    padding = torch.ones(2, LENGTH, dtype=torch.bool)
    padding[1, :2] = False  # the second row's first two positions are padding
    with torch.no_grad():
        for step in range(2, 8):
            x, pos = torch.randn(2, 1, HEADS * DIM), torch.tensor([step])
            torch.testing.assert_close(
                compiled(x, *mine, pos, padding),
                model(x, *theirs, pos, padding),
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m: f"step {step}: {m}",
            )
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    graph = busiest_graph(start)
    assert graph.stats.num_pieces == 1 and graph.stats.replays > 0, graph.stats.summary()
    assert [how for _, how in graph.plan.report.attention] == ["graph: compiled with its piece"]


class CallerCacheStep(torch.nn.Module):
    """Caches the caller passes with more rows than the batch, written through ``cache[:B]``: by
    ``index_copy_`` at a tensor position (attention over ``cache[:B]`` under a causal mask), or at a
    Python-int position (attention over the growing prefix ``cache[:B, :, :t + 1]``)."""

    def __init__(self, write: str):
        super().__init__()
        self.write = write
        self.q = torch.nn.Linear(HEADS * DIM, HEADS * DIM)
        self.kv = torch.nn.Linear(HEADS * DIM, 2 * HEADS * DIM)

    def forward(self, x, k_cache, v_cache, pos):
        b = x.shape[0]
        q = self.q(x).view(b, 1, HEADS, DIM).transpose(1, 2)
        k, v = (t.view(b, 1, HEADS, DIM).transpose(1, 2) for t in self.kv(x).chunk(2, dim=-1))
        if self.write == "index_copy_":
            k_cache[:b].index_copy_(2, pos, k)
            v_cache[:b].index_copy_(2, pos, v)
            mask = torch.arange(LENGTH, device=x.device) <= pos.view(-1, 1)
            o = F.scaled_dot_product_attention(q, k_cache[:b], v_cache[:b], attn_mask=mask)
        else:
            k_cache[:b, :, pos : pos + 1] = k
            v_cache[:b, :, pos : pos + 1] = v
            o = F.scaled_dot_product_attention(q, k_cache[:b, :, : pos + 1], v_cache[:b, :, : pos + 1])
        return o.transpose(1, 2).reshape(b, 1, HEADS * DIM)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("write", ["index_copy_", "python_int_slice"])
def test_caches_the_caller_passes_are_written_in_the_graph_through_their_first_rows(write, device):
    torch._dynamo.reset()
    start = last_serial()
    torch.manual_seed(0)
    model = CallerCacheStep(write).to(device).eval()
    compiled = torch.compile(model, backend="piecewise", options={"capture_sizes": [2, 4]})
    shape = (6, HEADS, LENGTH, DIM)  # more rows than any batch below
    mine, theirs = ([torch.zeros(shape, device=device) for _ in range(2)] for _ in range(2))
    with torch.no_grad():
        for step, batch in enumerate((2, 2, 3, 3, 2, 4)):
            x = torch.randn(batch, 1, HEADS * DIM, device=device)
            torch._dynamo.maybe_mark_dynamic(x, 0)
            pos = torch.tensor([step], device=device) if write == "index_copy_" else step
            torch.testing.assert_close(
                compiled(x, *mine, pos), model(x, *theirs, pos), atol=1e-5, rtol=1e-5, msg=lambda m: f"step {step}: {m}"
            )
            piecewise_backend.wait_for_captures()  # a size met is captured (behind) before the next step
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)  # written in place, only the callers' rows
    graph = busiest_graph(start)
    assert graph.stats.num_pieces == 1 and graphed_but_behind(graph.stats), graph.stats.summary()
    assert graph.stats.replays > 0 and graph.stats.weight_sets == 1, graph.stats.summary()
    assert (3,) not in graph.captured and (4,) in graph.captured  # batch 3 replayed the graph of 4, padded
