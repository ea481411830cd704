"""Capture policy with real CUDA graphs: padding at every size, buckets, eager sizes, budgets, full mode."""

import logging
import warnings

import pytest
import torch

import piecewise_backend
from piecewise_backend.kinds import Miss
from piecewise_backend.runtime.devices import device_graphs
from toys.models import ToyConfig, ToyLlama, ToyStaticCacheLlama, sdpa_backends

from .helpers import (
    INLINE,
    Encoder,
    assert_results_close,
    busiest_graph,
    compile_with_reference,
    decode_at_sizes,
    graphs_since,
    last_serial,
)

pytestmark = pytest.mark.cuda
MAX = 16  # capture sizes 1, 2, 4, 8, 16 ("default" scheme up to 16)
SIZES = tuple(range(1, MAX + 11))  # every size 1 .. max + 10
CFG = ToyConfig(layers=2, max_batch=MAX + 10, max_seq=128)
TOL = {"atol": 2e-3, "rtol": 2e-3}


def _compile(model_cls, options):
    return compile_with_reference(model_cls, CFG, {**INLINE, **options}, device="cuda")


def _buckets(sizes, capture_sizes):
    return {(min(c for c in capture_sizes if c >= s),) for s in sizes if s <= max(capture_sizes)}


@pytest.fixture(scope="module")
def every_size():
    compiled, reference, start = _compile(
        ToyLlama, {"max_capture_size": MAX, "eager_capture_sizes": [MAX, 2], "defer_captures": False}
    )  # every bucket on first sight
    logger = logging.getLogger("piecewise_backend")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with torch.no_grad(), sdpa_backends("cuda"):
            results = decode_at_sizes(compiled, reference, SIZES, device="cuda")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return results, graphs_since(start), records, compiled, reference


def test_every_size_up_to_max_plus_10_matches_eager(every_size):
    assert_results_close(every_size[0], **TOL)


def test_kv_writes_in_the_graphs_leave_the_cache_as_eager_does(every_size):
    # rewrite/kv_writes.py: the writes replay inside the compute pieces, padded rows masked
    graphs = [g for g in every_size[1] if g.pad_position is not None and g.stats.calls > 1]
    assert graphs and all(g.step_scalars is not None for g in graphs)
    compiled, reference = every_size[3], every_size[4]
    for mine, theirs in zip(compiled._orig_mod.layers, reference.layers):
        torch.testing.assert_close(mine.attn.k_cache, theirs.attn.k_cache, **TOL)
        torch.testing.assert_close(mine.attn.v_cache, theirs.attn.v_cache, **TOL)


def test_captures_equal_the_distinct_buckets_touched(every_size):
    graphs = [g for g in every_size[1] if g.pad_position is not None and g.stats.calls > 1]
    assert graphs
    for graph in graphs:
        # eager sizes (16, 2) plus the buckets of the sizes this graph served
        expected = _buckets(graph.stats.batch_sizes, (1, 2, 4, 8, 16)) | {(MAX,), (2,)}
        assert graph.captured == expected, graph.stats.table()
        assert graph.stats.captures == len(graph.captured) * graph.stats.num_compute_pieces
        assert graph.stats.misses[Miss.ABOVE_MAX] == sum(n for s, n in graph.stats.batch_sizes.items() if s > MAX)
        assert not graph.stats.failed_captures
        assert graph.stats.pool_bytes > 0  # measured by the allocator
    assert sum(g.stats.misses[Miss.ABOVE_MAX] for g in graphs) == 2 * 10  # sizes 17..26, two steps each
    assert piecewise_backend.process_stats()["pool_bytes"] > 0


def test_eager_sizes_are_captured_before_the_first_output(every_size):
    for graph in every_size[1]:
        if graph.pad_position is None:
            continue
        first = [(e.key, e.how, e.call) for e in graph.stats.events[:2]]
        assert first == [((MAX,), "up-front", 1), ((2,), "up-front", 1)], graph.stats.table()


def test_one_info_line_per_capture(every_size):
    lines = [r.getMessage() for r in every_size[2] if "captured shape key" in r.getMessage()]
    assert lines and all(r.levelno == logging.INFO for r in every_size[2] if "captured shape key" in r.getMessage())
    assert len(lines) == sum(len(g.stats.events) for g in every_size[1])
    assert all(" ms; graph pool " in line for line in lines)


def test_memory_budget_stops_capture_and_the_model_still_answers_right():
    device_graphs(torch.device("cuda")).pool  # the pool exists (its keeper holds a segment)
    cap = piecewise_backend.pool_bytes() - 1  # below what the pool already holds
    compiled, reference, start = _compile(ToyLlama, {"max_capture_size": MAX, "max_graph_memory": cap})
    with torch.no_grad(), sdpa_backends("cuda"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = decode_at_sizes(compiled, reference, (3, 5, 3), device="cuda")
    assert_results_close(results, **TOL)
    graphs = graphs_since(start)
    assert all(not g.captured for g in graphs)
    assert sum(g.stats.misses[Miss.OVER_BUDGET] for g in graphs) == 6
    assert any("max_graph_memory" in str(w.message) and "MiB" in str(w.message) for w in caught)


def test_size_budget_caps_captures_on_the_gpu():
    compiled, reference, start = _compile(ToyLlama, {"max_capture_size": MAX, "max_captured_sizes": 1})
    with torch.no_grad(), sdpa_backends("cuda"):
        results = decode_at_sizes(compiled, reference, (3, 3, 6, 2), device="cuda", start_pos=2)
    assert_results_close(results, **TOL)
    for graph in graphs_since(start):
        assert len(graph.captured) <= 1


def test_full_mode_static_cache_is_right_at_every_size():
    compiled, reference, start = _compile(ToyStaticCacheLlama, {"mode": "full", "max_capture_size": MAX})
    with torch.no_grad():
        results = decode_at_sizes(compiled, reference, SIZES, device="cuda", static_cache=True)
    assert_results_close(results, **TOL)
    graphs = graphs_since(start)
    assert all(g.stats.num_pieces == 1 for g in graphs), [g.stats.summary() for g in graphs]
    dynamic = [g for g in graphs if g.pad_position is not None and g.stats.calls > 1]
    assert dynamic and all(g.stats.replays > 0 for g in dynamic)
    for graph in dynamic:  # its index_copy_ cache writes replay masked to the caller's rows: padded
        assert "padded" in graph.stats.padding and graph.step_scalars is not None
        assert graph.captured == _buckets(graph.stats.batch_sizes, (1, 2, 4, 8, 16))
        assert graph.stats.misses[Miss.NOT_A_CAPTURE_SIZE] == 0
    for mine, theirs in zip(compiled._orig_mod.layers, reference.layers):
        torch.testing.assert_close(mine.attn.k_cache, theirs.attn.k_cache, **TOL)
        torch.testing.assert_close(mine.attn.v_cache, theirs.attn.v_cache, **TOL)


def test_full_mode_pads_a_graph_safe_model_at_every_size():
    torch._dynamo.reset()
    start = last_serial()
    net = Encoder().cuda().eval()
    compiled = torch.compile(net, backend="piecewise", options={**INLINE, "mode": "full", "max_capture_size": MAX})
    with torch.no_grad():
        for size in SIZES[1:]:
            for _ in range(2):
                x = torch.randn(size, 8, 64, device="cuda")
                torch._dynamo.mark_dynamic(x, 0)
                torch.testing.assert_close(compiled(x), net(x), **TOL, msg=lambda m: f"batch {size}: {m}")
    graph = busiest_graph(start)
    assert graph.stats.num_pieces == 1 and "padded" in graph.stats.padding
    assert graph.captured == _buckets(graph.stats.batch_sizes, (1, 2, 4, 8, 16))


def test_graph_attention_makes_the_decode_step_one_graph_at_every_size():
    compiled, reference, start = _compile(ToyLlama, {"max_capture_size": MAX, "graph_attention": True})
    with torch.no_grad(), sdpa_backends("cuda"):
        results = decode_at_sizes(compiled, reference, SIZES, device="cuda")
    assert_results_close(results, **TOL)
    graphs = [g for g in graphs_since(start) if g.pad_position is not None and g.stats.calls > 1]
    assert graphs and all(g.stats.num_pieces == 1 and g.stats.replays > 0 for g in graphs), [
        g.stats.summary() for g in graphs
    ]
    for mine, theirs in zip(compiled._orig_mod.layers, reference.layers):
        torch.testing.assert_close(mine.attn.k_cache, theirs.attn.k_cache, **TOL)
