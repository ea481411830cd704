"""Decoders in idioms the project did not write its toys in (``toys/idioms.py``), against eager.

:class:`WholeCacheLlama`: caches sized to the batch, ``copy_`` writes, attention over every row of
the cache, RoPE gathered by ``arange(t, t + S)``. The decode rewrite takes all three into the graphs
(``rewrite/kv_writes.py``, ``graph_attention.py``, ``step_ranges.py``): a decode step is one graph.
With ``graph_attention=False`` its attention runs eagerly between the graphs, and
``eager_sdpa_backends="auto"`` keeps cuDNN attention off there (the KV length changes every step).
"""

import copy

import pytest
import torch
from torch import nn

import piecewise_backend
from piecewise_backend.kinds import PieceKind
from toys.idioms import WholeCacheLlama
from toys.models import ToyConfig, init_weights_

from .helpers import busiest_graph, graphed_but_behind, last_serial, program_nodes

CFG = ToyConfig(layers=2, max_batch=4, max_seq=32)


def _decode(model, compiled, batch: int, prompt: int, steps: int, device: str):
    """Prefill then greedy steps through ``compiled`` and through an eager twin of ``model``; the
    logits of both, and the twin (whose caches must equal ``model``'s)."""
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.set_batch(batch)
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, CFG.vocab, (batch, prompt), generator=g).to(device)
    pairs, t = [], 0
    with torch.no_grad():
        for _ in range(steps + 1):
            pairs.append((compiled(ids, t).clone(), reference(ids, t).clone()))
            piecewise_backend.wait_for_captures()  # what the step handed to the capture thread, in before the next
            t += ids.shape[1]
            ids = pairs[-1][1][:, -1:].argmax(-1)
            torch._dynamo.maybe_mark_dynamic(ids, 0)  # as a server does; the caches pin it to their rows
    return pairs, reference


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("graph_attention", [True, False])
def test_whole_cache_llama_matches_eager(device, graph_attention, emulated_graphs):
    torch._dynamo.reset()
    start = last_serial()
    model = init_weights_(WholeCacheLlama(CFG)).to(device).eval()
    compiled = torch.compile(model, backend="piecewise", options={"graph_attention": graph_attention})
    pairs, reference = _decode(model, compiled, batch=3, prompt=5, steps=6, device=device)
    for a, e in pairs:
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
    for (name, mine), (_, theirs) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    graph = busiest_graph(start)
    assert graph.stats.replays > 0 and graphed_but_behind(graph.stats), graph.stats.summary()
    kinds = [p.kind for p in graph.pieces]
    if graph_attention:  # writes, attention and positions all in the graph: one piece
        assert kinds == [PieceKind.COMPUTE], graph.stats.summary()
    else:
        assert kinds.count(PieceKind.SPLIT) == CFG.layers and "cuDNN attention off" in graph.stats.eager_sdpa
    _assert_writes_unmasked(graph)


def _assert_writes_unmasked(graph):
    """Caches of fixed sizes (no dynamic batch): the KV writes put the new values as they are, no
    mask and no gather of the old ones (one kernel per write instead of two on a GPU), and nothing
    may run the graph with its writes turned off."""
    nodes = program_nodes(graph)
    puts = [n for n in nodes if n.target == "index_put_"]
    assert len(puts) == 2 * CFG.layers, [n.format_node() for n in puts]
    assert not [n for n in nodes if n.target is torch.where], "a masked write in a graph of fixed sizes"
    assert not any(n.args[2].target is torch.where for n in puts)
    with pytest.raises(RuntimeError, match="unmasked.*fixed sizes.*lazily"):
        with graph.step_scalars.writes_disabled():
            pass


class BroadcastingWrite(nn.Module):
    """``copy_`` into a view longer than the value broadcasts it: not a write the rewrite knows."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.register_buffer("cache", torch.zeros(2, 1, 16, 8))

    def forward(self, x, t: int):
        k = self.proj(x).unsqueeze(1)  # [2, 1, 1, 8]
        self.cache[:, :, t : t + 2].copy_(k)
        return self.proj(
            torch.nn.functional.scaled_dot_product_attention(k, self.cache[:, :, : t + 1], self.cache[:, :, : t + 1])
        )


def test_a_broadcasting_copy_stays_eager_and_matches(emulated_graphs):
    torch._dynamo.reset()
    start = last_serial()
    model = BroadcastingWrite().eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="piecewise")
    with torch.no_grad():
        for t in range(5):
            x = torch.randn(2, 1, 8, generator=torch.Generator().manual_seed(t))
            torch.testing.assert_close(compiled(x, t), reference(x, t))
    torch.testing.assert_close(model.cache, reference.cache)
    graph = busiest_graph(start)
    assert any("writes graph input" in why for p in graph.pieces for why in p.eager_reasons), graph.stats.summary()
