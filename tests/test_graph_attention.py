"""graph_attention: decode SDPA over a growing cache prefix becomes graph-safe, the step one graph.

On CPU with emulated graphs (``prefix_attention``'s CPU path is masked SDPA); the CUDA path, the
memory-efficient kernel in variable-length form, is checked here against SDPA (marked ``cuda``) and
on a whole model in test_cuda_capture.py.
"""

import pytest
import torch
import torch.nn.functional as F

from piecewise_backend.graph_attention import prefix_attention
from piecewise_backend.toy_models import ToyConfig, ToyLlama

from .helpers import assert_close_steps, assert_results_close, compile_with_reference, decode_at_sizes, \
    graphs_since, llama_decode

CFG = ToyConfig(layers=2, max_batch=8, max_seq=32)
OPTIONS = {"capture_sizes": [2, 4, 8], "graph_attention": True}
pytestmark = pytest.mark.usefixtures("emulated_graphs")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("length", [1, 7, 20])
def test_prefix_attention_is_attention_over_the_prefix(device, length):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 64, generator=g).to(device)
    k_cache, v_cache = torch.randn(2, 5, 4, 20, 64, generator=g).to(device).unbind(0)
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    got = prefix_attention(q, k_cache, v_cache, torch.tensor(length, device=device))
    want = F.scaled_dot_product_attention(q, k_cache[:3, :, :length], v_cache[:3, :, :length])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def one_graph_decode():
    compiled, reference, start = compile_with_reference(ToyLlama, CFG, OPTIONS)
    with torch.no_grad():
        results = decode_at_sizes(compiled, reference, (3, 2, 5, 8, 7, 4))
    return compiled, reference, start, results


def test_decode_step_is_one_graph_and_matches_eager(one_graph_decode):
    compiled, reference, start, results = one_graph_decode
    assert_results_close(results)
    graph = max(graphs_since(start), key=lambda g: g.stats.calls)
    # no attention piece, no eager RoPE prologue: the whole step is one compute piece
    assert graph.stats.num_pieces == 1 and graph.stats.num_compute_pieces == 1, graph.stats.summary()
    assert "padded" in graph.stats.padding and graph.captured == {(2,), (4,), (8,)}
    copies = sum(p.input_copies for p in graph.stats.pieces.values())
    assert copies == graph.stats.replays  # only the token ids are copied in, once per step
    for mine, theirs in zip(compiled._orig_mod.layers, reference.layers):
        torch.testing.assert_close(mine.attn.k_cache, theirs.attn.k_cache)


def test_prefill_attention_is_left_alone():
    compiled, reference, start = compile_with_reference(ToyLlama, CFG, OPTIONS)
    with torch.no_grad():
        got = llama_decode(compiled, compiled._orig_mod, batch=2, prompt=5, new_tokens=3)
        want = llama_decode(reference, reference, batch=2, prompt=5, new_tokens=3)
    assert_close_steps(got, want)
    prefill = graphs_since(start)[0]  # causal attention over 5 positions: split out and eager, as before
    assert prefill.stats.num_split_pieces == CFG.layers


def test_an_attention_length_past_the_buffer_is_refused(one_graph_decode):
    graph = max(graphs_since(one_graph_decode[2]), key=lambda g: g.stats.calls)
    scalars = graph.step_scalars
    length = next(s for s in scalars.slots if s.offset == 1)
    args = [None] * (1 + max(s.arg for s in scalars.slots))
    for slot in scalars.slots:
        args[slot.arg] = slot.low - slot.offset
    args[length.arg] = CFG.max_seq
    assert (length.low, length.high) == (1, CFG.max_seq)  # pos + 1 keys, within the cache
    with pytest.raises(IndexError, match=rf"needs 0 <= {length.name} <= 31; got {length.name} = 32.*outside"):
        scalars.refresh(tuple(args))  # the read of the RoPE row and the write at pos refuse first
