"""Where the graph splits, and what runs eagerly — checked on the Dynamo graphs of the toy models."""

import pytest
import torch

from piecewise_backend.split.splitting import COMPUTE, EAGER, SPLIT
from toys.models import ToyConfig, ToyCustomAttentionLlama, ToyGPT, ToyLlama, init_weights_

from .helpers import split_only

CFG = ToyConfig(layers=3)


def _llama_calls():
    return [(torch.randint(0, 128, (2, 5)), 0), (torch.randint(0, 128, (2, 1)), 5), (torch.randint(0, 128, (2, 1)), 6)]


def test_llama_decode_graph_splits_at_each_attention():
    model = init_weights_(ToyLlama(CFG)).eval()
    splits, outs = split_only(model, _llama_calls())
    decode = splits[-1]  # dynamic in the position
    assert len(decode.step_symbols) == 1
    kinds = [p.kind for p in decode.pieces]
    # prologue (RoPE rows at pos), then compute / attention alternating, compute last
    assert kinds == [EAGER] + [COMPUTE, SPLIT] * CFG.layers + [COMPUTE]
    for p in decode.pieces:
        if p.kind == SPLIT:
            assert p.split_ops == ("aten::scaled_dot_product_attention",)
            # the cache writes and cache slices moved in with the attention op
            assert sum("writes graph input" in r for r in p.eager_reasons) == 2
            assert sum("per-step scalar" in r for r in p.eager_reasons) == 2
    assert all("per-step scalar" in r for r in decode.pieces[0].eager_reasons)


def test_split_graph_runs_like_the_model():
    model = init_weights_(ToyLlama(CFG)).eval()
    calls = _llama_calls()
    _, outs = split_only(model, calls)
    model_ref = init_weights_(ToyLlama(CFG)).eval()
    for (ids, pos), out in zip(calls, outs):
        torch.testing.assert_close(out, model_ref(ids, pos))


def test_prefill_graph_without_step_scalar_has_no_eager_prologue():
    model = init_weights_(ToyLlama(CFG)).eval()
    splits, _ = split_only(model, _llama_calls()[:1])
    assert [p.kind for p in splits[0].pieces] == [COMPUTE, SPLIT] * CFG.layers + [COMPUTE]


def test_gpt_caches_passed_as_arguments_are_written_eagerly():
    model = init_weights_(ToyGPT(CFG)).eval()
    caches = model.new_caches()
    calls = [
        (torch.randint(0, 128, (1, 4)), caches, 0),
        (torch.randint(0, 128, (1, 1)), caches, 4),
        (torch.randint(0, 128, (1, 1)), caches, 5),
    ]
    splits, _ = split_only(model, calls)
    decode = splits[-1]
    assert [p.kind for p in decode.pieces] == [EAGER] + [COMPUTE, SPLIT] * CFG.layers + [COMPUTE]
    assert any("arange" in r for r in decode.pieces[0].eager_reasons)


def test_custom_attention_op_is_split_when_named():
    model = init_weights_(ToyCustomAttentionLlama(CFG)).eval()
    splits, _ = split_only(model, _llama_calls(), options={"extra_splitting_ops": ["toyattn::attention"]})
    for split in splits:
        ops = [p.split_ops for p in split.pieces if p.kind == SPLIT]
        assert ops == [("toyattn::attention",)] * CFG.layers


def test_custom_attention_unnamed_is_not_a_split_op():
    model = init_weights_(ToyCustomAttentionLlama(CFG)).eval()
    splits, _ = split_only(model, _llama_calls()[:1])
    assert all(not p.split_ops for p in splits[0].pieces)
    # the cache writes still run eagerly: they write module buffers
    assert any(p.kind == EAGER for p in splits[0].pieces)


def test_graph_without_split_op_is_one_compute_piece():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    splits, _ = split_only(model, [(torch.randn(3, 8),)])
    assert [p.kind for p in splits[0].pieces] == [COMPUTE]


class CountsSteps(torch.nn.Module):
    """Per layer, a Python int that only the caller reads back (transformers' sliding-window cache
    returns ``cumulative_length_int + 1`` from every layer this way)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, t):
        counts = []
        for i, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            counts.append(t + i + 1)
        return x, counts


def test_python_ints_only_returned_do_not_cut_the_compute():
    model = CountsSteps().eval()
    calls = [(torch.randn(2, 8), t) for t in (3, 4, 5)]
    splits, outs = split_only(model, calls)
    decode = splits[-1]  # dynamic in t
    assert len(decode.step_symbols) == 1
    # the int arithmetic runs first, in one eager prologue; the layers are one compute piece
    assert [p.kind for p in decode.pieces] == [EAGER, COMPUTE]
    assert all("per-step scalar" in r for r in decode.pieces[0].eager_reasons)
    for (x, t), (y, counts) in zip(calls, outs):
        want_y, want_counts = model(x, t)
        torch.testing.assert_close(y, want_y)
        assert list(counts) == want_counts


@pytest.mark.parametrize("unread", ["storage_offset", "size"])
def test_cutting_a_piece_at_attention_lifts_an_input_symbol_no_node_holds(unread):
    """A piece's input whose storage offset (or size) is a symbol the piece no longer receives (the
    split drops scalar inputs no node reads): cut layer by layer, the chain takes that symbol as an
    input of its own, read from the tensor. On the H200 (transformers 5.17, a sliding-window cache
    view) ``split_module`` raised ``KeyError: s86``; a ``sym_size`` node instead made a cycle."""
    from piecewise_backend.compiling import layer_chain
    from piecewise_backend.compiling.piece_compiler import structural_key

    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layers(x, w):
        h = x
        for _ in range(6):
            q = (h @ w).unsqueeze(0)
            h = torch.nn.functional.scaled_dot_product_attention(q, q, q).squeeze(0).relu() + h
        return h

    base, w = torch.randn(64, 8), torch.randn(8, 8)
    compiled = torch.compile(layers, backend=grab, dynamic=True)
    compiled(base[1:9], w)
    compiled(base[3:11], w)  # a new offset: Dynamo recompiles with the offset a symbol
    gm = graphs[-1]
    x = next(n for n in gm.graph.nodes if n.name == "l_x_").meta["example_value"]
    dropped = str(x.storage_offset() if unread == "storage_offset" else x.shape[0])
    for node in [n for n in gm.graph.nodes if n.op == "placeholder" and str(n.meta["example_value"]) == dropped]:
        gm.graph.erase_node(node)  # what the split leaves a piece that does not read the symbol
    gm.recompile()
    cut = layer_chain.split_at_attention(
        gm, frozenset({"aten::scaled_dot_product_attention"}), lambda sub: structural_key(sub, None)
    )
    assert cut is not None
    chain, compute, readers = cut
    assert len(compute) == 7 and [what for _, what, _ in readers] == [unread]
    real = {"l_x_": base[5:13], "l_w_": w}  # a third offset
    rest = 8 if unread == "storage_offset" else base[5:13].storage_offset()  # the symbol left: a size, or the offset
    args = [real.get(n.name, rest) for n in gm.graph.nodes if n.op == "placeholder"]
    torch.testing.assert_close(layer_chain.install(chain, {}, readers)(*args)[0], layers(base[5:13], w))


class UnreadMask(torch.nn.Module):
    """Builds a mask sized by a Python int that nothing reads (transformers 5.17 builds the full-attention
    mask of a Gemma 3 whose layers all slide), and ands a boolean input with a computed mask."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, mask, keep, past: int):
        unread = ((torch.arange(past + 1) <= past) & mask.bool()).expand(x.shape[0], -1)  # noqa: F841
        h = self.lin(x)
        return h * (keep & (h > 0))


def _submodule_nodes(split):
    return [n for _, m in split.graph_module.named_children() for n in m.graph.nodes]


def test_values_nothing_reads_do_not_reach_a_compute_piece_and_a_logical_and_is_not_a_write():
    """Before: Dynamo left the unread mask in the graph, so the compute piece took the growing input
    and the int as inputs (a new shape key per decode step, no replay); and ``keep & m`` counted as
    an in-place write of ``keep`` (``operator.and_`` ends in an underscore), which ran it eagerly."""
    model = UnreadMask().eval()
    x, keep = torch.randn(2, 8), torch.rand(2, 8) > 0.3
    calls = [(x, torch.ones(1, past + 1, dtype=torch.long), keep, past) for past in (4, 5, 6)]
    splits, outs = split_only(model, calls)
    decode = splits[-1]
    assert [p.kind for p in decode.pieces] == [COMPUTE], [(p.kind, p.eager_reasons) for p in decode.pieces]
    placeholders = [n.name for n in _submodule_nodes(decode) if n.op == "placeholder"]
    assert not any("mask" in name for name in placeholders), placeholders
    assert not any(n.op == "call_method" and n.target == "expand" for n in _submodule_nodes(decode))
    for args, out in zip(calls, outs):
        torch.testing.assert_close(out, model(*args))


class ViewsBetweenAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, q, k, v):
        a = torch.nn.functional.scaled_dot_product_attention(self.lin(q), k, v)
        return torch.nn.functional.scaled_dot_product_attention(a.transpose(1, 2).transpose(1, 2), k, v)


def test_a_piece_of_views_only_runs_as_it_is_and_is_never_captured():
    """Captured, a piece without a kernel is an empty CUDA graph (torch warns "The CUDA Graph is
    empty"); it replays nothing."""
    from piecewise_backend.split.splitting import NO_DEVICE_WORK

    model = ViewsBetweenAttention().eval()
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    splits, outs = split_only(model, [(q, k, v)])
    pieces = splits[0].pieces
    assert [p.kind for p in pieces] == [COMPUTE, SPLIT, EAGER, SPLIT]
    assert set(pieces[2].eager_reasons) == {NO_DEVICE_WORK}
    torch.testing.assert_close(outs[0], model(q, k, v))


def test_a_custom_op_called_through_its_packet_writes_its_out_and_is_never_dropped():
    """torch 2.11's Dynamo records ``torch.ops.ns.name(...)`` as the op's overload packet (2.13: the
    overload). The write to ``out`` went unseen there, and the op, whose result nothing reads, was
    dropped as dead: ``out`` was never written and the model's outputs were garbage."""
    from piecewise_backend.fx import graph_facts
    from piecewise_backend.split import graph_cleanup

    from .test_live_server import _attn  # noqa: F401  (registers live_server::attn, which writes out)

    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    out = graph.call_function(torch.empty_like, (q,))
    attn = graph.call_function(torch.ops.live_server.attn, (q, q, q, out))
    dead = graph.call_function(torch.ops.aten.mul.Tensor, (q, q))  # read by nothing, writes nothing
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (out, q)))
    assert graph_facts.mutated_inputs(attn) == [out]
    graph_cleanup.drop_dead_values(graph)
    assert attn in graph.nodes and dead not in graph.nodes
