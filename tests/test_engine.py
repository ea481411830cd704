"""A serving engine's model through the backend, on CPU (graphs emulated): continuous batching over a
paged KV cache (``toys/engine.py``), ops tagged ``cudagraph_unsafe`` found without being named, a
capture that fails in a custom op named with both fixes, and captured sizes that follow traffic."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import piecewise_backend
from piecewise_backend.kinds import Miss
from piecewise_backend.runtime import emulation
from piecewise_backend.runtime.capture import traffic as capture_traffic
from toys.engine import ATTENTION, TAGGED_ATTENTION, TINY, Engine, EngineModel, seeded_trace

from .helpers import INLINE, graphs_since, last_serial

pytestmark = pytest.mark.usefixtures("emulated_graphs")


def _serve(model, forward, requests=12, seed=1):
    engine = Engine(model, forward, max_num_tokens=32, max_num_seqs=4, num_blocks=64, graph_mode="piecewise")
    return [r.output for r in engine.run(seeded_trace(requests, seed=seed, vocab=model.cfg.vocab))], engine


def _compiled_engine(op: str, options: dict):
    torch._dynamo.reset()
    start = last_serial()
    model = EngineModel(dataclasses.replace(TINY, attention_op=op)).init_weights_().eval()
    expected, eager = _serve(model, None)
    got, engine = _serve(model, torch.compile(model, backend="piecewise", options=options))
    return {"expected": expected, "got": got, "steps": eager.steps, "graphs": graphs_since(start)}


@pytest.fixture(scope="module")
def declared():
    return _compiled_engine(ATTENTION, {"extra_splitting_ops": [ATTENTION]})


@pytest.fixture(scope="module")
def tagged():
    return _compiled_engine(TAGGED_ATTENTION, {})


def _busiest(run):
    return max(run["graphs"], key=lambda g: g.stats.calls)


def test_the_compiled_engine_gives_the_eager_engines_tokens_over_a_seeded_trace(declared):
    assert declared["got"] == declared["expected"]
    sizes = {s.num_tokens for s in declared["steps"]}
    assert len(sizes) >= 6, sizes  # prefill chunks and decode batches of many token counts
    graph = _busiest(declared)
    assert graph.stats.num_compute_pieces == TINY.layers + 1, graph.stats.summary()  # between the attention ops
    # sizes are captured behind the calls that meet them: those calls alone run un-graphed
    assert graph.stats.replays > 0 and set(graph.stats.misses) == {Miss.CAPTURING_BEHIND}, graph.stats.summary()
    assert graph.stats.request_path_capture_seconds == 0 and graph.stats.captures_behind > 0
    assert graph.stats.unsafe_ops == ()
    # rare token counts ride a larger captured graph, padded, rather than each stalling a step to
    # capture its own (capture_deferral.py): fewer sizes captured than padded sizes served
    buckets = {graph.policy.bucket(n) for n in sizes}
    assert graph.stats.rides > 0 and len(graph.captured) < len(buckets), (sorted(buckets), graph.stats.summary())


def test_an_op_tagged_cudagraph_unsafe_is_split_like_a_declared_one(tagged, declared):
    assert tagged["got"] == tagged["expected"]
    for mine, theirs in zip(
        sorted(tagged["graphs"], key=lambda g: g.stats.calls), sorted(declared["graphs"], key=lambda g: g.stats.calls)
    ):
        assert [p.kind for p in mine.pieces] == [p.kind for p in theirs.pieces]
        assert (mine.stats.replays > 0) == (theirs.stats.replays > 0)  # (how many: when the thread is done)
    graph = _busiest(tagged)
    assert graph.stats.unsafe_ops == (TAGGED_ATTENTION,)
    assert f"split at ops tagged cudagraph_unsafe: {TAGGED_ATTENTION}" in graph.stats.summary()
    assert TAGGED_ATTENTION in str(piecewise_backend.report(graph))


@torch.library.custom_op("engine_test::host_sync", mutates_args=())
def _host_sync(x: torch.Tensor) -> torch.Tensor:
    if emulation.capturing():  # what a host sync does inside a CUDA capture
        raise RuntimeError("operation not permitted when stream is capturing")
    return x * 2


@_host_sync.register_fake
def _(x):
    return torch.empty_like(x)


class HostSyncing(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.ops.engine_test.host_sync(self.a(x).relu()))


def test_a_capture_that_fails_in_an_undeclared_custom_op_warns_naming_it_and_both_fixes():
    torch._dynamo.reset()
    start = last_serial()
    model = HostSyncing().eval()
    compiled = torch.compile(model, backend="piecewise", options={"capture_sizes": [4]})
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x))
            piecewise_backend.wait_for_captures()  # a capture behind that failed is said at the next call
    messages = [str(w.message) for w in caught if "capture at shape key" in str(w.message)]
    assert messages, [str(w.message) for w in caught]
    assert "while running engine_test::host_sync, a custom op" in messages[0]
    assert "extra_splitting_ops=['engine_test::host_sync']" in messages[0]
    assert "torch.Tag.cudagraph_unsafe" in messages[0]
    assert "operation not permitted when stream is capturing" in messages[0]  # the op's own error, not the end's
    graph = graphs_since(start)[-1]
    assert graph.stats.failed_captures == 1 and graph.stats.replays == 0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        B, S, H = x.shape
        q, k, v = (t.view(B, S, 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.o(o.transpose(1, 2).reshape(B, S, H))


def test_under_max_captured_sizes_a_size_that_keeps_coming_replaces_the_least_used_one():
    torch._dynamo.reset()
    start = last_serial()
    model = Block().eval()
    options = {"capture_sizes": [2, 4, 8], "max_captured_sizes": 1, **INLINE}  # the calls that capture are counted
    compiled = torch.compile(model, backend="piecewise", options=options)
    sizes = [2] * 4 + [4] * (capture_traffic.MIN_CALLS + 4) + [2] * 3
    with pytest.warns(UserWarning, match=r"not capturing shape key \(4,\): 1 sizes captured, max_captured_sizes=1"):
        for n in sizes:
            x = torch.randn(n, 6, 16)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), msg=lambda m: f"batch {n}: {m}")
    graph = max(graphs_since(start), key=lambda g: g.stats.calls)
    assert graph.stats.replaced_keys == [(2,)], graph.stats.summary()
    assert [e.key for e in graph.stats.events] == [(2,), (4,)]
    assert graph.stats.events[1].call == 4 + capture_traffic.MIN_CALLS  # the call that reached MIN_CALLS
    assert graph.stats.misses["over the capture budget"] == capture_traffic.MIN_CALLS - 1
    assert graph.stats.rides == 3  # the last 2s replay 4's graph, padded, while bucket 2 waits (capture_deferral.py)
    assert "replaced by busier ones (max_captured_sizes): 1 ((2,))" in graph.stats.summary()


def test_an_engine_whose_attention_op_is_neither_named_nor_tagged_warns_naming_it_and_serves_eager_tokens():
    torch._dynamo.reset()
    start = last_serial()
    model = EngineModel(TINY).init_weights_().eval()
    expected, _ = _serve(model, None, requests=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _ = _serve(model, torch.compile(model, backend="piecewise"), requests=4)
    assert got == expected
    messages = [str(w.message) for w in caught if "capture at shape key" in str(w.message)]
    assert messages and f"while running {ATTENTION}, a custom op" in messages[0], messages[:1]
    assert f"extra_splitting_ops=['{ATTENTION}']" in messages[0] and "torch.Tag.cudagraph_unsafe" in messages[0]
    graphs = graphs_since(start)
    assert sum(g.stats.replays for g in graphs) == 0 and sum(g.stats.failed_captures for g in graphs) > 0


def test_in_full_mode_an_op_tagged_cudagraph_unsafe_is_still_split_and_never_captured():
    torch._dynamo.reset()
    start = last_serial()
    model = EngineModel(dataclasses.replace(TINY, attention_op=TAGGED_ATTENTION)).init_weights_().eval()
    expected, _ = _serve(model, None, requests=3)
    got, _ = _serve(model, torch.compile(model, backend="piecewise", options={"mode": "full"}), requests=3)
    assert got == expected
    graph = max(graphs_since(start), key=lambda g: g.stats.calls)
    assert graph.stats.num_split_pieces == TINY.layers and graph.stats.unsafe_ops == (TAGGED_ATTENTION,)
    assert graph.stats.replays > 0 and graph.stats.failed_captures == 0, graph.stats.summary()


def test_warm_up_captures_nothing_and_the_first_requests_capture_what_they_need():
    torch._dynamo.reset()
    start = last_serial()
    model = EngineModel(dataclasses.replace(TINY, attention_op=ATTENTION)).init_weights_().eval()
    expected, _ = _serve(model, None, requests=4)
    options = {"extra_splitting_ops": [ATTENTION], "row_independent_ops": [ATTENTION]}
    engine = Engine(model, torch.compile(model, backend="piecewise", options=options), max_num_tokens=32)
    engine.warm_up()  # compiles every graph a step takes (vLLM's dummy runs), un-graphed
    graphs = graphs_since(start)
    assert graphs and all(g.stats.calls > 0 and not g.stats.events for g in graphs), [g.stats.summary() for g in graphs]
    assert [r.output for r in engine.run(seeded_trace(4, seed=1, vocab=model.cfg.vocab))] == expected
    assert sum(len(g.stats.events) for g in graphs_since(start)) > 0  # captured as the requests came
    assert {e.how for g in graphs_since(start) for e in g.stats.events} == {"behind"}  # none in a request

    held = Engine(model, torch.compile(model, backend="piecewise", options=options), max_num_tokens=32)
    torch._dynamo.reset()
    start = last_serial()
    held.warm_up(capture=True)  # the old way: start-up pays for the dummy steps' graphs (and waits for them)
    assert sum(len(g.stats.events) for g in graphs_since(start)) > 0
