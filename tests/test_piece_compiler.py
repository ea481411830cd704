"""Pieces with the same code are compiled once and run on fake values once (``piece_compiler.py``):
the others take fresh copies of the first one's fake outputs, and its random-number verdict."""

import collections

import pytest
import torch
import torch.nn.functional as F

from piecewise_backend.compiling import piece_compiler
from toys.models import ToyConfig, ToyLlama, init_weights_

from .helpers import graphs_since, last_serial


def _compile_counting_fake_runs(model, monkeypatch, *inputs):
    """``model`` compiled and called once on ``inputs``; its graph, and how often each module ran on fakes."""
    runs, names = collections.Counter(), {}
    real, real_compile = piece_compiler.run_on_fakes, piece_compiler.PieceCompiler.compile

    def counted(gm, fake_args, fake_mode):
        runs[names.get(id(gm), id(gm))] += 1
        return real(gm, fake_args, fake_mode)

    def named(self, name, gm, *args, **kwargs):
        names[id(gm)] = name
        return real_compile(self, name, gm, *args, **kwargs)

    monkeypatch.setattr(piece_compiler, "run_on_fakes", counted)
    monkeypatch.setattr(piece_compiler.PieceCompiler, "compile", named)
    torch._dynamo.reset()
    start = last_serial()
    compiled = torch.compile(model, backend="piecewise")
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
    (graph,) = graphs_since(start)
    return graph, runs


def test_only_the_first_piece_of_each_code_runs_on_fakes_and_the_rest_match_eager(monkeypatch):
    model = init_weights_(ToyLlama(ToyConfig(layers=4))).eval()
    ids = torch.randint(0, ToyConfig().vocab, (2, 5))
    graph, runs = _compile_counting_fake_runs(model, monkeypatch, ids, 0)
    program = graph.plan.program.module
    compiled_as = graph.plan.report.compiled_as
    firsts = {name for name, first in compiled_as.items() if first == name}
    assert len(firsts) < len(compiled_as), "the middle layers' pieces share code"
    for name in compiled_as:
        assert runs[name] == (name in firsts), (name, sorted(firsts))
    # the eager pieces (attention) run as before (the program keeps them): their outputs are the next pieces' inputs
    eager = [s.name for s in graph.pieces if s.name not in compiled_as]
    assert eager and all(runs[id(getattr(program, name))] == 1 for name in eager)


class NoisyLayers(torch.nn.Module):
    """Identical layers between attention calls, each drawing random numbers it then multiplies by 0."""

    def __init__(self, layers: int = 3, width: int = 16):
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for lin in self.lins:
            h = lin(x) + 0 * torch.randn_like(x)
            q = h.view(x.shape[0], 2, 4, 8).transpose(1, 2)
            x = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(x.shape) + x
        return x


def test_a_piece_sharing_code_with_one_that_draws_random_numbers_draws_them_too(monkeypatch):
    torch.manual_seed(0)
    graph, runs = _compile_counting_fake_runs(NoisyLayers().eval(), monkeypatch, torch.randn(3, 4, 16))
    compiled_as = graph.plan.report.compiled_as
    shared = [name for name, first in compiled_as.items() if first != name]
    assert shared and not any(runs[name] for name in shared)
    for name in compiled_as:
        calls_randn = any(n.target is torch.randn_like for n in graph.plan.program.piece(name).graph.nodes)
        assert graph.plan.pieces[name].draws_random is calls_randn, name


@pytest.fixture
def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        yield mode


def test_fresh_copies_stand_in_for_outputs_outside_the_inputs_storages(fake_mode):
    suffice = piece_compiler._fresh_outputs_suffice
    x = torch.empty(4, 8)
    a, b = torch.empty(4, 8), torch.empty(8)
    assert suffice(a, [x]) and suffice((a, b, None, 3), [x])
    assert suffice((a, a.view(32)[8:]), [x]), "outputs sharing a storage (q, k, v of one projection)"
    assert suffice(a[1:], [x]), "an output at a constant offset"
    assert not suffice(x.view(8, 4), [x]), "a view of an input: another piece's would be of its own input"
    assert not suffice((a, a.view(torch.int32)), [x]), "one storage read as two dtypes"
    assert not suffice(torch.return_types.max((a, b)), [x]), "a named tuple is not rebuilt"
    count = torch.empty(
        (), dtype=torch.int64
    ).item()  # a symbol made inside the piece: another piece would make another
    assert not suffice(torch.empty(count), [x])


def test_fresh_copies_of_outputs_sharing_a_storage_share_a_fresh_one(fake_mode):
    base = torch.empty(4, 24)
    q, k = base[:, :8], base[:, 8:16]
    fresh_q, fresh_k = piece_compiler._fresh_like((q, k))
    storage = fresh_q.untyped_storage()._cdata
    assert storage == fresh_k.untyped_storage()._cdata != base.untyped_storage()._cdata
    assert fresh_k.storage_offset() == k.storage_offset() == 8
    assert fresh_k.stride() == k.stride() and fresh_k.untyped_storage().nbytes() == base.untyped_storage().nbytes()


def test_fresh_copies_keep_the_metadata_and_nothing_else(fake_mode):
    a = torch.empty_strided((4, 8), (1, 4))
    out = piece_compiler._fresh_like((a, None, 2))
    assert type(out) is tuple and out[1:] == (None, 2)
    assert out[0].shape == a.shape and out[0].stride() == a.stride() and out[0].dtype == a.dtype
    assert out[0].untyped_storage()._cdata != a.untyped_storage()._cdata
