"""Small helpers shared by the tests."""

from __future__ import annotations

import torch

import piecewise_backend
from piecewise_backend.config import PiecewiseConfig
from piecewise_backend.split.splitting import split_graph
from toys.models import decode_loop, reset_caches

# Options for tests of the split path: decode attention stays an eager piece between the graphs.
# Those tests count pieces, copies and the attention pieces' code; they pin ``graph_attention``
# off so that they keep testing that path whatever the default is (``graph_attention`` makes the
# decode step one graph).
SPLIT_ATTENTION = {"graph_attention": False}
# Options for tests of what a capture does, not of when it is made: the call that meets a size
# captures it (``capture_behind=False``), so what one call leaves is known when it returns. The
# default, captures behind the calls, is tested in ``test_capture_behind.py`` and wherever a test
# waits for the capture thread (``piecewise_backend.wait_for_captures()``).
INLINE = {"capture_behind": False}


def compile_with_reference(model_cls, cfg, options, device="cpu"):
    """A fresh Dynamo, a toy model compiled with the piecewise backend, and an identical eager copy.

    Returns (compiled, reference, serial of the last graph before this compile).
    """
    import copy

    from toys.models import init_weights_

    torch._dynamo.reset()
    start = last_serial()
    model = init_weights_(model_cls(cfg)).to(device).eval()
    reference = copy.deepcopy(model)
    return torch.compile(model, backend="piecewise", options=options), reference, start


def split_only(model, calls, options=None):
    """Run ``model`` under torch.compile with a backend that only splits (no Inductor).

    Returns the SplitGraph of every graph Dynamo captured and the outputs of each call.
    """
    cfg = PiecewiseConfig.from_options(options)
    splits = []

    def backend(gm, example_inputs):
        split = split_graph(gm, cfg.all_splitting_ops)
        splits.append(split)
        return split.graph_module

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    outs = [compiled(*args) for args in calls]
    return splits, outs


def llama_decode(step, model, batch: int, prompt: int, new_tokens: int, device="cpu", seed=0):
    """Prefill ``prompt`` random tokens at ``batch`` then decode greedily; all logits, cloned."""
    reset_caches(model)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab, (batch, prompt), generator=g).to(device)
    return decode_loop(step, ids, new_tokens)


def assert_close_steps(actual, expected, atol=1e-4, rtol=1e-4):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=lambda m: f"step {i}: {m}")


def program_nodes(graph) -> list:
    """Every node of a compiled graph's program: its split graph's and each piece's (as traced)."""
    module = graph.plan.program.module
    return [*module.graph.nodes, *(n for m in module.children() for n in m.graph.nodes)]


def graphs_since(serial: int):
    """Graphs compiled after the graph numbered ``serial`` (0: all), oldest first."""
    import piecewise_backend

    return [g for g in piecewise_backend.compiled_graphs() if g.serial > serial]


def busiest_graph(serial: int):
    """Of the graphs compiled after ``serial``, the one that served the most calls (the decode graph:
    Dynamo's first graph specialises the first batch size or position and runs once)."""
    return max(graphs_since(serial), key=lambda g: g.stats.calls)


def last_serial() -> int:
    import piecewise_backend

    graphs = piecewise_backend.compiled_graphs()
    return graphs[-1].serial if graphs else 0


def decode_at_sizes(
    compiled,
    reference,
    sizes,
    steps: int = 2,
    device="cpu",
    static_cache=False,
    seed=0,
    start_pos: int = 0,
    wait_for_captures: bool = True,
):
    """Decode steps at each batch size in ``sizes`` through ``compiled`` and through ``reference``
    (an identical eager copy), marking the batch dynamic; returns (size, compiled out, eager out).

    ``static_cache``: the model takes a position tensor (ToyStaticCacheLlama) instead of an int.
    ``wait_for_captures``: after each call, until ``eager_capture_sizes`` captured behind a first call
    are in (the same order of captures on every run).
    """
    g = torch.Generator().manual_seed(seed)
    results, pos = [], start_pos
    for size in sizes:
        for _ in range(steps):
            ids = torch.randint(0, reference.cfg.vocab, (size, 1), generator=g).to(device)
            if size > 1:  # Dynamo specialises size 1 anyway (and may refuse to mark it)
                torch._dynamo.mark_dynamic(ids, 0)
            where = torch.tensor([pos], device=device) if static_cache else pos
            results.append((size, compiled(ids, where).clone(), reference(ids, where).clone()))
            if wait_for_captures:
                piecewise_backend.wait_for_captures()
            pos += 1
    return results


def assert_results_close(results, atol=1e-4, rtol=1e-4):
    for i, (size, actual, expected) in enumerate(results):
        assert actual.shape == expected.shape, (size, actual.shape, expected.shape)
        torch.testing.assert_close(
            actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"call {i} (batch {size}): {m}"
        )


class Encoder(torch.nn.Module):
    """Self-attention within each sequence, no cache: graph-safe and row-independent across the
    batch, so full mode captures it whole and pads it."""

    def __init__(self, h=64, heads=4):
        super().__init__()
        self.qkv, self.out, self.heads = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h), heads

    def forward(self, x):
        B, S, H = x.shape
        q, k, v = (t.view(B, S, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(B, S, H))


def graphed_but_behind(stats) -> bool:
    """Every call was graphed but those served while their size was captured behind them (the
    default, ``capture_behind``: such a call runs un-graphed when no larger graph can serve it), and
    no capture failed."""
    from piecewise_backend.kinds import Miss

    return stats.failed_captures == 0 and set(stats.misses) <= {Miss.CAPTURING_BEHIND}
