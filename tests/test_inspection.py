"""The inspection API on CPU: the split as a table and a picture, the pieces' code, a depyf dump."""

import os

import pytest
import torch

import piecewise_backend
from toys.models import ToyConfig, ToyCustomAttentionLlama, ToyLlama, init_weights_

CFG = ToyConfig(layers=3)


@pytest.fixture(scope="module")
def llama_report():
    torch._dynamo.reset()
    model = init_weights_(ToyLlama(CFG)).eval()
    (report,) = piecewise_backend.inspect_split(model, torch.randint(0, CFG.vocab, (2, 5)), 0)
    return report


def test_pieces_in_order_with_kinds_and_ops(llama_report):
    assert [p.kind for p in llama_report.pieces] == ["compute", "split"] * CFG.layers + ["compute"]
    assert all(p.num_ops > 0 for p in llama_report.pieces)
    assert [p.label for p in llama_report.pieces if p.kind == "split"] == ["scaled_dot_product_attention"] * 3
    # the cache write and the KV slices run eagerly next to attention, with the reason
    assert any("writes graph input" in why for p in llama_report.pieces for why in p.why_eager)


def test_shapes_carry_symbols_and_dtypes(llama_report):
    first = llama_report.piece(0)
    assert any(s.startswith("i64[") for s in first.inputs)  # token ids
    assert "f32[" in first.output


def test_shared_inductor_compiles_are_reported(llama_report):
    groups = llama_report.inductor_compiles
    assert sum(len(v) for v in groups.values()) == CFG.layers + 1
    assert len(groups) == llama_report.graph.stats.inductor_compiles
    assert llama_report.piece("submod_0").compiled_as == "submod_0"


def test_code_of_a_piece_and_what_inductor_made_of_it(llama_report):
    piece = llama_report.piece(2)
    assert piece.kind == "compute" and "def forward" in piece.code
    assert piece.inductor_code and "def call(" in piece.inductor_code
    assert llama_report.piece(1).inductor_code is None  # attention runs eagerly


def test_table_text_and_html(llama_report):
    text = str(llama_report)
    assert text.startswith(f"graph {llama_report.serial}: 7 pieces (4 compute, 3 split/eager)")
    assert "CUDA graphs off: graphs need CUDA tensors" in text
    html = llama_report._repr_html_()
    assert html.count("<tr") == 1 + len(llama_report.pieces) and "submod_3" in html


def test_png_is_written(llama_report, tmp_path):
    pytest.importorskip("matplotlib")
    path = llama_report.save_png(tmp_path / "split.png")
    assert os.path.getsize(path) > 5000


def test_report_of_the_last_compiled_graph_and_unknown_piece(llama_report):
    assert piecewise_backend.report().serial == llama_report.serial
    with pytest.raises(KeyError, match="no piece 'submod_99'"):
        llama_report.piece("submod_99")


def test_graphed_and_captured_columns_with_emulated_graphs():
    torch._dynamo.reset()
    with piecewise_backend.emulated_graphs():
        model = init_weights_(ToyCustomAttentionLlama(CFG)).eval()
        ids = torch.randint(0, CFG.vocab, (4, 1))
        torch._dynamo.mark_dynamic(ids, 0)
        (report,) = piecewise_backend.inspect_split(
            model, ids, 0, options={"extra_splitting_ops": ["toyattn::attention"], "capture_sizes": [2, 4]}
        )
    compute = [p for p in report.pieces if p.kind == "compute"]
    assert all(p.graphed and p.captured == ((4,),) for p in compute)
    assert [p.label for p in report.pieces if p.kind == "split"] == ["attention"] * CFG.layers


def test_depyf_dump_holds_the_split_graph_and_every_piece(tmp_path):
    pytest.importorskip("depyf")
    torch._dynamo.reset()
    model = init_weights_(ToyLlama(ToyConfig(layers=2))).eval()
    compiled = torch.compile(model, backend="piecewise")
    with piecewise_backend.debug_dump(str(tmp_path)), torch.no_grad():
        compiled(torch.randint(0, 128, (2, 4)), 0)
    files = os.listdir(tmp_path)
    assert any("piecewise_split_graph" in f for f in files), files
    assert any("piecewise_input_graph" in f for f in files), files
    for name in ("submod_0_compute", "submod_1_split", "submod_2_compute", "submod_3_split", "submod_4_compute"):
        assert any(f"piecewise_{name}" in f for f in files), (name, files)
    assert any("kernel" in f for f in files)  # Inductor's code
    assert any(f.startswith("__transformed_code") for f in files)  # Dynamo's bytecode


def test_the_readmes_inspection_snippet_as_ordered_fills_the_dump(tmp_path):
    """README: ``debug_dump`` around ``inspect_split`` (before, inspect_split came first and the dump
    after it was empty); then the report prints, and its figure has a box per piece."""
    pytest.importorskip("depyf")
    torch._dynamo.reset()
    model = init_weights_(ToyLlama(ToyConfig(layers=1))).eval()
    with piecewise_backend.debug_dump(str(tmp_path)):
        report = piecewise_backend.inspect_split(model, torch.randint(0, 128, (2, 4)), 0)[-1]
    assert any("piecewise_split_graph" in f for f in os.listdir(tmp_path))
    assert "submod_0" in str(report)


def test_a_figure_without_matplotlib_says_how_to_get_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    torch._dynamo.reset()
    report = piecewise_backend.inspect_split(
        init_weights_(ToyLlama(ToyConfig(layers=1))).eval(), torch.randint(0, 128, (2, 4)), 0
    )[-1]
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match="need matplotlib: pip install matplotlib"):
        report.save_png("x.png")


def test_depyf_dump_after_inspect_split_says_it_wrote_nothing(tmp_path):
    """inspect_split compiled the model; the same call in a debug_dump block reuses that compile, so
    depyf gets none of our graphs: the block says so instead of leaving an empty folder unexplained."""
    pytest.importorskip("depyf")
    torch._dynamo.reset()
    model = init_weights_(ToyLlama(ToyConfig(layers=1))).eval()
    ids = torch.randint(0, 128, (2, 4))
    piecewise_backend.inspect_split(model, ids, 0)
    with pytest.warns(UserWarning, match=r"nothing was compiled inside the block.*torch._dynamo.reset\(\)"):
        with piecewise_backend.debug_dump(str(tmp_path)), torch.no_grad():
            torch.compile(model, backend="piecewise")(ids, 0)
    assert not any("piecewise_split_graph" in f for f in os.listdir(tmp_path))


@pytest.mark.parametrize(
    "options,emulate,expected",
    [
        ({}, True, {"graph: the graph-safe decode kernel"}),
        ({"graph_attention": False}, True, {"eager: graph_attention=False in options"}),
        ({}, False, {"eager: graphs need CUDA tensors; inputs are on cpu"}),
    ],
)
def test_report_says_how_each_attention_runs_and_why_not_in_the_graph(options, emulate, expected):
    from .helpers import busiest_graph, compile_with_reference, decode_at_sizes, graphs_since

    with piecewise_backend.emulated_graphs(emulate):
        compiled, reference, start = compile_with_reference(ToyLlama, CFG, options)
        with torch.no_grad():
            compiled(torch.randint(0, CFG.vocab, (2, 5)), 0)  # a prefill: its attention has 5 query positions
            decode_at_sizes(compiled, reference, (2, 3), start_pos=5)
    report = piecewise_backend.report(busiest_graph(start))
    assert {row["runs"] for row in report.attention} == expected and len(report.attention) == CFG.layers
    how = expected.pop()
    said = "eager" if emulate is False else how  # graphs off: the headline gives the reason, once
    assert f"attention: {CFG.layers} × {said}\n" in str(report) + "\n" and how.removeprefix("eager: ") in str(report)
    prefill = piecewise_backend.report(graphs_since(start)[0])  # the first graph compiled
    if emulate and not options:
        assert {r["runs"] for r in prefill.attention} == {"eager: its query has 5 positions, not one (a prefill)"}


class _ScaledDecode(torch.nn.Module):
    """Decode attention over a cache prefix, passing ``scale``: not what the graph-safe kernel takes."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout
        self.proj = torch.nn.Linear(8, 8, bias=False)
        self.register_buffer("k_cache", torch.zeros(4, 2, 16, 4))

    def forward(self, x, t: int):
        B = x.shape[0]
        q = self.proj(x).view(B, 1, 2, 4).transpose(1, 2)
        self.k_cache[:B, :, t : t + 1] = q
        keys = self.k_cache[:B, :, : t + 1]
        return torch.nn.functional.scaled_dot_product_attention(
            q, keys, keys, dropout_p=self.dropout, is_causal=True
        ).sum(1)


@pytest.mark.parametrize("dropout, named", [(0.0, "is_causal"), (0.5, "dropout_p, is_causal")])
def test_report_names_the_arguments_that_keep_attention_eager(dropout, named):
    """``dropout_p=0.0`` (what transformers passes in eval) is no argument: only a real dropout is named."""
    from .helpers import busiest_graph, last_serial

    torch._dynamo.reset()
    start = last_serial()
    with piecewise_backend.emulated_graphs():
        compiled = torch.compile(_ScaledDecode(dropout).eval(), backend="piecewise")
        with torch.no_grad():
            for t in range(3):
                compiled(torch.randn(2, 1, 8), t)
    (row,) = piecewise_backend.report(busiest_graph(start)).attention
    assert row["runs"] == (
        f"eager: it passes {named} (the graph-safe kernel takes q, k, v, attn_mask, scale and enable_gqa alone)"
    ), row


def test_the_report_names_a_missing_piece_and_never_cuts_a_reason(llama_report):
    with pytest.raises(IndexError, match=r"no piece 99: graph \d+ has 7 pieces, 0 to 6"):
        llama_report.piece(99)
    with pytest.raises(KeyError, match="no piece 'submod_99'"):
        llama_report.piece("submod_99")
    text = str(llama_report)
    for row in llama_report.rows():
        assert str(row["what"]) in text  # whole, however long
    assert "CUDA graphs: " not in text and "cpu.;" not in text
