"""On a GPU: captures per distinct batch size, replays, changed input addresses, surviving outputs."""

import warnings

import pytest
import torch

import piecewise_backend
from toys.models import ToyConfig, ToyLlama, init_weights_, sdpa_backends

from .helpers import INLINE, SPLIT_ATTENTION, assert_close_steps, graphs_since, last_serial, llama_decode

pytestmark = pytest.mark.cuda
CFG = ToyConfig(layers=3, max_batch=8)
BATCH_SEQUENCE = (2, 4, 2, 8, 4)  # revisits sizes: no new captures on the second visit


@pytest.fixture(scope="module")
def cuda_run():
    torch._dynamo.reset()
    start = last_serial()
    model = init_weights_(ToyLlama(CFG)).cuda().eval()
    # each size captured on first sight: these tests count captures per batch size
    compiled = torch.compile(model, backend="piecewise", options={**INLINE, "defer_captures": False})
    runs = []
    with torch.no_grad(), sdpa_backends("cuda"):
        for batch in BATCH_SEQUENCE:
            eager = llama_decode(model, model, batch, 5, 6, device="cuda")
            graphed = llama_decode(compiled, model, batch, 5, 6, device="cuda")
            runs.append((batch, eager, graphed))
    return model, compiled, runs, start


def test_graphed_decode_matches_eager_at_every_batch(cuda_run):
    for batch, eager, graphed in cuda_run[2]:
        assert_close_steps(graphed, eager, atol=2e-3, rtol=2e-3)


def _decode_graphs(start: int = 0):
    """Graphs dynamic in the position (Dynamo makes one static-batch graph first, then a dynamic one),
    made after graph serial ``start`` (an earlier test's graphs may live until the collector runs)."""
    graphs = [g for g in graphs_since(start) if g.plan.report.step_symbols and g.stats.captures]
    assert graphs, [g.stats.summary() for g in piecewise_backend.compiled_graphs()]
    return graphs


def test_captures_once_per_batch_size_not_per_step(cuda_run):
    graphs = _decode_graphs(cuda_run[3])
    for graph in graphs:
        keys = graph.stats.captured_keys
        # a key holds at most the batch size: the position never enters it
        assert all(len(k) <= 1 for k in keys), keys
        assert {k[0] for k in keys if k} <= set(BATCH_SEQUENCE)
        assert graph.stats.captures == len(keys) * graph.stats.num_compute_pieces
        for piece in graph.stats.pieces.values():
            assert len(piece.keys) == len(set(piece.keys)), "a key was captured twice"
        assert graph.stats.replays > graph.stats.captures  # decode steps replay
        # one key per distinct batch size the graph served (sizes 2, 4, 8 are capture sizes), or
        # the one key () of a graph Dynamo specialised to one batch size
        served = {(b,) for b in graph.stats.batch_sizes} if graph.pad_position is not None else {()}
        assert keys == served, (keys, graph.stats.batch_sizes)
    # 6 decode steps at each of 3 distinct sizes, in two graphs (Dynamo specialises the first
    # size): a handful of keys in all, not one per step
    assert sum(len(g.stats.captured_keys) for g in graphs) <= len(set(BATCH_SEQUENCE)) + 1


def test_new_input_tensors_are_copied_in(cuda_run):
    # every step's token ids are a fresh tensor (argmax output): copied into the captured buffer
    assert sum(p.input_copies for g in _decode_graphs(cuda_run[3]) for p in g.stats.pieces.values()) > 0


def test_returned_output_survives_next_call(cuda_run):
    model, compiled, _, _ = cuda_run
    ids = torch.randint(0, CFG.vocab, (2, 1), device="cuda")
    with torch.no_grad(), sdpa_backends("cuda"):
        first = compiled(ids, 10)
        kept = first.clone()
        second = compiled((ids + 1) % CFG.vocab, 11)  # ids + 1 alone may reach past the vocabulary
    assert first.data_ptr() != second.data_ptr()
    torch.testing.assert_close(first, kept)


def test_clone_outputs_false_aliases_the_pool():
    torch._dynamo.reset()
    model = init_weights_(ToyLlama(CFG)).cuda().eval()
    compiled = torch.compile(model, backend="piecewise", options={**INLINE, "clone_outputs": False})
    with torch.no_grad(), sdpa_backends("cuda"):
        llama_decode(compiled, model, 2, 5, 3, device="cuda")
        a = compiled(torch.randint(0, CFG.vocab, (2, 1), device="cuda"), 9)
        b = compiled(torch.randint(0, CFG.vocab, (2, 1), device="cuda"), 10)
    assert a.data_ptr() == b.data_ptr()  # documented: valid only until the next call


def test_cudagraphs_off_runs_ungraphed_with_same_results():
    torch._dynamo.reset()
    model = init_weights_(ToyLlama(CFG)).cuda().eval()
    compiled = torch.compile(model, backend="piecewise", options={**INLINE, "cudagraphs": False})
    with torch.no_grad(), sdpa_backends("cuda"):
        assert_close_steps(
            llama_decode(compiled, model, 2, 5, 4, device="cuda"),
            llama_decode(model, model, 2, 5, 4, device="cuda"),
            atol=2e-3,
            rtol=2e-3,
        )
    for g in piecewise_backend.compiled_graphs():
        assert g.stats.captures == 0 and g.stats.graphs_disabled_reason == "cudagraphs=False in options"


def test_sixteen_layers_capture_per_batch_size():
    torch._dynamo.reset()
    start = last_serial()
    cfg = ToyConfig(layers=16, hidden=64, max_batch=8)
    model = init_weights_(ToyLlama(cfg)).cuda().eval()
    compiled = torch.compile(model, backend="piecewise", options={**INLINE, **SPLIT_ATTENTION})
    with torch.no_grad(), sdpa_backends("cuda"):
        for batch in (2, 4, 8, 4):
            assert_close_steps(
                llama_decode(compiled, model, batch, 4, 5, device="cuda"),
                llama_decode(model, model, batch, 4, 5, device="cuda"),
                atol=2e-3,
                rtol=2e-3,
            )
    graphs = _decode_graphs(start)
    for graph in graphs:
        assert graph.stats.num_compute_pieces == 17
        assert graph.stats.inductor_compiles <= 3
        assert graph.stats.captures == 17 * len(graph.stats.captured_keys)
        assert not any(p.failures for p in graph.stats.pieces.values())
    assert sum(len(g.stats.captured_keys) for g in graphs) == 3  # batch sizes 2, 4, 8


def test_a_sixteen_layer_decode_step_is_one_graph_of_three_compiles():
    """The graph-safe decode step of 16 layers: one piece captured once per batch size, compiled
    layer by layer (first, middle, last: ``layer_chain.py``), and eager's logits."""
    torch._dynamo.reset()
    start = last_serial()
    model = init_weights_(ToyLlama(ToyConfig(layers=16, hidden=64, max_batch=8))).cuda().eval()
    compiled = torch.compile(model, backend="piecewise", options={**INLINE, "defer_captures": False})
    with torch.no_grad():
        for batch in (2, 4, 2):
            assert_close_steps(
                llama_decode(compiled, model, batch, 4, 5, device="cuda"),
                llama_decode(model, model, batch, 4, 5, device="cuda"),
                atol=2e-3,
                rtol=2e-3,
            )
    step = max(graphs_since(start), key=lambda g: g.stats.replays)
    assert step.stats.num_pieces == 1 and step.stats.inductor_compiles == 3, step.stats.summary()
    assert step.stats.captures == len(step.stats.captured_keys) and step.stats.replays > 0


@torch.library.custom_op("pwtest::host_sync_scale", mutates_args=())
def host_sync_scale(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.abs().max().item() > -1)  # .item() syncs with the host: not capturable


@host_sync_scale.register_fake
def _(x):
    return torch.empty_like(x)


def test_capture_failure_falls_back_loudly():
    torch._dynamo.reset()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.lin(host_sync_scale(self.lin(x)))

    net = Net().cuda().eval()
    compiled = torch.compile(net, backend="piecewise", options=INLINE)
    x = torch.randn(4, 16, device="cuda")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x)
        out2 = compiled(x)
    torch.testing.assert_close(out, net(x))
    torch.testing.assert_close(out2, net(x))
    assert any("capture at shape key" in str(w.message) for w in caught)
    graph = piecewise_backend.compiled_graphs()[-1]
    assert graph.stats.captures == 0 and graph.stats.ungraphed_runs >= 2
    assert any("failed" in f for p in graph.stats.pieces.values() for f in p.failures)

    # The failed capture left nothing behind: random ops work and a new model captures.
    torch.rand(8, device="cuda").sum().item()
    torch._dynamo.reset()
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()).cuda().eval()
    compiled_fresh = torch.compile(fresh, backend="piecewise", options=INLINE)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled_fresh(x), fresh(x))
    fresh_graph = piecewise_backend.compiled_graphs()[-1]
    assert fresh_graph.stats.captures == 1 and fresh_graph.stats.replays == 2, fresh_graph.stats.summary()
