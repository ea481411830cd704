"""The start-up routes on a real GPU (fp32, so eager's tokens are the reference): the engine without
Inductor, and served first then switched to Inductor's code compiled in a worker process, tokens
unchanged across the switch. (A saved graph loaded in a second process on CUDA: ``test_warm_start.py``.)"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import piecewise_backend
from toys.engine import ATTENTION, TINY, Engine, EngineModel, seeded_trace

from .helpers import graphs_since, last_serial

pytestmark = pytest.mark.cuda
OPTIONS = {"extra_splitting_ops": [ATTENTION], "row_independent_ops": [ATTENTION]}


def _engine(model, forward, mode="full_and_piecewise"):
    return Engine(model, forward, max_num_tokens=32, max_num_seqs=5, num_blocks=80, device="cuda", graph_mode=mode)


def _model():
    return EngineModel(dataclasses.replace(TINY, attention_op=ATTENTION)).to("cuda").init_weights_().eval()


def _one_by_one(engine, trace, after=None):
    out = []
    for i, request in enumerate(trace):
        out += [r.output for r in engine.run([request]) if r.id == request.id]
        if after is not None and i == 2:
            after()
    return out


def test_without_inductor_the_engine_replays_full_and_piecewise_graphs_with_eager_tokens():
    torch._dynamo.reset()
    start = last_serial()
    model = _model()
    trace = seeded_trace(10, seed=4, vocab=model.cfg.vocab)
    expected = [r.output for r in _engine(model, None, "piecewise").run(trace)]
    forward = torch.compile(model, backend="piecewise", options={**OPTIONS, "compiler": "eager"})
    assert [r.output for r in _engine(model, forward).run(seeded_trace(10, seed=4, vocab=model.cfg.vocab))] == expected
    graphs = graphs_since(start)
    assert sum(g.stats.full_replays for g in graphs) > 0 and sum(g.stats.piecewise_replays for g in graphs) > 0
    assert all(g.stats.inductor_compiles == 0 for g in graphs)


def test_served_first_then_switched_to_inductor_compiled_in_a_worker_keeps_eager_tokens():
    torch._dynamo.reset()
    start = last_serial()
    model = _model()
    expected = _one_by_one(_engine(model, None, "piecewise"), seeded_trace(12, seed=5, vocab=model.cfg.vocab))
    forward = torch.compile(model, backend="piecewise", options={**OPTIONS, "compiler": "eager_then_inductor"})
    engine = _engine(model, forward)

    def wait_for_the_compile():
        deadline = time.time() + 500
        while not all(g.code_switch.pending for g in graphs_since(start) if g.plan.pieces) and time.time() < deadline:
            time.sleep(0.2)

    got = _one_by_one(engine, seeded_trace(12, seed=5, vocab=model.cfg.vocab), after=wait_for_the_compile)
    assert got == expected
    graphs = [g for g in graphs_since(start) if g.plan.pieces]
    assert all(g.stats.code_switches == 1 and g.stats.inductor_compiles > 0 for g in graphs), [
        g.stats.summary() for g in graphs
    ]
    assert sum(g.stats.full_replays for g in graphs) > 0


WARM_CHILD = """
import json, sys, torch
import piecewise_backend
from tests.test_cuda_start_up import OPTIONS, _model
from toys.engine import Engine, seeded_trace
torch.manual_seed(0)
model = _model()
with torch.inference_mode():
    forward = piecewise_backend.load(sys.argv[1], model.forward, options=OPTIONS)
engine = Engine(model, forward, max_num_tokens=32, max_num_seqs=5, num_blocks=80, device="cuda", mark_dynamic=False)
print(json.dumps([r.output for r in engine.run(seeded_trace(8, seed=6, vocab=model.cfg.vocab))]))
"""


def test_the_engine_saved_then_loaded_in_a_fresh_container_compiles_no_triton_kernel_and_gives_eager_tokens(
    tmp_path,
):
    from benchmarks import triton_compiles
    from piecewise_backend.persist.artifact_file import ArtifactFile

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _model()
    expected = [r.output for r in _engine(model, None, "piecewise").run(seeded_trace(8, seed=6, vocab=model.cfg.vocab))]
    path = str(tmp_path / "engine.bin")
    examples = Engine(model, None, max_num_tokens=32, max_num_seqs=5, num_blocks=80, device="cuda").example_calls()
    with torch.inference_mode():
        saved = piecewise_backend.save(model.forward, examples, path, options=OPTIONS)
    engine = Engine(model, saved, max_num_tokens=32, max_num_seqs=5, num_blocks=80, device="cuda", mark_dynamic=False)
    assert [r.output for r in engine.run(seeded_trace(8, seed=6, vocab=model.cfg.vocab))] == expected
    kernels = ArtifactFile.read(path).kernels  # the paged kernels the decode steps launched, written after them
    assert any("paged_decode" in k["group"] for k in kernels.values()), [k["group"] for k in kernels.values()]

    log = str(tmp_path / "compiles.log")
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "fresh" / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "fresh" / "triton"),
        **triton_compiles.counted_env(log),
    }
    done = subprocess.run(
        [sys.executable, "-c", WARM_CHILD, path], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected
    assert triton_compiles.compiled(log) == {}  # Inductor's kernels and the package's came from the artifact
