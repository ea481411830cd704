"""On a GPU: the serving engine's model (``toys/engine.py``) through the backend, its attention op
declared, tagged, or neither (every capture fails: the warning names the op and the pool is handed
back), and torch's varlen attention against the engine's reference attention."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import piecewise_backend
from toys import engine as toy

from .helpers import graphed_but_behind, graphs_since, last_serial

pytestmark = pytest.mark.cuda
SMALL = dataclasses.replace(toy.TINY, hidden=128, heads=4, kv_heads=2, layers=3)


def _serve(model, forward, dtype=torch.float32):
    engine = toy.Engine(
        model,
        forward,
        max_num_tokens=48,
        max_num_seqs=6,
        num_blocks=96,
        device="cuda",
        dtype=dtype,
        graph_mode="piecewise",
    )
    return [r.output for r in engine.run(toy.seeded_trace(16, seed=3, vocab=model.cfg.vocab))]


def _model(op: str):
    torch.manual_seed(0)
    return toy.EngineModel(dataclasses.replace(SMALL, attention_op=op)).init_weights_().cuda().eval()


@pytest.mark.parametrize(
    "op,options",
    [(toy.ATTENTION, {"extra_splitting_ops": [toy.ATTENTION]}), (toy.TAGGED_ATTENTION, {})],
    ids=["declared", "tagged"],
)
def test_the_engine_compiled_gives_eager_tokens_and_replays(op, options):
    torch._dynamo.reset()
    start = last_serial()
    model = _model(op)
    expected = _serve(model, None)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*capture at shape key")  # no capture may fail
        got = _serve(model, torch.compile(model, backend="piecewise", options=options))
    assert got == expected
    graphs = graphs_since(start)
    assert sum(g.stats.replays for g in graphs) > 0
    assert all(graphed_but_behind(g.stats) for g in graphs), [g.stats.summary() for g in graphs]


def test_an_undeclared_untagged_attention_op_warns_naming_it_and_hands_the_pool_back():
    torch._dynamo.reset()
    start = last_serial()
    model = _model(toy.ATTENTION)
    expected = _serve(model, None)
    before = piecewise_backend.pool_bytes()
    pools_before = _private_pools()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _serve(model, torch.compile(model, backend="piecewise"))
    assert got == expected  # every step ran un-graphed, right
    messages = [str(w.message) for w in caught if "capture at shape key" in str(w.message)]
    assert messages and f"while running {toy.ATTENTION}, a custom op" in messages[0], messages[:1]
    assert f"extra_splitting_ops=['{toy.ATTENTION}']" in messages[0] and "cudagraph_unsafe" in messages[0]
    graphs = graphs_since(start)
    assert sum(g.stats.replays for g in graphs) == 0 and sum(g.stats.failed_captures for g in graphs) > 0
    # what the failed captures allocated went back: at most a fresh pool's keeper segment remains,
    # and no segment of another private pool is left behind (the allocator's own account)
    assert piecewise_backend.pool_bytes() - before <= 8 * 2**20, piecewise_backend.pool_bytes() - before
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    left = {pool: size for pool, size in _private_pools().items() if pool not in pools_before}
    assert len(left) <= 1 and sum(left.values()) <= 8 * 2**20, left  # the fresh pool's keeper only


def _private_pools() -> dict:
    """Private (graph) pool id -> bytes of its segments, as the CUDA allocator reports them."""
    pools: dict = {}
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id", ()))
        if pool and pool != (0, 0):
            pools[pool] = pools.get(pool, 0) + seg["total_size"]
    return pools


@pytest.mark.skipif(toy._VARLEN_ATTN is None, reason="this torch has no torch.nn.attention.varlen")
def test_varlen_attention_over_the_pages_matches_the_reference_attention():
    """A step of a prefill chunk after cached tokens, a whole prompt and two decode tokens: torch's
    varlen kernel (bf16, bottom-right causal) against the per-request SDPA reference (fp32)."""
    cfg = SMALL
    engine = toy.Engine(
        toy.EngineModel(cfg), max_num_tokens=64, max_num_seqs=4, num_blocks=32, device="cuda", dtype=torch.bfloat16
    )
    requests = [toy.Request(i, list(range(n)), 4) for i, n in enumerate((20, 7, 33, 12))]
    for r, cached in zip(requests, (9, 0, 32, 11)):
        r.blocks = [engine.free_blocks.popleft() for _ in range(4)]
        r.computed = cached
    chosen = [(r, len(r.prompt) - r.computed) for r in requests]
    _, _, meta = engine._inputs(chosen)
    n = meta.num_tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    for k_cache, v_cache in engine.kv_caches:
        k_cache.copy_(torch.randn(k_cache.shape, device="cuda", generator=g))
        v_cache.copy_(torch.randn(v_cache.shape, device="cuda", generator=g))
    q = torch.randn(n, cfg.heads, cfg.head_dim, device="cuda", generator=g)
    k, v = (torch.randn(n, cfg.kv_heads, cfg.head_dim, device="cuda", generator=g) for _ in range(2))
    outs = {}
    with toy.forward_context(meta):
        for dtype in (torch.bfloat16, torch.float32):
            meta.kv_caches = [(kc.to(dtype), vc.to(dtype)) for kc, vc in engine.kv_caches]
            out = torch.empty(n, cfg.heads, cfg.head_dim, device="cuda", dtype=dtype)
            toy._attention_impl(q.to(dtype), k.to(dtype), v.to(dtype), out, 0)
            outs[dtype] = out.float()
    torch.testing.assert_close(outs[torch.bfloat16], outs[torch.float32], atol=3e-2, rtol=3e-2)


def test_graph_memory_estimated_from_two_captures_is_the_graph_memory_of_every_size():
    torch._dynamo.reset()
    model = _model(toy.ATTENTION)
    compiled = torch.compile(
        model,
        backend="piecewise",
        options={"extra_splitting_ops": [toy.ATTENTION], "capture_sizes": [1, 2, 4, 8, 16, 32, 48, 64]},
    )
    engine = toy.Engine(
        model, compiled, max_num_tokens=48, max_num_seqs=6, num_blocks=96, device="cuda", graph_mode="piecewise"
    )
    engine.warm_up()  # compiles; the dynamic graph remembers the weights
    graph = max((g for g in piecewise_backend.compiled_graphs() if g.can_capture_up_front), key=lambda g: g.stats.calls)
    before = {k[0] for k in graph.captured}  # what the warm-up captured
    guess = piecewise_backend.estimate_graph_memory("all", graph)
    # the largest and the size next below it, at most two captures
    assert {(48,), (64,)} <= graph.captured and len({k[0] for k in graph.captured} - before) <= 2, str(guess)
    graph.capture("all")
    measured = piecewise_backend.graph_memory_bytes()
    assert abs(guess.predicted_bytes - measured) <= 0.1 * measured, (str(guess), measured)
    assert guess.largest_size_within(guess.predicted_bytes, graph.policy.sizes) == 64
