"""Decoders in idioms the project did not write its toys in (``toys/idioms.py``), against eager.

:class:`WholeCacheLlama`: caches sized to the batch, ``copy_`` writes, attention over the whole
batch of the cache, RoPE gathered by a position tensor. Its decode attention is not one the graph
path recognises yet, so it runs eagerly between the graphs: with the KV length changing every step,
``eager_sdpa_backends="auto"`` keeps cuDNN attention off there.
"""

import copy

import pytest
import torch

from piecewise_backend.kinds import PieceKind
from toys.idioms import WholeCacheLlama
from toys.models import ToyConfig, init_weights_

from .helpers import busiest_graph, last_serial

CFG = ToyConfig(layers=2, max_batch=4, max_seq=32)


def _decode(model, compiled, batch: int, prompt: int, steps: int, device: str):
    """Prefill then greedy steps through ``compiled`` and through ``model``'s eager twin."""
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.set_batch(batch)
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, CFG.vocab, (batch, prompt), generator=g).to(device)
    pairs, t = [], 0
    with torch.no_grad():
        for _ in range(steps + 1):
            pairs.append((compiled(ids, t).clone(), reference(ids, t).clone()))
            t += ids.shape[1]
            ids = pairs[-1][1][:, -1:].argmax(-1)
    return pairs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_whole_cache_llama_matches_eager_with_its_attention_eager(device, emulated_graphs):
    torch._dynamo.reset()
    start = last_serial()
    model = init_weights_(WholeCacheLlama(CFG)).to(device).eval()
    compiled = torch.compile(model, backend="piecewise")
    for a, e in _decode(model, compiled, batch=3, prompt=5, steps=6, device=device):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
    graph = busiest_graph(start)
    assert [p.kind for p in graph.pieces].count(PieceKind.SPLIT) == CFG.layers, graph.stats.summary()
    assert "cuDNN attention off" in graph.stats.eager_sdpa
    assert graph.stats.replays > 0, graph.stats.summary()
