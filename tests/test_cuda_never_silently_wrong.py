"""The silent-bug classes with real CUDA graphs: padding stops at a cache's rows (past them a padded
replay indexed out of bounds: a device-side assert), and moved weights get graphs of their own
while the tensors captured before stay untouched."""

import warnings

import pytest
import torch

from toys.models import ToyConfig, ToyLlama, sdpa_backends

from .helpers import assert_results_close, busiest_graph, compile_with_reference, decode_at_sizes

pytestmark = pytest.mark.cuda
TOL = {"atol": 2e-3, "rtol": 2e-3}


@pytest.mark.parametrize("options", [{}, {"graph_attention": False}], ids=["graph-attention", "eager-attention"])
def test_padding_stops_at_the_rows_of_a_kv_cache_on_cuda(options):
    compiled, reference, start = compile_with_reference(
        ToyLlama, ToyConfig(layers=2, max_batch=6, max_seq=64), {"capture_sizes": [2, 4, 8], **options}, device="cuda"
    )
    with torch.no_grad(), sdpa_backends("cuda"):
        results = decode_at_sizes(compiled, reference, (3, 5, 6, 2, 5), device="cuda")
    torch.cuda.synchronize()
    assert_results_close(results, **TOL)
    graph = busiest_graph(start)
    # 3 -> 4; 5 and 6 exact (8 would pass the cache's 6 rows); 2 rides 4 (capture_deferral.py)
    assert graph.captured == {(4,), (5,), (6,)} and graph.stats.replays > 0
    for mine, theirs in zip(compiled._orig_mod.layers, reference.layers):
        torch.testing.assert_close(mine.attn.k_cache, theirs.attn.k_cache, **TOL)


def test_new_weights_get_new_graphs_and_the_old_tensors_stay_untouched_on_cuda():
    compiled, reference, start = compile_with_reference(
        ToyLlama, ToyConfig(layers=2, max_batch=8), {"capture_sizes": [2, 4, 8]}, device="cuda"
    )
    with torch.no_grad(), sdpa_backends("cuda"):
        results = decode_at_sizes(compiled, reference, (3, 4), device="cuda")
        old = [(p, p.detach().clone()) for p in compiled._orig_mod.parameters()]
        new = {k: torch.randn_like(v) * 0.1 for k, v in reference.named_parameters()}
        compiled._orig_mod.load_state_dict(new, assign=True, strict=False)
        reference.load_state_dict({k: v.clone() for k, v in new.items()}, assign=True, strict=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results += decode_at_sizes(compiled, reference, (3, 4, 3), device="cuda", start_pos=4)
    assert_results_close(results, **TOL)
    assert all(torch.equal(p, saved) for p, saved in old)
    graph = busiest_graph(start)
    assert graph.stats.weight_sets == 2 and graph.stats.replays > 0 and not graph.stats.failed_captures
