"""Eager cache prefix views taken with one ``as_strided`` (prefix_views.py), on CPU, emulated graphs.

The attention pieces' ``cache[:B, :, :pos + 1]`` becomes ``as_strided`` with the same view; a stop
past the cache is clamped as indexing clamps it; views that something other than attention reads
stay indexing.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from piecewise_backend.split.splitting import COMPUTE
from toys.models import ToyConfig, ToyLlama, ToyStaticCacheLlama

from .helpers import (
    SPLIT_ATTENTION,
    assert_results_close,
    busiest_graph,
    compile_with_reference,
    decode_at_sizes,
    last_serial,
)

CFG = ToyConfig(layers=2, max_batch=8, max_seq=32)
LENGTH = 6  # PeekPastTheEnd's cache positions
pytestmark = pytest.mark.usefixtures("emulated_graphs")


def _eager_code(start) -> str:
    graph = busiest_graph(start)
    gm = graph.plan.program.module
    return "\n".join(gm._modules[p.name].code for p in graph.pieces if p.kind != COMPUTE)


def test_attention_reads_its_cache_prefix_through_as_strided():
    compiled, reference, start = compile_with_reference(ToyLlama, CFG, {**SPLIT_ATTENTION, "capture_sizes": [2, 4, 8]})
    with torch.no_grad():
        assert_results_close(decode_at_sizes(compiled, reference, (3, 2, 5, 8)))
    code = _eager_code(start)
    assert code.count("torch.as_strided(") == 2 * CFG.layers, code
    assert "slice(" not in code, code  # no indexing left in the attention pieces


class PeekPastTheEnd(nn.Module):
    """Writes position ``pos`` and attends over ``[:pos + 2]``: at the cache's last position the
    view's stop is one past the end, which indexing clamps."""

    def __init__(self, rows=4, heads=2, length=LENGTH, dim=8):
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.register_buffer("cache", torch.zeros(rows, heads, length, dim))

    def forward(self, x, pos: int):
        k = self.proj(x)
        self.cache[: x.shape[0], :, pos : pos + 1] = k
        keys = self.cache[: x.shape[0], :, : pos + 2]
        return self.proj(F.scaled_dot_product_attention(k, keys, keys))


class ViewAlsoSummed(PeekPastTheEnd):
    def forward(self, x, pos: int):
        k = self.proj(x)
        self.cache[: x.shape[0], :, pos : pos + 1] = k
        keys = self.cache[: x.shape[0], :, : pos + 1]
        return self.proj(F.scaled_dot_product_attention(k, keys, keys)) + keys.sum()


def _compile_and_run(model_cls, positions):
    torch._dynamo.reset()
    start = last_serial()
    model, reference = model_cls(), model_cls()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="piecewise", options={**SPLIT_ATTENTION, "capture_sizes": [2, 4]})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pos in positions:
            x = torch.randn(2, 2, 1, 8, generator=g)
            torch.testing.assert_close(compiled(x, pos), reference(x, pos), msg=f"pos {pos}")
    return model, start


def test_a_stop_past_the_end_is_clamped_as_indexing_clamps_it():
    # Dynamo guards pos + 2 <= 6 in the graph it traced, so no call reaches the clamp: call the
    # rewritten attention piece itself with the last position, as a graph without that guard would
    model, start = _compile_and_run(PeekPastTheEnd, range(LENGTH))
    graph = busiest_graph(start)
    gm = graph.plan.program.module
    piece = next(
        gm._modules[p.name]
        for p in graph.pieces
        if p.kind != COMPUTE and "torch.as_strided(" in gm._modules[p.name].code
    )
    inputs = [n.name for n in piece.graph.nodes if n.op == "placeholder"]
    assert len(inputs) == 3, piece.code  # the position, the cache, the query
    k = torch.randn(2, 2, 1, 8)
    pos = LENGTH - 1
    args = {"pos": pos, "cache": model.cache, "k": k}
    with torch.no_grad():
        got = piece(*(next(v for key, v in args.items() if key in name) for name in inputs))
        want = F.scaled_dot_product_attention(k, model.cache[:2, :, : pos + 2], model.cache[:2, :, : pos + 2])
    torch.testing.assert_close(got, want)


def test_views_read_by_something_else_keep_indexing():
    _, start = _compile_and_run(ViewAlsoSummed, range(5))
    assert "torch.as_strided(" not in _eager_code(start)
    assert "slice(" in _eager_code(start)


def test_views_inside_compute_pieces_are_left_to_inductor():
    # full mode on the graph-safe twin: its SDPA reads k_cache[:B] (no per-step stop) in the one
    # compute piece, where a view costs nothing per step
    compiled, reference, start = compile_with_reference(
        ToyStaticCacheLlama, CFG, {"mode": "full", "capture_sizes": [2, 4, 8]}
    )
    with torch.no_grad():
        assert_results_close(decode_at_sizes(compiled, reference, (3, 2), static_cache=True))
    graph = busiest_graph(start)
    assert graph.stats.num_pieces == 1
    assert not any("as_strided" in m.code for m in graph.plan.program.module._modules.values())
