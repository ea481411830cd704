"""Full graphs chosen per call (``cudagraph_mode("full")``), on CPU with emulated graphs: the serving
engine's decode steps as one graph each against the eager engine's tokens, padding across a declared
op (refused, named, for an undeclared one), a replay that reads metadata written after the capture,
outputs safe from the next replay, a capture that fails falling back with a warning that names the
op, and the modes' stats."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import piecewise_backend
from piecewise_backend.kinds import GraphMode, Miss
from piecewise_backend.runtime import emulation
from toys.engine import ATTENTION, TAGGED_ATTENTION, TINY, Engine, EngineModel, Request, seeded_trace

from .helpers import INLINE, graphs_since, last_serial

pytestmark = pytest.mark.usefixtures("emulated_graphs")


# -- the serving engine: decode-only steps full, the rest piecewise -------------------------------------


def _serve(model, forward, graph_mode, requests=10, seed=2):
    engine = Engine(model, forward, max_num_tokens=32, max_num_seqs=5, num_blocks=80, graph_mode=graph_mode)
    return [r.output for r in engine.run(seeded_trace(requests, seed=seed, vocab=model.cfg.vocab))], engine


def _engine_run(options: dict, op: str = ATTENTION):
    torch._dynamo.reset()
    start = last_serial()
    model = EngineModel(dataclasses.replace(TINY, attention_op=op)).init_weights_().eval()
    expected, eager = _serve(model, None, "piecewise")
    compiled = torch.compile(model, backend="piecewise", options=options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, engine = _serve(model, compiled, "full_and_piecewise")
    graphs = graphs_since(start)
    return {
        "expected": expected,
        "got": got,
        "graphs": graphs,
        "steps": engine.steps,
        "model": model,
        "compiled": compiled,
        "warnings": [str(w.message) for w in caught if "piecewise" in str(w.message)],
    }


@pytest.fixture(scope="module")
def declared():
    return _engine_run({"extra_splitting_ops": [ATTENTION], "row_independent_ops": [ATTENTION]})


@pytest.fixture(scope="module")
def undeclared():
    return _engine_run({"extra_splitting_ops": [ATTENTION]})


def _dynamic(run):
    return next(g for g in run["graphs"] if g.pad_position is not None)


def test_decode_steps_replay_full_graphs_and_give_the_eager_engines_tokens(declared):
    assert declared["got"] == declared["expected"]
    assert declared["warnings"] == []
    decode_sizes = {s.num_tokens for s in declared["steps"] if s.num_prefill_tokens == 0}
    assert len(decode_sizes) >= 3, decode_sizes
    graphs = declared["graphs"]
    assert sum(g.stats.full_replays for g in graphs) > 0 and sum(g.stats.piecewise_replays for g in graphs) > 0
    # a call whose size's full graph is being captured behind it runs piecewise meanwhile, nothing else
    assert all(set(g.stats.full_fallbacks) <= {Miss.CAPTURING_BEHIND} and not g.stats.full_failures for g in graphs), [
        g.stats.summary() for g in graphs
    ]
    graph = _dynamic(declared)
    assert (
        "full padding: s" in graph.stats.summary() and "padded up to the next capture size" in graph.stats.full_padding
    )
    full_sizes = {size for (mode, size), _ in graph.stats.graph_calls.items() if mode == GraphMode.FULL}
    assert full_sizes <= set(graph.policy.sizes)  # every full graph is of a capture size: 3 pads to 4
    assert any(n not in graph.policy.sizes for n in decode_sizes if n > 1), decode_sizes  # and some padded
    full_events = [e for e in graph.stats.events if e.mode == GraphMode.FULL]
    assert full_events and all(e.pieces == 1 for e in full_events)


def test_an_undeclared_opaque_op_refuses_full_padding_naming_it_and_sizes_are_captured_exactly(undeclared):
    assert undeclared["got"] == undeclared["expected"]
    graph = _dynamic(undeclared)
    note = graph.stats.full_padding
    assert "engine::attention" in note and "row_independent_ops" in note and "captured as it is" in note
    assert {(n,) for (mode, n), _ in graph.stats.graph_calls.items() if mode == GraphMode.FULL} <= set(
        graph.stats.full_keys
    )  # each size its own graph, none padded
    # piecewise graphs still pad: the op runs eagerly between them at the step's own size
    assert "padded up to the next capture size" in graph.stats.padding


def test_an_op_tagged_cudagraph_unsafe_keeps_every_call_piecewise_and_says_why():
    run = _engine_run({}, op=TAGGED_ATTENTION)
    assert run["got"] == run["expected"]
    graph = _dynamic(run)
    assert graph.stats.full_replays == 0 and graph.stats.piecewise_replays > 0
    ((reason, count),) = graph.stats.full_fallbacks.items()
    assert TAGGED_ATTENTION in reason and "cudagraph_unsafe" in reason and count > 0
    assert "run piecewise" in graph.stats.summary()


def test_a_later_run_whose_requests_reuse_ids_reads_its_own_pages(declared):
    """Each wave's requests are numbered from 0 and finish together, so the next wave's first decode
    batch has the last one's ids, with other pages: the block tables must be rewritten all the same."""
    model = declared["model"]

    def wave(seed):
        g = torch.Generator().manual_seed(seed)
        return [Request(i, torch.randint(0, TINY.vocab, (6,), generator=g).tolist(), 5) for i in range(4)]

    def waves(forward, mode):
        engine = Engine(model, forward, max_num_tokens=32, max_num_seqs=4, num_blocks=80, graph_mode=mode)
        return [[r.output for r in engine.run(wave(seed))] for seed in (1, 2)]

    def full_replays():  # every live graph's (a Dynamo reset by an earlier test means a fresh compile)
        return sum(g.stats.full_replays for g in piecewise_backend.compiled_graphs())

    replays = full_replays()
    assert waves(declared["compiled"], "full_and_piecewise") == waves(None, "piecewise")
    assert full_replays() > replays


# -- a model whose op reads a persistent buffer, as an engine's attention does ----------------------------

_STATE = {"scale": torch.ones(32, 1)}  # the "metadata": a buffer at a fixed address, written between calls
_FRAGILE = {"refuse": False}


@torch.library.custom_op("full_test::scaled", mutates_args=("out",))
def _scaled(x: torch.Tensor, out: torch.Tensor) -> None:
    if _FRAGILE["refuse"] and emulation.capturing():
        raise RuntimeError("full_test::scaled reads host state and must not be captured")
    out.copy_(x * _STATE["scale"][: x.shape[0]])


_scaled.register_fake(lambda x, out: None)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        out = torch.empty_like(h)
        torch.ops.full_test.scaled(h, out)
        return self.b(out).relu() + 1


@pytest.fixture(scope="module")
def toy():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Model().eval()
    compiled = torch.compile(
        model,
        backend="piecewise",
        options={
            "extra_splitting_ops": ["full_test::scaled"],
            "row_independent_ops": ["full_test::scaled"],
            "defer_captures": False,
            **INLINE,  # these count what each call replays or captures
        },
    )
    x = torch.randn(5, 4)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        compiled(x)  # compiles (piecewise call)
    return model, compiled


def _call(compiled, x, mode="full"):
    torch._dynamo.mark_dynamic(x, 0)
    with piecewise_backend.cudagraph_mode(mode):
        return compiled(x)


def _graph(compiled_model):
    return piecewise_backend.compiled_graphs()[-1]


def test_a_full_replay_reads_metadata_written_after_its_capture(toy):
    model, compiled = toy
    x = torch.randn(6, 4)
    _STATE["scale"].fill_(1.0)
    first = _call(compiled, x)  # captures the full graph of 8 (6 padded)
    torch.testing.assert_close(first, model(x))
    graph = _graph(compiled)
    replays = graph.stats.full_replays
    _STATE["scale"].copy_(torch.arange(32.0).view(32, 1))  # new metadata, same address
    again = _call(compiled, x)
    assert graph.stats.full_replays == replays + 1 and (8,) in graph.stats.full_keys
    torch.testing.assert_close(again, model(x))
    assert not torch.allclose(again, first)
    _STATE["scale"].fill_(1.0)


def test_full_outputs_are_safe_from_the_next_replay(toy):
    model, compiled = toy
    x1, x2 = torch.randn(8, 4), torch.randn(8, 4)
    out1 = _call(compiled, x1)
    kept = out1.clone()
    _call(compiled, x2)
    assert torch.equal(out1, kept)
    torch.testing.assert_close(out1, model(x1))


def test_a_full_capture_that_fails_warns_naming_the_op_and_that_size_runs_piecewise(toy):
    model, compiled = toy
    graph = _graph(compiled)
    x = torch.randn(2, 4)
    _FRAGILE["refuse"] = True
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = _call(compiled, x)  # size 2: its first full call captures, and the capture fails
            again = _call(compiled, x)
    finally:
        _FRAGILE["refuse"] = False
    torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(again, model(x))
    messages = [str(w.message) for w in caught if "full capture" in str(w.message)]
    assert len(messages) == 1, messages
    assert "shape key (2,)" in messages[0] and "full_test::scaled" in messages[0] and "runs piecewise" in messages[0]
    assert graph.stats.full_fallbacks["its capture failed"] >= 1
    assert (2,) not in graph.stats.full_keys


def test_cudagraph_mode_none_runs_un_graphed_and_a_wrong_mode_is_refused(toy):
    model, compiled = toy
    graph = _graph(compiled)
    before = graph.stats.misses[Miss.MODE_NONE]
    x = torch.randn(4, 4)
    torch.testing.assert_close(_call(compiled, x, "none"), model(x))
    assert graph.stats.misses[Miss.MODE_NONE] == before + 1
    with pytest.raises(ValueError, match="use one of 'piecewise', 'full', 'none'"):
        with piecewise_backend.cudagraph_mode("whole"):
            pass


def test_piecewise_and_full_graphs_of_one_size_are_kept_apart(toy):
    model, compiled = toy
    graph = _graph(compiled)
    x = torch.randn(16, 4)
    full_before, piecewise_before = graph.stats.full_replays, graph.stats.piecewise_replays
    for mode in ("full", "piecewise", "full", "piecewise"):
        torch.testing.assert_close(_call(compiled, x, mode), model(x))
    assert graph.stats.full_replays == full_before + 2
    assert graph.stats.piecewise_replays == piecewise_before + 2
    assert (16,) in graph.stats.full_keys and (16,) in graph.captured
