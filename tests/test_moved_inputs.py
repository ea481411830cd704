"""Parameters and buffers that get a new address after their graphs were captured.

Graphs read weights in place, so a weight replaced through ``.data`` (a checkpoint loaded by
assignment, a ``.to()`` round trip) would be replayed stale. The runners compare every weight's
address on each replay (all at once, see ``PieceRunner._index_statics``): a moved weight is copied
into the captured one, with one warning; a moved buffer that the graph *writes* (a KV cache) makes
that shape run un-graphed, with a warning, since the graph would write the old one. On CPU with
emulated graphs, against an eager copy treated the same way.
"""

import warnings

import pytest
import torch

from piecewise_backend.toy_models import ToyConfig, ToyLlama

from .helpers import assert_results_close, compile_with_reference, decode_at_sizes, graphs_since

CFG = ToyConfig(layers=2, max_batch=4, max_seq=32)
pytestmark = pytest.mark.usefixtures("emulated_graphs")


def _decode(compiled, reference, start_pos):
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = decode_at_sizes(compiled, reference, (2, 2), start_pos=start_pos)
    return results, [str(w.message) for w in caught if "piecewise" in str(w.message)]


def test_a_replaced_weight_is_copied_in_and_warned_once():
    compiled, reference, start = compile_with_reference(ToyLlama, CFG, {"capture_sizes": [2, 4]})
    results, _ = _decode(compiled, reference, 0)
    assert_results_close(results)
    new_weight = torch.randn_like(reference.layers[0].mlp.up.weight)
    for model in (compiled._orig_mod, reference):  # a new tensor, same shape: no recompile
        model.layers[0].mlp.up.weight.data = new_weight.clone()
    results, messages = _decode(compiled, reference, 4)
    assert_results_close(results)  # the replays use the new weight
    moved = [m for m in messages if "moved since its CUDA graph was captured" in m]
    assert len(moved) == 1, messages  # once, though every replay copies it
    graph = max(graphs_since(start), key=lambda g: g.stats.calls)
    assert graph.stats.replays > 0 and not graph.stats.failed_captures


def test_a_replaced_kv_cache_runs_that_shape_ungraphed():
    compiled, reference, start = compile_with_reference(ToyLlama, CFG, {"capture_sizes": [2, 4]})
    results, _ = _decode(compiled, reference, 0)
    assert_results_close(results)
    for model in (compiled._orig_mod, reference):
        model.layers[1].attn.k_cache.data = model.layers[1].attn.k_cache.clone()
    results, messages = _decode(compiled, reference, 4)
    assert_results_close(results)  # the new cache is the one written and read
    assert any("which the graph writes, moved since capture" in m for m in messages), messages
    graph = max(graphs_since(start), key=lambda g: g.stats.calls)
    failures = [f for piece in graph.stats.pieces.values() for f in piece.failures]
    assert any("moved since capture at shape key (2,)" in f for f in failures), failures
