"""Small helpers shared by the tests."""

from __future__ import annotations

import torch

from piecewise_backend.config import PiecewiseConfig
from piecewise_backend.splitting import split_graph
from piecewise_backend.toy_models import reset_caches


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
    outs = [step(ids, 0).clone()]
    pos = prompt
    for _ in range(new_tokens):
        ids = outs[-1][:, -1:].argmax(-1)
        outs.append(step(ids, pos).clone())
        pos += 1
    return outs


def assert_close_steps(actual, expected, atol=1e-4, rtol=1e-4):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=lambda m: f"step {i}: {m}")
