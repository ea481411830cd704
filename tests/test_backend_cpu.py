"""End to end on CPU: compiled pieces run un-graphed and must equal eager, with few compiles."""

import pytest
import torch

import piecewise_backend
from toys.models import ToyConfig, ToyCustomAttentionLlama, ToyGPT, ToyLlama, init_weights_

from .helpers import assert_close_steps, graphs_since, last_serial, llama_decode

CFG = ToyConfig(layers=3)
BATCHES = (1, 3, 4)


@pytest.fixture(scope="module")
def llama_run():
    """One compiled ToyLlama driven at several batch sizes; the outputs of eager and compiled."""
    torch._dynamo.reset()
    start = last_serial()
    model = init_weights_(ToyLlama(CFG)).eval()
    compiled = torch.compile(model, backend="piecewise")
    with torch.no_grad():
        runs = {b: (llama_decode(model, model, b, 5, 3), llama_decode(compiled, model, b, 5, 3)) for b in BATCHES}
    return runs, graphs_since(start)


@pytest.mark.parametrize("batch", BATCHES)
def test_llama_matches_eager(llama_run, batch):
    eager, compiled = llama_run[0][batch]
    assert_close_steps(compiled, eager)


def test_llama_compiles_each_distinct_piece_once(llama_run):
    graphs = llama_run[1]
    assert graphs
    for g in graphs:
        # first, middle (shared by the other layers) and last piece; the prefill graph's pieces may
        # coincide further
        assert 1 <= g.stats.inductor_compiles <= 3, g.stats.summary()
        shared = list(g.plan.report.compiled_as.values())
        assert len(set(shared)) == g.stats.inductor_compiles


def test_cpu_runs_ungraphed_and_says_why(llama_run):
    for g in llama_run[1]:
        assert g.stats.captures == 0
        assert g.stats.ungraphed_runs > 0
        assert "need CUDA tensors; inputs are on cpu" in g.stats.graphs_disabled_reason


def test_a_cpu_input_of_a_cuda_graph_is_named_with_the_fix():
    """A CUDA model handing the graph a CPU tensor (transformers 5.17's sliding-window cache keeps a 0-dim
    CPU counter) is not graphed; the reason names the tensor (fake CUDA tensors: no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from piecewise_backend.config import PiecewiseConfig
    from piecewise_backend.plan.making import graphs_disabled_reason

    with FakeTensorMode():
        hidden, counter = torch.empty(2, 8, device="cuda"), torch.empty((), dtype=torch.int64)
    reason = graphs_disabled_reason(PiecewiseConfig.from_options({}), [hidden, counter], names=["x", "cumulative"])
    assert reason.startswith("graphs need CUDA tensors; inputs are on cpu, cuda (cumulative () on cpu)"), reason
    assert "keep them on the GPU, or pass Python ints" in reason
    assert graphs_disabled_reason(PiecewiseConfig.from_options({}), [hidden], names=["x"]) is None


def test_cpu_graphs_count_their_batch_sizes_and_claim_no_padding(llama_run):
    """Without graphs nothing is padded, so the summary does not say it is; the calls per batch size
    are still counted (they are what a user sizes capture_sizes by)."""
    dynamic = [g for g in llama_run[1] if g.pad_position is not None]
    assert dynamic, [g.stats.summary() for g in llama_run[1]]
    for g in dynamic:
        assert sum(g.stats.batch_sizes.values()) == g.stats.calls > 0, g.stats.batch_sizes
    for g in llama_run[1]:
        summary = g.stats.summary()
        assert "CUDA graphs off" in summary and "padding" not in summary, summary
        assert "padding" not in piecewise_backend.report(g).headline()


def test_capture_on_cpu_warns_with_each_graphs_reason(llama_run, monkeypatch):
    monkeypatch.setattr(piecewise_backend.registry, "compiled_graphs", lambda: llama_run[1])  # not other tests'
    with pytest.warns(
        UserWarning,
        match=r"captured nothing: no compiled graph can capture up front.*"
        r"graphs need CUDA tensors; inputs are on cpu",
    ):
        assert piecewise_backend.capture([1, 2]) == {}


def test_a_graph_dynamo_drops_is_freed_at_once():
    """No reference cycle holds a compiled graph: once Dynamo and the caller drop it, it goes, and with
    it (on a GPU) its CUDA graphs' memory, without waiting for a garbage collection."""
    import gc
    import weakref

    torch._dynamo.reset()
    model = init_weights_(ToyLlama(ToyConfig(layers=1))).eval()
    compiled = torch.compile(model, backend="piecewise")
    with torch.no_grad():
        compiled(torch.randint(0, 128, (2, 3)), 0)
    graph = weakref.ref(piecewise_backend.compiled_graphs()[-1])
    gc.disable()
    try:
        torch._dynamo.reset()
        del compiled
        assert graph() is None, gc.get_referrers(graph())
    finally:
        gc.enable()


def test_compile_count_is_independent_of_depth():
    counts = {}
    for layers in (2, 16):
        torch._dynamo.reset()
        model = init_weights_(ToyLlama(ToyConfig(layers=layers, hidden=32, intermediate=64))).eval()
        compiled = torch.compile(model, backend="piecewise")
        ids = torch.randint(0, 128, (2, 4))
        torch.testing.assert_close(compiled(ids, 0), model(ids, 0), atol=1e-4, rtol=1e-4)
        (graph,) = piecewise_backend.compiled_graphs()[-1:]
        assert graph.stats.num_compute_pieces == layers + 1
        counts[layers] = graph.stats.inductor_compiles
    assert counts[16] == counts[2] <= 3


def test_gpt_with_caches_as_arguments_matches_eager():
    torch._dynamo.reset()
    model = init_weights_(ToyGPT(CFG)).eval()
    compiled = torch.compile(model, backend="piecewise")
    caches_e, caches_c = model.new_caches(), model.new_caches()
    for batch, (pos, seq) in zip((2, 2, 2, 3), ((0, 4), (4, 1), (5, 1), (0, 3))):
        ids = torch.randint(0, 128, (batch, seq))
        torch.testing.assert_close(compiled(ids, caches_c, pos), model(ids, caches_e, pos), atol=1e-4, rtol=1e-4)
    for (ke, ve), (kc, vc) in zip(caches_e, caches_c):  # the caches the graph wrote are the user's
        torch.testing.assert_close(kc, ke, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vc, ve, atol=1e-5, rtol=1e-5)


def test_custom_attention_op_split_and_matches_eager():
    torch._dynamo.reset()
    model = init_weights_(ToyCustomAttentionLlama(CFG)).eval()
    compiled = torch.compile(model, backend="piecewise", options={"extra_splitting_ops": ["toyattn::attention"]})
    assert_close_steps(llama_decode(compiled, model, 2, 5, 3), llama_decode(model, model, 2, 5, 3))
    graph = piecewise_backend.compiled_graphs()[-1]
    assert [p.split_ops for p in graph.pieces if p.split_ops] == [("toyattn::attention",)] * CFG.layers


def test_backend_callable_works_without_the_registry_name():
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    compiled = torch.compile(model, backend=piecewise_backend.piecewise)
    x = torch.randn(5, 8)
    torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compile_workers_are_warmed_for_gpu_graphs_only(device, monkeypatch):
    """Inductor's compile-worker pool starts when a GPU graph reaches the backend (as Inductor's own
    backend does), so the first pieces' Triton kernels need not compile one at a time."""
    from piecewise_backend import _torch_internals

    calls = []
    monkeypatch.setattr(_torch_internals, "warm_compile_workers", lambda: calls.append(1))
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).to(device)
    x = torch.randn(4, 8, device=device)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="piecewise")(x), model(x))
    assert len(calls) == (1 if device == "cuda" else 0)
