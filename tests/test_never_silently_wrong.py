"""The backend matches eager or says why it does not graph something: the classes of silent bugs.

Each test is named for a behaviour and failed before its fix (on CPU, with CUDA graphs emulated):
padding where rows meet rows, padding past a cache's rows, outputs that are views of inputs, and
batch norm in train mode (parameters that move: ``test_moved_inputs.py``). The differential
fuzzer in ``tests/fuzz`` checks the same rules on random models.
"""

import copy

import pytest
import torch

import piecewise_backend
from piecewise_backend.kinds import Miss
from toys.models import ToyConfig, ToyLlama

from .helpers import INLINE, assert_results_close, busiest_graph, compile_with_reference, decode_at_sizes, last_serial

pytestmark = pytest.mark.usefixtures("emulated_graphs")
SIZES = [2, 4, 8]


def _run_at_sizes(net, sizes, options=None, width=16):
    """Compile ``net``, call it at each batch size (marked dynamic), each output checked against
    eager; returns the graph that served the calls."""
    torch._dynamo.reset()
    start = last_serial()
    compiled = torch.compile(net, backend="piecewise", options={"capture_sizes": SIZES, **(options or {})})
    g = torch.Generator().manual_seed(0)
    for size in sizes:
        x = torch.randn(size, width, generator=g)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), net(x), atol=1e-5, rtol=1e-5, msg=lambda m: f"batch {size}: {m}")
        piecewise_backend.wait_for_captures()  # the sizes each call met, captured before the next call
    graph = busiest_graph(start)
    return graph


# -- 1. padding only where rows are proven independent ------------------------------------------


class HandWrittenAttention(torch.nn.Module):
    """Attention over the leading dim, written by hand: every row attends to every other row."""

    def __init__(self, width=16):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(width, width) for _ in range(3))

    def forward(self, x):
        scores = (self.q(x) @ self.k(x).T).exp()
        return (scores / scores.sum(-1, keepdim=True)) @ self.v(x)


class BatchStatistics(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.norm = torch.nn.BatchNorm1d(width, track_running_stats=False)

    def forward(self, x):
        return self.norm(self.lin(x)) * 2


def test_hand_written_attention_over_the_batch_is_never_padded():
    graph = _run_at_sizes(HandWrittenAttention().eval(), (3, 5, 5, 4))
    assert "rows meet rows" in graph.stats.padding and "matmul" in graph.stats.padding
    # each size is captured as it is: a batch of 3 is not left un-graphed for not being a capture size
    assert graph.captured == {(3,), (4,), (5,)} and graph.stats.replays == 1, graph.stats.summary()
    assert graph.stats.misses[Miss.NOT_A_CAPTURE_SIZE] == 0


def test_padding_false_keeps_to_the_capture_sizes():
    """``padding=False`` is the user's own choice (vLLM's): sizes outside capture_sizes run un-graphed."""
    graph = _run_at_sizes(HandWrittenAttention().eval(), (3, 4), {"padding": False})
    assert graph.captured == {(4,)} and graph.stats.misses[Miss.NOT_A_CAPTURE_SIZE] == 1


def test_batch_norm_with_batch_statistics_is_never_padded():
    graph = _run_at_sizes(BatchStatistics().eval(), (3, 5, 4))
    assert "batch statistics" in graph.stats.padding
    assert graph.captured == {(3,), (4,), (5,)}  # each size as it is, never padded


class UnknownOp(torch.nn.Module):
    """An op the proof does not know (a user's custom op) refuses padding, whatever it does."""

    def forward(self, x):
        return torch.ops.fuzzlib.row_scale(x) + 1


torch.library.define("fuzzlib::row_scale", "(Tensor x) -> Tensor")
torch.library.impl("fuzzlib::row_scale", "CompositeExplicitAutograd")(lambda x: x * 2)
torch.library.register_fake("fuzzlib::row_scale")(lambda x: torch.empty_like(x))


def test_an_op_not_known_to_keep_rows_apart_refuses_padding_and_says_which():
    graph = _run_at_sizes(UnknownOp(), (3, 4))
    assert "fuzzlib::row_scale" in graph.stats.padding and "cannot see into" in graph.stats.padding
    assert "row_independent_ops': ['fuzzlib::row_scale']" in graph.stats.summary()  # and how to declare it
    assert graph.captured == {(3,), (4,)}


def test_a_custom_op_declared_row_independent_is_padded_across():
    graph = _run_at_sizes(UnknownOp(), (3, 4), {"row_independent_ops": ["fuzzlib::row_scale"]})
    assert "padded up to the next capture size" in graph.stats.padding
    assert graph.captured == {(4,)}


def test_row_wise_models_are_still_padded():
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 16), torch.nn.Softmax(-1)
    ).eval()
    graph = _run_at_sizes(net, (3, 5, 7))
    assert "padded up to the next capture size" in graph.stats.padding
    assert graph.captured == {(4,), (8,)}


class IndexTensorWrite(torch.nn.Module):
    """``z[where] = v`` through an index tensor that is not batched: along a feature dim every row
    writes its own row (transformers' sliding-window cache: ``new_keys[:, :, index] = k``); along
    the batch dim, or through two index tensors, rows may move."""

    def __init__(self, where: str, width=16):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.where = where
        self.register_buffer("idx", torch.tensor([1, 0]))

    def forward(self, x):
        z = self.lin(x).view(x.shape[0], 4, 4).clone()
        if self.where == "features":
            z[:, self.idx] = z[:, :2] * 2
        elif self.where == "rows":
            z[self.idx] = 0.5
        else:  # two index tensors
            z[:, self.idx, self.idx] = z[:, 0, :2] * 2
        return z.flatten(1) + 1


def test_a_row_local_index_tensor_write_is_padded():
    graph = _run_at_sizes(IndexTensorWrite("features").eval(), (3, 5, 4))
    assert "padded up to the next capture size" in graph.stats.padding, graph.stats.padding
    assert graph.captured == {(4,), (8,)}


@pytest.mark.parametrize("where", ["rows", "two"])
def test_an_index_tensor_write_that_may_move_rows_is_never_padded(where):
    graph = _run_at_sizes(IndexTensorWrite(where).eval(), (3, 4))
    assert "writes through an index tensor" in graph.stats.padding, graph.stats.padding
    assert graph.captured == {(3,), (4,)} and graph.stats.misses[Miss.NOT_A_CAPTURE_SIZE] == 0


# -- 2. padding never reaches past the rows of a cache read or written by batch row ----------------


@pytest.mark.parametrize("options", [{}, {"graph_attention": False}], ids=["graph-attention", "eager-attention"])
def test_padding_stops_at_the_rows_of_a_kv_cache(options):
    # a cache of 6 rows: a batch of 5 must not replay the graph of 8 (rows 6, 7 are not there)
    compiled, reference, start = compile_with_reference(
        ToyLlama, ToyConfig(layers=2, max_batch=6), {"capture_sizes": SIZES, **options}
    )
    results = decode_at_sizes(compiled, reference, (3, 5, 6, 2))
    assert_results_close(results)
    graph = busiest_graph(start)
    assert "fits in 6 rows" in graph.stats.padding, graph.stats.padding
    # 3 pads to 4; 5 and 6 run at their exact size (8 would pass the 6 rows); 2 rides 4 (within 2x)
    assert graph.captured == {(4,), (5,), (6,)}
    for mine, theirs in zip(compiled._orig_mod.layers, reference.layers):
        torch.testing.assert_close(mine.attn.k_cache, theirs.attn.k_cache)
        torch.testing.assert_close(mine.attn.v_cache, theirs.attn.v_cache)


def test_up_front_capture_skips_sizes_past_the_cache_rows():
    compiled, reference, start = compile_with_reference(
        ToyLlama, ToyConfig(layers=2, max_batch=6), {"capture_sizes": SIZES, "eager_capture_sizes": "all"}
    )
    with pytest.warns(UserWarning, match="eager_capture_sizes above 6 are not captured") as said:
        assert_results_close(decode_at_sizes(compiled, reference, (3, 2)))
    assert all("eager_capture_sizes above 6" in str(w.message) for w in said)  # once per graph (prefill, decode)
    graph = busiest_graph(start)
    assert graph.captured == {(2,), (4,)}  # 8 would reach past the 6-row caches
    with pytest.raises(ValueError, match="tensors of 6 rows by batch row.*\\[8\\]"):
        graph.capture([8])


# -- 3. a size that changes at every call is not captured at every call ---------------------------


class MatmulAttention(torch.nn.Module):
    """Attention written as matmuls over keys that grow every call (transformers'
    ``attn_implementation="eager"``): the KV length is inside the compute piece."""

    def __init__(self, width=16):
        super().__init__()
        self.q = torch.nn.Linear(width, width)

    def forward(self, x, keys):
        scores = (self.q(x) @ keys.transpose(1, 2)).softmax(-1)
        return scores @ keys


def test_a_kv_length_in_a_compute_piece_stops_capturing_and_says_why(recwarn):
    torch._dynamo.reset()
    start = last_serial()
    net = MatmulAttention().eval()
    options = {"capture_sizes": SIZES, "max_unreplayed_captures": 4, **INLINE}  # counts what each call captured
    compiled = torch.compile(net, backend="piecewise", options=options)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, 16, generator=g)
    torch._dynamo.mark_dynamic(x, 0)  # the batch pads; the KV length is exact: a shape key per length
    lengths = list(range(3, 12)) + [5, 6]  # a KV length per call, then two seen before
    for length in lengths:
        keys = torch.randn(2, length, 16, generator=g)
        torch._dynamo.mark_dynamic(keys, 0)
        torch._dynamo.mark_dynamic(keys, 1)
        torch.testing.assert_close(compiled(x, keys), net(x, keys), msg=lambda m: f"length {length}: {m}")
    graph = busiest_graph(start)
    assert len(graph.captured) == 4  # then no more: each new length would be a graph used once
    assert graph.stats.misses[Miss.NEVER_REPLAYED] == len(set(lengths)) - len(graph.captured)
    assert graph.stats.replays > 0  # 5 and 6 came back and replayed their graphs
    warned = [str(w.message) for w in recwarn if "never replayed" in str(w.message)]
    assert len(warned) == 1 and 'attn_implementation="sdpa"' in warned[0], warned
    assert "never replayed" in graph.stats.summary()


# -- 4. an output that is a view of an input stays one ---------------------------------------------


class ReturnsViews(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x), x[:, :4], self.lin.weight.T


def test_an_output_that_views_an_input_stays_a_view_of_it():
    torch._dynamo.reset()
    start = last_serial()
    net = ReturnsViews().eval()
    compiled = torch.compile(net, backend="piecewise", options={"capture_sizes": SIZES})
    for size in (3, 4, 4):
        x = torch.randn(size, 16)
        torch._dynamo.mark_dynamic(x, 0)
        y, head, weight_t = compiled(x)
        torch.testing.assert_close(y, net.lin(x))
        head.fill_(7.0)  # writes through the view reach the caller's tensor, as in eager
        assert bool((x[:, :4] == 7).all())
        assert weight_t.data_ptr() == net.lin.weight.data_ptr()
        piecewise_backend.wait_for_captures()  # (captured behind the call: in before the next, on a busy host too)
    graph = busiest_graph(start)
    assert graph.stats.replays > 0  # the linear is still graphed
    reasons = [r for p in graph.pieces for r in p.eager_reasons]
    assert any("that is returned" in r for r in reasons), reasons


# -- 5. batch norm in train mode under no_grad ----------------------------------------------------


def test_batch_norm_in_train_mode_compiles_and_updates_running_stats_as_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16)).train()
    reference = copy.deepcopy(net)
    compiled = torch.compile(net, backend="piecewise", options={"capture_sizes": SIZES})
    for size in (3, 5, 5, 4):
        x = torch.randn(size, 16)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), reference(x), atol=1e-5, rtol=1e-5)
    for name, buffer in reference[1].named_buffers():
        torch.testing.assert_close(getattr(net[1], name), buffer, msg=lambda m: f"{name}: {m}")


def test_batch_norm_in_train_mode_full_mode_compiles():
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16)).train()
    reference = copy.deepcopy(net)
    compiled = torch.compile(net, backend="piecewise", options={"capture_sizes": SIZES, "mode": "full"})
    for size in (3, 4, 4):
        x = torch.randn(size, 16)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), reference(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(net[1].running_var, reference[1].running_var)


class Accumulates(torch.nn.Module):
    """A buffer scaled in place every call (full mode captures the write: not idempotent)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("acc", torch.ones(4, 8))

    def forward(self, x):
        self.acc.mul_(0.5)
        return self.lin(x) + self.acc[: x.shape[0]]


def test_a_compiled_piece_that_raises_after_writing_is_undone_before_its_traced_code_runs():
    """Compiled code that scaled the buffer and then raised: the traced code runs instead, on the
    buffer as it was before (scaled once per call, as eager does), with a warning naming the error."""
    torch._dynamo.reset()
    start = last_serial()
    net = Accumulates().eval()
    reference = copy.deepcopy(net)
    compiled = torch.compile(
        net, backend="piecewise", options={"mode": "full", "compiler": "eager", "cudagraphs": False}
    )
    x = torch.randn(3, 8)
    torch.testing.assert_close(compiled(x), reference(x))
    runner = next(r for r in busiest_graph(start).runners.values() if r.piece.restore_after_warmup)
    traced = runner.eager_fn

    def writes_then_raises(*args):
        traced(*args)  # the write happens ...
        raise RuntimeError("injected: compiled code broke after its write")  # ... then the code fails

    runner.fn = writes_then_raises
    with pytest.warns(UserWarning, match="compiled code raised RuntimeError: injected"):
        torch.testing.assert_close(compiled(x), reference(x))
    torch.testing.assert_close(net.acc, reference.acc)  # 0.25 everywhere: twice scaled, not three times
    torch.testing.assert_close(compiled(x), reference(x))  # and the traced code from now on
    torch.testing.assert_close(net.acc, reference.acc)


def test_an_assertion_the_compiled_code_raises_is_not_taken_for_inductors_stride_check():
    """Only Inductor's input check is answered by re-laying the inputs out; any other
    AssertionError of the compiled code goes to the fallback (the traced code), once, loudly."""
    torch._dynamo.reset()
    start = last_serial()
    net = torch.nn.Linear(8, 8).eval()
    compiled = torch.compile(net, backend="piecewise", options={"compiler": "eager", "cudagraphs": False})
    x = torch.randn(3, 8)
    compiled(x)
    runner = next(iter(busiest_graph(start).runners.values()))
    relaid = []
    runner._expected_layout = lambda args: relaid.append(args)  # what the stride path would call

    def asserts(*args):
        raise AssertionError("the code's own check")

    runner.fn = asserts
    with pytest.warns(UserWarning, match="compiled code raised AssertionError: the code's own check"):
        torch.testing.assert_close(compiled(x), net(x))
    assert relaid == []
