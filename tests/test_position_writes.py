"""KV-cache writes at a per-step position, moved into the captured compute pieces (rewrite/kv_writes.py).

On CPU with emulated graphs: the writes leave the eager pieces, the cache ends up exactly as eager
leaves it (padded rows written back unchanged), up-front capture writes nothing, an out-of-range
position fails before anything runs, and any write the rewrite does not understand stays eager.
"""

import warnings

import pytest
import torch

from piecewise_backend.rewrite import PLACEHOLDER
from piecewise_backend.split.splitting import COMPUTE
from toys.models import ToyConfig, ToyLlama, ToyStaticCacheLlama

from .helpers import (
    SPLIT_ATTENTION,
    assert_results_close,
    busiest_graph,
    compile_with_reference,
    decode_at_sizes,
    graphs_since,
    program_nodes,
)

CFG = ToyConfig(layers=2, max_batch=8, max_seq=32)
pytestmark = pytest.mark.usefixtures("emulated_graphs")


def _decode_graph(start):
    return busiest_graph(start)


def _caches(model):
    return [t.clone() for layer in model.layers for t in (layer.attn.k_cache, layer.attn.v_cache)]


def _assert_caches_equal(model, reference):
    for mine, theirs in zip(_caches(model), _caches(reference)):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def padded_decode():
    compiled, reference, start = compile_with_reference(ToyLlama, CFG, {"capture_sizes": [2, 4, 8]})
    with torch.no_grad():
        results = decode_at_sizes(compiled, reference, (3, 2, 5, 8, 7, 4))
    return compiled, reference, start, results


def test_writes_move_into_compute_pieces(padded_decode):
    graph = _decode_graph(padded_decode[2])
    assert graph.step_scalars is not None
    eager_reasons = [r for p in graph.pieces for r in p.eager_reasons]
    assert not any("writes graph input" in r for r in eager_reasons), eager_reasons
    written = {w for p in graph.pieces if p.kind == COMPUTE for w in p.writes_inputs}
    assert {w for w in written if "cache" in w} and len(written) == 2 * CFG.layers
    assert PLACEHOLDER in graph.plan.inputs.names


def test_every_layers_writes_share_one_set_of_index_tensors(padded_decode):
    """The rows and the mask every KV write addresses are built once for the graph, not per write:
    per write, they were four tiny kernels per layer on the H200 (``graph_edit.SharedNodes``)."""
    import operator

    graph = _decode_graph(padded_decode[2])
    nodes = program_nodes(graph)
    writes = [n for n in nodes if n.target == "index_put_"]
    masks = [n for n in nodes if n.target is operator.ne]
    assert len(writes) == 2 * CFG.layers  # the k and v caches, all of one shape
    assert len({n.args[1] for n in writes}) == 1 and len(masks) == 1, [n.args[1] for n in writes]
    assert graph.step_scalars.writes_masked  # a dynamic batch: padded and captured up front, so masked


def test_padded_decode_matches_eager_and_leaves_the_cache_as_eager_does(padded_decode):
    compiled, reference, start, results = padded_decode
    assert_results_close(results)
    _assert_caches_equal(compiled._orig_mod, reference)  # padded rows 5..7 of a batch of 5: untouched
    graph = _decode_graph(start)
    # 3 -> 4, 5 -> 8; 2 rides 4 (within 2x: capture_deferral.py), so its rows are padded too
    assert "padded" in graph.stats.padding and graph.captured == {(4,), (8,)}


def test_capture_up_front_writes_nothing(padded_decode):
    compiled, reference, start, _ = padded_decode
    graph = _decode_graph(start)
    graph.captured.discard((8,))
    for runner in graph.runners.values():
        runner.captures.pop((8,), None)
    before = _caches(compiled._orig_mod)
    with torch.no_grad():
        assert graph.capture([8]) == [(8,)]
    for old, new in zip(before, _caches(compiled._orig_mod)):
        assert torch.equal(old, new)


def test_a_position_past_the_buffer_is_refused_before_any_write(padded_decode):
    """Dynamo's guards catch this first (a new trace fails); the check is the net for when guards
    are skipped (``set_stance(skip_guard_eval_unsafe=True)``), where a device-side index error
    would otherwise take down the CUDA context."""
    scalars = _decode_graph(padded_decode[2]).step_scalars
    position = next(s for s in scalars.slots if s.high == CFG.max_seq - 1)
    args = [None] * (1 + max(s.arg for s in scalars.slots))
    for slot in scalars.slots:
        args[slot.arg] = slot.low
    args[position.arg] = CFG.max_seq
    before = scalars.tensor.clone()
    with pytest.raises(IndexError, match=rf"cache.*0 <= {position.name} <= 31; got {position.name} = 32.*larger"):
        scalars.refresh(tuple(args))
    assert torch.equal(before, scalars.tensor)


def test_off_keeps_the_writes_eager():
    compiled, reference, start = compile_with_reference(
        ToyLlama, CFG, {**SPLIT_ATTENTION, "capture_sizes": [2, 4], "capture_kv_writes": False}
    )
    with torch.no_grad():
        results = decode_at_sizes(compiled, reference, (3, 2))
    assert_results_close(results)
    graph = _decode_graph(start)
    assert graph.step_scalars is None
    assert any("writes graph input" in r for p in graph.pieces for r in p.eager_reasons)


class WrittenTwice(torch.nn.Module):
    """A buffer written at ``pos`` and also scaled in place: the rewrite must leave both eager."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("cache", torch.zeros(8, 32, 16))

    def forward(self, x, pos: int):
        B = x.shape[0]
        self.cache[:B, pos : pos + 1] = self.lin(x)
        self.cache.mul_(0.5)
        return self.lin(self.cache[:B, : pos + 1].sum(1, keepdim=True))


def test_a_buffer_with_another_write_stays_eager():
    torch._dynamo.reset()
    start = max((g.serial for g in graphs_since(0)), default=0)
    net, reference = WrittenTwice().eval(), WrittenTwice().eval()
    reference.load_state_dict(net.state_dict())
    compiled = torch.compile(net, backend="piecewise", options={"capture_sizes": [2, 4]})
    with torch.no_grad():
        for pos, size in enumerate((3, 3, 2, 4)):
            x = torch.randn(size, 1, 16)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x, pos), reference(x, pos))
    torch.testing.assert_close(net.cache, reference.cache)
    assert all(g.step_scalars is None for g in graphs_since(start))


def test_full_mode_index_copy_writes_are_masked_so_up_front_capture_is_safe():
    compiled, reference, start = compile_with_reference(
        ToyStaticCacheLlama, CFG, {"mode": "full", "capture_sizes": [2, 4, 8], "eager_capture_sizes": [8, 4]}
    )
    with torch.no_grad():
        assert_results_close(decode_at_sizes(compiled, reference, (3, 2, 5), static_cache=True))
    _assert_caches_equal(compiled._orig_mod, reference)  # up-front captures and padded rows wrote nothing
    graph = _decode_graph(start)
    assert graph.step_scalars is not None and graph.can_capture_up_front and "padded" in graph.stats.padding
    assert [e.how for e in graph.stats.events][:2] == ["up-front", "up-front"]


def test_full_mode_refuses_up_front_capture_for_writes_it_cannot_mask():
    torch._dynamo.reset()
    start = max((g.serial for g in graphs_since(0)), default=0)
    net, reference = WrittenTwice().eval(), WrittenTwice().eval()
    reference.load_state_dict(net.state_dict())
    compiled = torch.compile(
        net, backend="piecewise", options={"mode": "full", "capture_sizes": [2, 4], "eager_capture_sizes": [4]}
    )
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for pos, size in enumerate((2, 2, 4, 4)):
            x = torch.randn(size, 1, 16)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x, pos), reference(x, pos))
    assert any("eager_capture_sizes ignored" in str(w.message) for w in caught)
    graph = _decode_graph(start)
    assert not graph.can_capture_up_front and graph.unmasked_writes
    with pytest.raises(RuntimeError, match="cannot capture up front.*write garbage"):
        graph.capture([4])
