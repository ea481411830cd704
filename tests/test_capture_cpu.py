"""Padding, slicing, eager/lazy capture, budgets and full mode, end to end on CPU.

CUDA graphs need a GPU, so these tests swap in ``cudagraphs._EmulatedGraph`` (replay re-runs the
compiled piece on the captured buffers and copies into the captured outputs: same fixed addresses)
and check everything above the graph itself against eager: which sizes pad to which capture size,
that the caller sees its own batch size and eager's values, what is captured when, and why not.
The same scenarios run with real graphs in test_cuda_capture.py.
"""

import dataclasses
import warnings

import pytest
import torch

import piecewise_backend
from piecewise_backend.kinds import Miss
from toys.models import ToyConfig, ToyLlama, ToyStaticCacheLlama

from .helpers import (
    INLINE,
    SPLIT_ATTENTION,
    Encoder,
    assert_results_close,
    busiest_graph,
    compile_with_reference,
    decode_at_sizes,
    graphs_since,
    last_serial,
)

CFG = ToyConfig(layers=2, max_batch=12)
SIZES = (3, 2, 5, 8, 7, 9, 10, 4, 6, 3)  # 9, 10 are above the largest capture size
pytestmark = pytest.mark.usefixtures("emulated_graphs")


def _compile(model_cls, options):
    return compile_with_reference(model_cls, CFG, options)


def _padded_graphs(start):
    """The graphs with a dynamic batch (Dynamo's first, specialised graph has none)."""
    graphs = [g for g in graphs_since(start) if g.pad_position is not None]
    assert graphs, [g.stats.summary() for g in graphs_since(start)]
    return graphs


def _main_graph(start):
    """The graph that served the decode loop (Dynamo's first graph specialises pos == 0, runs once)."""
    return max(_padded_graphs(start), key=lambda g: g.stats.calls)


@pytest.fixture(scope="module")
def padded_run():
    compiled, reference, start = _compile(
        ToyLlama, {**SPLIT_ATTENTION, "capture_sizes": [1, 2, 4, 8], "eager_capture_sizes": [8, 2]}
    )
    with torch.no_grad():
        results = decode_at_sizes(compiled, reference, SIZES)
    return results, _padded_graphs(start)


def test_padded_sizes_match_eager(padded_run):
    assert_results_close(padded_run[0])


def test_a_bucket_near_a_captured_size_rides_it_rather_than_capturing(padded_run):
    for graph in padded_run[1]:
        assert "padded up to the next capture size" in graph.stats.padding
        # 2 and 8 up front; 5, 7, 6 -> 8; 3 -> 4 and 4 ride 8 (within 2x: bucket 4 is captured only
        # at its capture_deferral.NEAR_CALLS-th call)
        assert graph.captured == {(2,), (8,)}
        for piece in graph.stats.pieces.values():
            assert sorted(piece.keys) == [(2,), (8,)]


def test_eager_sizes_captured_largest_first_behind_the_first_call(padded_run):
    for graph in padded_run[1]:
        events = graph.stats.events
        assert [(e.key, e.how, e.call) for e in events[:2]] == [((8,), "up-front", 1), ((2,), "up-front", 1)]
        assert [(e.key, e.how) for e in events[2:]] == []
    # a graph's first call that would have captured is served at once, un-graphed (one graph's first
    # call is above the largest size: un-graphed anyway, and counted as that)
    behind = [g.stats.misses[Miss.CAPTURING_BEHIND] for g in padded_run[1]]
    assert set(behind) <= {0, 1} and sum(behind) >= 1, behind


def test_calls_go_on_un_graphed_and_right_while_eager_sizes_are_captured_behind_them():
    from piecewise_backend.runtime.call_guard import call_guard

    compiled, reference, start = _compile(
        ToyLlama, {**SPLIT_ATTENTION, "capture_sizes": [1, 2, 4, 8], "eager_capture_sizes": "all"}
    )
    with torch.no_grad():
        with call_guard(torch.device("cpu")).capture_lock:  # the capture thread waits here meanwhile
            before = decode_at_sizes(compiled, reference, (3, 5, 2), wait_for_captures=False)
            graphs = _padded_graphs(start)
            assert all(g.captured == set() for g in graphs)  # nothing yet: no call waited for a capture
            assert sum(g.stats.misses[Miss.CAPTURING_BEHIND] for g in graphs) == sum(g.stats.calls for g in graphs)
        assert piecewise_backend.wait_for_captures(timeout=120)
        assert all(g.captured == {(1,), (2,), (4,), (8,)} for g in graphs)
        after = decode_at_sizes(compiled, reference, (3, 5, 2), seed=1, start_pos=6)
    assert_results_close(before + after)
    assert all(e.how == "up-front" for g in graphs for e in g.stats.events)
    assert _main_graph(start).stats.replays > 0


def test_every_size_reads_its_copied_inputs_from_the_largest_sizes_buffer(padded_run):
    # 8 first, then 2: size 2's copied inputs (token ids, attention outputs) are the first rows of
    # size 8's buffers, so capturing it took no new memory (on CPU graph memory is those buffers)
    for graph in padded_run[1]:
        arenas = graph.input_arenas()
        assert all(len(a._all) == len(a._current) for a in arenas)  # one buffer per copied input
        assert sum(len(a._all) for a in arenas) == 1 + CFG.layers  # token ids, each attention output
        assert graph.memory_bytes() == sum(a.nbytes() for a in arenas) > 0
        assert [e.pool_growth for e in graph.stats.events[1:]] == [0]


def test_above_the_largest_size_runs_ungraphed_and_says_so(padded_run):
    misses = sum(g.stats.misses[Miss.ABOVE_MAX] for g in padded_run[1])
    assert misses == 4  # sizes 9 and 10, two steps each
    assert any("size 10 > largest capture size 8" in g.stats.summary() for g in padded_run[1])


def _assert_copies_per_step(graphs, per_step: int):
    graphs = [g for g in graphs if g.stats.calls > 1]  # Dynamo's pos == 0 graph runs once
    assert graphs
    for graph in graphs:
        assert graph.stats.replays > 0
        steps = graph.stats.replays / graph.stats.num_compute_pieces
        copies = sum(p.input_copies for p in graph.stats.pieces.values())
        assert copies == steps * per_step, graph.stats.summary()


def test_padded_replays_copy_only_what_changed(padded_run):
    # per step: token ids into the first piece, each attention output into the next piece; the
    # RoPE rows at this step's position are gathered inside the graphs (rewrite/rope_reads.py);
    # the outputs of one piece feed the next in place (no copy)
    _assert_copies_per_step(padded_run[1], 1 + CFG.layers)


def test_inputs_several_pieces_read_are_copied_once_per_step():
    # with the KV writes left eager there are no device step scalars, so the RoPE rows (cos, sin at
    # this step's position) are sliced eagerly, and copied once per step into the buffer every
    # layer's piece reads (staging.py)
    compiled, reference, start = _compile(
        ToyLlama, {**SPLIT_ATTENTION, "capture_sizes": [2, 4, 8], "capture_kv_writes": False}
    )
    with torch.no_grad():
        assert_results_close(decode_at_sizes(compiled, reference, (3, 2, 5, 3)))
    _assert_copies_per_step(_padded_graphs(start), 1 + CFG.layers + 2)


def test_budget_on_sizes_stops_capture_and_answers_right():
    compiled, reference, start = _compile(ToyLlama, {"capture_sizes": [2, 4, 8], "max_captured_sizes": 2})
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = decode_at_sizes(compiled, reference, (2, 3, 8, 8, 2))
    assert_results_close(results)
    graph = _main_graph(start)
    assert graph.captured == {(2,), (4,)} and graph.stats.misses[Miss.OVER_BUDGET] == 4  # 2 steps at 8, twice
    assert "max_captured_sizes=2" in graph.stats.miss_details[Miss.OVER_BUDGET]
    assert any("not capturing shape key (8,)" in str(w.message) for w in caught)


def test_lazy_off_pads_to_a_captured_size():
    compiled, reference, start = _compile(
        ToyLlama, {"capture_sizes": [2, 4, 8], "eager_capture_sizes": [8], "lazy_capture": False}
    )
    with torch.no_grad():
        results = decode_at_sizes(compiled, reference, (3, 5, 2))
    assert_results_close(results)
    for graph in _padded_graphs(start):  # every size pads to the one captured up front
        assert graph.captured == {(8,)} and graph.stats.misses[Miss.NOT_CAPTURED] == 0
    assert _main_graph(start).stats.replays > 0


def test_padding_off_graphs_only_exact_sizes():
    compiled, reference, start = _compile(ToyLlama, {"capture_sizes": [2, 4, 8], "padding": False})
    with torch.no_grad():
        results = decode_at_sizes(compiled, reference, (3, 4, 3))
    assert_results_close(results)
    graph = _main_graph(start)
    assert graph.captured == {(4,)} and graph.stats.misses[Miss.NOT_A_CAPTURE_SIZE] == 3


class BatchNormalised(torch.nn.Module):
    """Subtracts the batch mean: padding would mix garbage rows into it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        return h - h.mean(0, keepdim=True)


def test_a_graph_that_reduces_over_the_batch_is_never_padded():
    torch._dynamo.reset()
    start = last_serial()
    net = BatchNormalised().eval()
    compiled = torch.compile(net, backend="piecewise", options={"capture_sizes": [2, 4, 8], **INLINE})
    with torch.no_grad():
        for size in (3, 3, 4, 4, 5):
            x = torch.randn(size, 16)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), net(x))
    graph = _padded_graphs(start)[-1]
    assert "reduces over the batch" in graph.stats.padding
    # padding refused, each size is captured as it is (and replays), none left un-graphed
    assert graph.captured == {(3,), (4,), (5,)} and graph.stats.replays == 2, graph.stats.summary()
    assert graph.stats.ungraphed_runs == 0


def test_explicit_capture_and_its_errors():
    compiled, reference, start = _compile(ToyLlama, {"capture_sizes": [2, 4, 8]})
    with torch.no_grad():
        decode_at_sizes(compiled, reference, (3, 2), steps=1)  # a graph for pos == 0, then the decode graph
        graph = _padded_graphs(start)[-1]
        assert graph.captured == {(2,)}
        with pytest.raises(ValueError, match=r"\[5\] are not capture sizes.*\[2, 4, 8\]"):
            graph.capture([5])
        assert graph.capture([8, 4, 2]) == [(8,), (4,)]  # 2 was captured by the call
        assert_results_close(decode_at_sizes(compiled, reference, (7, 4), start_pos=2))
    assert graph.captured == {(2,), (4,), (8,)}
    assert [e.how for e in graph.stats.events] == ["behind", "up-front", "up-front"]


def test_capture_after_an_inference_mode_warm_up_fails_at_no_size():
    """A server warms up under ``inference_mode``, then captures up front and serves under ``no_grad``:
    the buffers captures copy inputs into take copies in every mode (made in inference mode, they
    refused them: every up-front capture failed, and on CUDA each retired its pool)."""
    compiled, reference, start = _compile(ToyLlama, {**SPLIT_ATTENTION, **INLINE, "capture_sizes": [2, 4, 8]})
    with torch.inference_mode():  # the largest size first, as a warm-up goes: later sizes reuse its buffers
        first = decode_at_sizes(compiled, reference, (3, 8), steps=1)
    graph = _padded_graphs(start)[-1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert graph.capture([4, 2]) == [(4,), (2,)]  # outside inference mode, as a user's script goes
        with torch.inference_mode():
            later = decode_at_sizes(compiled, reference, (7, 4, 2), start_pos=2)
    assert_results_close(first + later)
    assert [str(w.message) for w in caught if "piecewise" in str(w.message)] == []
    assert graph.stats.failed_captures == 0 and graph.stats.ungraphed_runs == 0, graph.stats.summary()
    assert graph.stats.replays > 0


def test_capture_on_a_graph_without_dynamic_batch_says_what_to_do():
    compiled, reference, start = _compile(ToyLlama, {"capture_sizes": [2, 4]})
    with torch.no_grad():
        compiled(torch.zeros(3, 1, dtype=torch.long), 0)  # not marked dynamic: Dynamo specialises
    static = graphs_since(start)[-1]
    assert static.pad_position is None and static.captured == {()}
    with pytest.raises(RuntimeError, match="no dynamic batch size.*mark_dynamic"):
        static.capture([2])


def test_full_mode_static_cache_is_one_piece_and_right_at_every_size():
    compiled, reference, start = _compile(ToyStaticCacheLlama, {"mode": "full", "capture_sizes": [2, 4, 8]})
    with torch.no_grad():
        results = decode_at_sizes(compiled, reference, (2, 3, 4, 5, 8, 9), static_cache=True)
    assert_results_close(results)
    for graph in graphs_since(start):
        assert graph.stats.num_pieces == 1 and graph.stats.num_compute_pieces == 1
    for graph in _padded_graphs(start):
        # its index_copy_ cache writes replay masked to the caller's rows (rewrite/kv_writes.py), so it pads
        assert "padded" in graph.stats.padding and graph.captured <= {(2,), (4,), (8,)}
        assert graph.stats.replays > 0
    for mine, theirs in zip(compiled._orig_mod.layers, reference.layers):
        torch.testing.assert_close(mine.attn.k_cache, theirs.attn.k_cache)
        torch.testing.assert_close(mine.attn.v_cache, theirs.attn.v_cache)


@pytest.mark.parametrize("layers, compiles", [(6, 3), (3, 1)])
def test_a_deep_one_piece_step_compiles_each_distinct_layer_once_and_runs_as_one_graph(layers, compiles):
    """A one-piece step of 6 layers (full mode) compiles its first, middle and last layers' code once
    each (``layer_chain.py``), not all six layers, and still captures and replays as one graph; with
    3 layers the distinct sub-pieces would hold over half the ops, so it compiles whole."""
    cfg = dataclasses.replace(CFG, layers=layers)
    compiled, reference, start = compile_with_reference(
        ToyStaticCacheLlama, cfg, {"mode": "full", "capture_sizes": [2, 4]}
    )
    with torch.no_grad():
        results = decode_at_sizes(compiled, reference, (2, 3, 4), static_cache=True)
    assert_results_close(results)
    for graph in graphs_since(start):
        assert graph.stats.num_pieces == 1 and graph.stats.inductor_compiles == compiles, graph.stats.summary()
    graph = _main_graph(start)
    assert graph.stats.replays > 0 and graph.stats.captures == len(graph.captured) == 2


def test_a_piece_that_cannot_be_cut_into_layers_is_compiled_whole_and_says_so(monkeypatch, caplog):
    from piecewise_backend.compiling import layer_chain

    def fails(*args, **kwargs):
        raise KeyError("s86")  # what split_module raised on the H200 for a symbol no node binds

    monkeypatch.setattr(layer_chain, "split_module", fails)
    compiled, reference, start = compile_with_reference(
        ToyStaticCacheLlama, dataclasses.replace(CFG, layers=6), {"mode": "full", "capture_sizes": [2, 4]}
    )
    with torch.no_grad(), caplog.at_level("INFO", logger="piecewise_backend"):
        results = decode_at_sizes(compiled, reference, (2, 3), static_cache=True)
    assert_results_close(results)
    assert all(g.stats.inductor_compiles == 1 for g in graphs_since(start))
    assert any("compiled whole: compiling it layer by layer failed: KeyError" in r.getMessage() for r in caplog.records)


def test_full_mode_pads_a_graph_safe_model():
    torch._dynamo.reset()
    start = last_serial()
    net = Encoder(h=32).eval()
    compiled = torch.compile(net, backend="piecewise", options={"mode": "full", "capture_sizes": [2, 4, 8]})
    with torch.no_grad():
        for size in (2, 3, 5, 7, 8, 6):
            x = torch.randn(size, 6, 32)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), net(x), atol=1e-5, rtol=1e-5)
    graph = _padded_graphs(start)[-1]
    assert graph.stats.num_pieces == 1 and "padded" in graph.stats.padding
    assert graph.captured == {(2,), (4,), (8,)}


def test_released_graphs_are_destroyed_and_captured_again_on_the_next_call(monkeypatch):
    # what a tensor-parallel program does before destroy_process_group (NCCL waits for every graph
    # that captured its collectives to be destroyed)
    import gc
    import weakref

    from piecewise_backend import registry, release_graphs

    compiled, reference, start = _compile(ToyLlama, {"capture_sizes": [2, 4, 8]})
    with torch.no_grad():
        results = decode_at_sizes(compiled, reference, (2, 3))
    graphs = _padded_graphs(start)
    main = _main_graph(start)
    # 2, then 4 (growing sizes): the copied input's buffer of size 2 stays (its graph reads it)
    # beside the larger one of size 4
    assert [len(a._all) for a in main.input_arenas() if a._all] == [2]
    alive = [weakref.ref(c.graph) for g in graphs for r in g.runners.values() for c in r.captures.values()]
    assert alive and all(ref() is not None for ref in alive)
    monkeypatch.setattr(registry, "compiled_graphs", lambda: graphs)  # leave other tests' graphs alone
    keys = sum(len(g.captured) for g in graphs)
    assert keys >= 2 and release_graphs() == keys
    gc.collect()
    assert all(ref() is None for ref in alive)
    assert main.captured == set() and all(not r.captures for r in main.runners.values())
    assert main.memory_bytes() == 0  # the input buffers went with the graphs
    with torch.no_grad():
        results += decode_at_sizes(compiled, reference, (3, 2), start_pos=4)
    assert_results_close(results)
    # captured again at the next call; 2 then rides 4 (within 2x of it: capture_deferral.py)
    assert [e.key for e in main.stats.events] == [(2,), (4,), (4,)]
    assert main.stats.replays > 0
    assert [len(a._all) for a in main.input_arenas() if a._all] == [1]  # size 4's alone


def test_a_piece_without_tensor_inputs_is_captured_on_the_graphs_device():
    """A compute piece fed only by the batch size (``arange(B)`` after the attention) has no tensor to
    take a device from: it captures on the graph's device (emulated here), not on "cuda"."""
    torch._dynamo.reset()
    start = last_serial()

    def step(q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return out, torch.arange(q.shape[0]) * 2.0

    compiled = torch.compile(step, backend="piecewise", options={"capture_sizes": [2, 4]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (2, 3, 4):
            q, k, v = torch.randn(3, batch, 2, 5, 8).unbind(0)
            for t in (q, k, v):
                torch._dynamo.mark_dynamic(t, 0)
            got, want = compiled(q, k, v), step(q, k, v)
            torch.testing.assert_close(got, want)
    graph = busiest_graph(start)
    assert not [str(w.message) for w in caught if "failed" in str(w.message)]
    assert graph.stats.captures >= 2 and graph.stats.replays >= 1 and not graph.stats.failed_captures, (
        graph.stats.summary()
    )
