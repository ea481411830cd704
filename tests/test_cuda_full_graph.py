"""On a GPU: full graphs chosen per call. The serving engine's decode steps as one CUDA graph each
(fp32 tokens equal the eager engine's), a replay that reads metadata written after its capture, outputs
safe from the next replay, and an op that syncs with the host failing a full capture: a warning that
names it, the call right, that size piecewise from then on."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import piecewise_backend
from piecewise_backend.kinds import Miss
from toys import engine as toy

from .helpers import INLINE, graphed_but_behind, graphs_since, last_serial

pytestmark = pytest.mark.cuda
SMALL = dataclasses.replace(toy.TINY, hidden=128, heads=4, kv_heads=2, layers=3)
GROUPED = dataclasses.replace(toy.TINY, hidden=768, heads=6, kv_heads=1, layers=2, intermediate=256)  # 6:1, dim 128


def _serve(model, forward, graph_mode):
    engine = toy.Engine(
        model, forward, max_num_tokens=48, max_num_seqs=6, num_blocks=96, device="cuda", graph_mode=graph_mode
    )
    return [r.output for r in engine.run(toy.seeded_trace(16, seed=3, vocab=model.cfg.vocab))], engine


@pytest.mark.parametrize("cfg", [SMALL, GROUPED], ids=["small", "grouped-6-dim128"])
def test_the_engine_with_full_decode_graphs_gives_the_eager_engines_tokens(cfg):
    """fp32: the paged decode kernel's tokens are the host path's (SDPA per request), eager and in
    full graphs, for two head layouts (Qwen2.5's 6:1 grouping at its head dim among them)."""
    torch._dynamo.reset()
    start = last_serial()
    torch.manual_seed(0)
    model = toy.EngineModel(cfg).init_weights_().cuda().eval()
    expected, _ = _serve(model, None, "full_and_piecewise")
    host_path, _ = _serve(model, None, "piecewise")
    assert expected == host_path  # the paged decode kernel agrees with the varlen path
    compiled = torch.compile(
        model,
        backend="piecewise",
        options={"extra_splitting_ops": [toy.ATTENTION], "row_independent_ops": [toy.ATTENTION]},
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(capture at shape key|full capture)")  # none may fail
        got, engine = _serve(model, compiled, "full_and_piecewise")
    assert got == expected
    graphs = graphs_since(start)
    assert sum(g.stats.full_replays for g in graphs) > 0 and sum(g.stats.piecewise_replays for g in graphs) > 0
    assert all(
        set(g.stats.full_fallbacks) <= {Miss.CAPTURING_BEHIND} and graphed_but_behind(g.stats) for g in graphs
    ), [g.stats.summary() for g in graphs]
    padded = [s.num_tokens for s in engine.steps if s.num_prefill_tokens == 0 and s.num_tokens in (3, 5, 6)]
    assert padded, "the trace has decode batches that pad"


_STATE: dict = {}


@torch.library.custom_op("full_cuda_test::scaled", mutates_args=("out",))
def _scaled(x: torch.Tensor, out: torch.Tensor) -> None:
    if _STATE.get("sync"):
        float(x.sum())  # a host sync: fails inside a capture
    out.copy_(x * _STATE["scale"][: x.shape[0]])


_scaled.register_fake(lambda x, out: None)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        out = torch.empty_like(h)
        torch.ops.full_cuda_test.scaled(h, out)
        return self.b(out).relu() + 1


def _call(compiled, x, mode="full"):
    torch._dynamo.mark_dynamic(x, 0)
    with piecewise_backend.cudagraph_mode(mode):
        return compiled(x)


def test_full_graphs_read_new_metadata_keep_outputs_and_fall_back_on_a_host_sync():
    torch._dynamo.reset()
    torch.manual_seed(0)
    _STATE.update(scale=torch.ones(64, 1, device="cuda"), sync=False)
    model = _Model().cuda().eval()
    compiled = torch.compile(
        model,
        backend="piecewise",
        options={
            "extra_splitting_ops": ["full_cuda_test::scaled"],
            "row_independent_ops": ["full_cuda_test::scaled"],
            "defer_captures": False,
            **INLINE,  # counts what each call replays or captures, and toggles the op's sync around one
        },
    )
    x, y = torch.randn(6, 16, device="cuda"), torch.randn(6, 16, device="cuda")
    _call(compiled, x, "piecewise")  # compiles
    graph = piecewise_backend.compiled_graphs()[-1]
    first = _call(compiled, x)  # captures the full graph of 8, padded
    torch.testing.assert_close(first, model(x))
    _STATE["scale"].copy_(torch.arange(64.0, device="cuda").view(64, 1))  # new metadata, same address
    second = _call(compiled, y)
    torch.testing.assert_close(second, model(y))  # the replay read the new scale
    _STATE["scale"].fill_(1.0)
    torch.testing.assert_close(first, model(x))  # the first output survived the second replay
    assert graph.stats.full_replays == 2 and graph.stats.full_keys == [(8,)]
    _STATE["sync"] = True
    z = torch.randn(20, 16, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _call(compiled, z)  # size 24: the full capture fails on the sync
        again = _call(compiled, z)  # then runs piecewise
    _STATE["sync"] = False
    torch.testing.assert_close(out, model(z))
    torch.testing.assert_close(again, model(z))
    messages = [str(w.message) for w in caught if "full capture" in str(w.message)]
    assert len(messages) == 1 and "full_cuda_test::scaled" in messages[0] and "(24,)" in messages[0], messages
    assert graph.stats.full_fallbacks["its capture failed"] == 1 and graph.stats.full_keys == [(8,)]
    x2 = torch.randn(3, 16, device="cuda")
    torch.testing.assert_close(_call(compiled, x2), model(x2))  # captures still work after the failure
    assert (4,) in graph.stats.full_keys
