"""Where attention and its neighbours run (``attention_placement.py``, ``in_place_writes.py``):

* decode attention of fixed shape (a whole static cache under a mask) is compiled with its piece;
* what is sized by a KV length and read only by attention (a cache grown by ``torch.cat``) runs
  beside the eager attention, so compute pieces are captured per batch size, not per KV length;
* index writes and fixed-size updates of a whole input are captured, into the caller's tensor;
* ``mode="reduce-overhead"`` (transformers' ``CompileConfig`` default) is accepted, Inductor's other
  modes refused by name.

CPU, graphs emulated; every test compares with eager.
"""

import pytest
import torch
import torch.nn.functional as F

import piecewise_backend
from piecewise_backend.kinds import PieceKind
from toys.models import ToyConfig, ToyStaticCacheLlama

from .helpers import (
    SPLIT_ATTENTION,
    assert_results_close,
    busiest_graph,
    compile_with_reference,
    decode_at_sizes,
    last_serial,
)

pytestmark = pytest.mark.usefixtures("emulated_graphs")
CFG = ToyConfig(layers=2, max_batch=8, max_seq=32)


def _static_cache_decode(options):
    compiled, reference, start = compile_with_reference(ToyStaticCacheLlama, CFG, options)
    with torch.no_grad():
        assert_results_close(decode_at_sizes(compiled, reference, (3, 3), static_cache=True, steps=3))
    return busiest_graph(start)


def test_fixed_shape_decode_attention_is_compiled_with_its_piece():
    graph = _static_cache_decode({})
    assert [how for _, how in graph.plan.report.attention] == ["graph: compiled with its piece"] * CFG.layers
    assert not [p for p in graph.pieces if p.kind == PieceKind.SPLIT]
    assert graph.stats.replays > 0


def test_graph_attention_off_keeps_fixed_shape_attention_eager():
    graph = _static_cache_decode(SPLIT_ATTENTION)
    assert len([p for p in graph.pieces if p.kind == PieceKind.SPLIT]) == CFG.layers
    assert all(how.startswith("eager: ") for _, how in graph.plan.report.attention)


class CatCacheModel(torch.nn.Module):
    """``forward(x [B, 1, D], past_k, past_v) -> (out, k, v)``: a cache grown by ``torch.cat``."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, past_k, past_v):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, s, d)), k, v


def _decode_with_growing_cache(model, extra_args=lambda step: (), past: int = 1):
    """Six decode steps of ``model`` (caches of ``past`` positions, grown by cat) compiled and eager,
    outputs and caches compared; returns the compiled graph that served the steps."""
    torch._dynamo.reset()
    start = last_serial()
    compiled = torch.compile(model, backend="piecewise")
    caches = {name: (torch.zeros(2, 4, past, 8), torch.zeros(2, 4, past, 8)) for name in ("mine", "eager")}
    with torch.no_grad():
        for step in range(6):
            x, extra = torch.randn(2, 1, 32), extra_args(step)
            mine, *caches["mine"] = compiled(x, *caches["mine"], *extra)
            theirs, *caches["eager"] = model(x, *caches["eager"], *extra)
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    for a, b in zip(caches["mine"], caches["eager"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    return busiest_graph(start)


def test_a_cache_grown_by_cat_runs_beside_attention_and_compute_pieces_replay():
    torch.manual_seed(0)
    graph = _decode_with_growing_cache(CatCacheModel().eval())
    assert graph.stats.captured_keys == {()}, graph.stats.summary()  # one capture for every KV length
    assert graph.stats.replays >= 3
    assert any("grows a cache by cat" in why for p in graph.pieces for why in p.eager_reasons)
    assert any("grow by torch.cat" in how for _, how in graph.plan.report.attention)


class IndexWrites(torch.nn.Module):
    """A cache the caller passes and fills at a tensor position, and a step counter: Hugging Face's
    StaticCache, in small."""

    def forward(self, x, cache, position, counter):
        cache.index_copy_(1, position, x)
        counter.add_(1)
        return (cache * 2).sum(dim=1) + counter


def test_index_writes_of_a_callers_tensor_are_captured_into_that_tensor():
    torch._dynamo.reset()
    start = last_serial()
    compiled = torch.compile(IndexWrites(), backend="piecewise")
    mine = (torch.zeros(2, 8, 4), torch.zeros((), dtype=torch.long))
    theirs = (torch.zeros(2, 8, 4), torch.zeros((), dtype=torch.long))
    for step in range(5):
        x, position = torch.randn(2, 1, 4), torch.tensor([step])
        torch.testing.assert_close(
            compiled(x, mine[0], position, mine[1]), IndexWrites()(x, theirs[0], position, theirs[1])
        )
        piecewise_backend.wait_for_captures()  # (captured behind the call: in before the next, on a busy host too)
    assert torch.equal(mine[0], theirs[0]) and int(mine[1]) == int(theirs[1]) == 5
    graph = busiest_graph(start)
    assert graph.stats.num_pieces == 1 and graph.stats.replays > 0, graph.stats.summary()


def test_reduce_overhead_mode_is_accepted_and_other_modes_refused_by_name():
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    f = torch.compile(lambda t: torch.relu(t) * 2, backend="piecewise", mode="reduce-overhead")
    start = last_serial()
    torch.testing.assert_close(f(x), torch.relu(x) * 2)
    assert busiest_graph(start).stats.calls == 1  # compiled by this backend
    torch._dynamo.reset()
    g = torch.compile(lambda t: torch.relu(t) * 3, backend="piecewise", mode="max-autotune")
    with pytest.raises(Exception, match="mode='max-autotune' is not supported"):
        g(x)


class MaskedCatCacheModel(CatCacheModel):
    """transformers 5.17's decode: the mask is built per step from ``attention_mask [B, past + 1]`` and
    the query's position ``arange(1) + past``, both of which depend on the KV length."""

    def forward(self, x, past_k, past_v, attention_mask):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        past = past_k.shape[2]
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        causal = torch.arange(past + 1)[None, :] <= (torch.arange(1) + past)[:, None]
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(b, s, d)), k, v


def _padded_attention_mask(step: int) -> tuple:
    attention_mask = torch.ones(2, step + 2, dtype=torch.long)
    attention_mask[1, 0] = 0  # a padded first position in the second row
    return (attention_mask,)


def test_a_mask_built_for_the_kv_length_runs_beside_attention_too():
    torch.manual_seed(0)
    graph = _decode_with_growing_cache(MaskedCatCacheModel().eval(), _padded_attention_mask)
    assert graph.stats.captured_keys == {()}, graph.stats.summary()  # not one capture per KV length
    assert graph.stats.replays >= 3
    assert any("depends on a KV length" in why for p in graph.pieces for why in p.eager_reasons)


class FullWindowModel(CatCacheModel):
    """transformers 5.17's sliding window once full: the cache keeps the last ``window`` keys (fixed
    shape, so the attention is compiled with its piece), and the mask is gathered from the growing
    ``attention_mask [B, past + 1]`` at the window's positions."""

    window = 4

    def forward(self, x, past_k, past_v, attention_mask):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        k = torch.cat([past_k, k], dim=2)[:, :, -self.window :]
        v = torch.cat([past_v, v], dim=2)[:, :, -self.window :]
        total = attention_mask.shape[1]
        columns = torch.arange(self.window) + (total - self.window)
        mask = attention_mask.bool()[torch.arange(b)[:, None], columns[None, :]][:, None, None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(b, s, d)), k[:, :, 1:], v[:, :, 1:]


def test_a_mask_gathered_from_a_growing_input_runs_beside_fixed_shape_attention():
    """Before, the growing ``attention_mask`` sat in the compute piece: a capture per step, never
    replayed. Now what reads it runs eagerly and the piece, attention included, replays."""
    torch.manual_seed(0)

    def attention_mask_with_a_padded_position(step: int) -> tuple:
        attention_mask = torch.ones(2, step + 8, dtype=torch.long)
        attention_mask[1, -3] = 0  # inside the window
        return (attention_mask,)

    graph = _decode_with_growing_cache(FullWindowModel().eval(), attention_mask_with_a_padded_position, past=3)
    assert [how for _, how in graph.plan.report.attention] == ["graph: compiled with its piece"]
    assert graph.stats.captured_keys == {()}, graph.stats.summary()  # not one capture per mask length
    assert graph.stats.replays >= 3
    assert any("depends on a KV length" in why for p in graph.pieces for why in p.eager_reasons)
