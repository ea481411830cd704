"""Start-up routes (``compiler=`` option, save/load of compiled graphs), on CPU with emulated graphs:
the route without Inductor gives eager's tokens and captures, pads and replays as the Inductor route
does, on the serving engine and on a Hugging Face ``generate()``."""

from __future__ import annotations

import dataclasses
import time
import warnings

import pytest
import torch

import piecewise_backend
from piecewise_backend.config import PiecewiseConfig
from piecewise_backend.kinds import GraphMode
from toys.engine import ATTENTION, TINY, Engine, EngineModel, seeded_trace

from .helpers import graphs_since, last_serial

pytestmark = pytest.mark.usefixtures("emulated_graphs")

ENGINE_OPTIONS = {"extra_splitting_ops": [ATTENTION], "row_independent_ops": [ATTENTION]}


def _serve(model, forward, graph_mode, requests=8, seed=3):
    engine = Engine(model, forward, max_num_tokens=32, max_num_seqs=5, num_blocks=80, graph_mode=graph_mode)
    return [r.output for r in engine.run(seeded_trace(requests, seed=seed, vocab=model.cfg.vocab))]


def _engine_model():
    return EngineModel(dataclasses.replace(TINY, attention_op=ATTENTION)).init_weights_().eval()


@pytest.fixture(scope="module")
def engine_eager_route():
    torch._dynamo.reset()
    start = last_serial()
    model = _engine_model()
    expected = _serve(model, None, "piecewise")
    compiled = torch.compile(model, backend="piecewise", options={**ENGINE_OPTIONS, "compiler": "eager"})
    got = _serve(model, compiled, "full_and_piecewise")
    return {"expected": expected, "got": got, "graphs": graphs_since(start)}


def test_without_inductor_the_engine_gives_eager_tokens_and_captures_full_and_piecewise_graphs(engine_eager_route):
    run = engine_eager_route
    assert run["got"] == run["expected"]
    graphs = run["graphs"]
    assert graphs and all(g.stats.inductor_compiles == 0 for g in graphs), [g.stats.summary() for g in graphs]
    assert sum(g.stats.full_replays for g in graphs) > 0 and sum(g.stats.piecewise_replays for g in graphs) > 0
    dynamic = next(g for g in graphs if g.pad_position is not None)
    assert "padded up to the next capture size" in dynamic.stats.padding
    full_sizes = {size for (mode, size), _ in dynamic.stats.graph_calls.items() if mode == GraphMode.FULL}
    assert full_sizes and full_sizes <= set(dynamic.policy.sizes)


def test_an_unknown_compiler_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="'compiler' must be one of 'inductor', 'eager'"):
        PiecewiseConfig.from_options({"compiler": "tvm"})


def test_the_engine_saved_and_loaded_serves_eager_tokens_from_the_saved_graphs(tmp_path):
    model = _engine_model()
    expected = _serve(model, None, "piecewise")
    options = {**ENGINE_OPTIONS, "compiler": "eager"}
    path = str(tmp_path / "engine.bin")
    torch._dynamo.reset()
    start = last_serial()
    examples = Engine(model, None, max_num_tokens=32, max_num_seqs=5, num_blocks=80).example_calls()
    with torch.inference_mode():  # as the engine calls it: the guards record the grad mode
        saved = piecewise_backend.save(model.forward, examples, path, options=options)
    assert len(saved.functions) == 2  # a graph for many tokens, one for a single token
    torch._dynamo.reset()
    with torch.inference_mode():
        loaded = piecewise_backend.load(path, model.forward, options=options)
    engine = Engine(model, loaded, max_num_tokens=32, max_num_seqs=5, num_blocks=80, mark_dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a call the saved guards refused would warn
        got = [r.output for r in engine.run(seeded_trace(8, seed=3, vocab=model.cfg.vocab))]
    assert got == expected
    graphs = [g for g in graphs_since(start) if g.stats.loaded]
    assert len(graphs) == 2 and sum(g.stats.full_replays for g in graphs) > 0, [g.stats.summary() for g in graphs]


def test_served_first_then_switched_to_inductors_code_between_calls_with_eager_tokens(monkeypatch):
    """The background compile is held until the engine has served some steps on the traced code;
    then the next call switches every piece at once and captures again; tokens stay eager's."""
    import threading

    from piecewise_backend.persist import compile_behind

    release = threading.Event()
    real_submit = compile_behind.CompileBehind.submit

    def held(self, *args):
        threading.Thread(target=lambda: (release.wait(120), real_submit(self, *args)), daemon=True).start()

    monkeypatch.setattr(compile_behind.CompileBehind, "submit", held)
    monkeypatch.setattr(compile_behind.CompileBehind, "_shared", None)
    monkeypatch.setenv("PIECEWISE_COMPILE_WORKERS", "2")  # a graph's pieces spread over two processes
    workers = []
    real_init = compile_behind.CompileBehind.__init__

    def counted(self, *args, **kwargs):
        workers.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(compile_behind.CompileBehind, "__init__", counted)
    torch._dynamo.reset()
    start = last_serial()
    model = _engine_model()
    expected = _serve(model, None, "piecewise", requests=12)
    compiled = torch.compile(model, backend="piecewise", options={**ENGINE_OPTIONS, "compiler": "eager_then_inductor"})
    engine = Engine(model, compiled, max_num_tokens=32, max_num_seqs=5, num_blocks=80)
    trace = seeded_trace(12, seed=3, vocab=model.cfg.vocab)
    served = []
    for i, request in enumerate(trace):  # one at a time: the switch lands between requests
        served += [r.output for r in engine.run([request]) if r.id == request.id]
        if i == 3:
            graphs = graphs_since(start)
            before = {g.serial: g.stats.replays + g.stats.full_replays for g in graphs}
            calls = {g.serial: g.stats.calls for g in graphs}
            assert all(g.stats.code_switches == 0 and g.stats.inductor_compiles == 0 for g in graphs)
            release.set()
            for g in graphs:
                deadline = time.time() + 300
                while not g.code_switch.pending and time.time() < deadline:
                    time.sleep(0.05)
    assert served == expected
    graphs = graphs_since(start)
    assert all(g.stats.code_switches == 1 and g.stats.inductor_compiles >= 1 for g in graphs), [
        g.stats.summary() for g in graphs
    ]
    assert all(g.runners[name].fn is g.compiled_code[name] is not None for g in graphs for name in g.runners)
    assert sum(g.stats.replays + g.stats.full_replays for g in graphs) > sum(before.values())
    assert any(e.call > calls[g.serial] for g in graphs for e in g.stats.events)  # captured again after it
    assert len(graphs) == 2 and len(workers) == 1 and len(workers[0].workers) == 2  # one pool for both graphs
    for g in graphs:  # the steps of the compile behind, in their order
        t = g.stats.behind_timeline
        assert t["submitted"] <= t["first_piece"] <= t["compiled"] <= t["loaded"] <= t["switched"], t


def test_the_compile_worker_answers_a_job_that_fails_with_its_error_and_takes_the_next(monkeypatch):
    """A worker serves the process's graphs one piece after another: a piece it cannot compile is
    answered with the worker's error (a warning; the graph keeps its traced code), and it lives on."""
    import types

    from piecewise_backend.persist import compile_behind

    worker = compile_behind.CompileBehind(workers=1)
    pid = worker.workers[0].process.pid
    plan = types.SimpleNamespace(report=types.SimpleNamespace(compiled_as={}))
    delivered = []
    with pytest.warns(UserWarning) as seen:
        for label in ("first", "second"):
            worker.submit(
                {"pieces": {"submod_0": (b"not a pickle", [])}, "hints": {}}, frozenset(), delivered.append, plan, label
            )
        deadline = time.time() + 120
        while len([w for w in seen if "compiling behind failed" in str(w.message)]) < 2 and time.time() < deadline:
            time.sleep(0.05)
    failed = [str(w.message) for w in seen if "compiling behind failed" in str(w.message)]
    assert len(failed) == 2 and not delivered, failed
    assert all("UnpicklingError" in m and "keeps running its traced code" in m for m in failed), failed
    assert worker.workers[0].process.poll() is None and worker.workers[0].process.pid == pid
    worker.stop()


def test_compile_workers_start_once_in_the_number_the_environment_asks(monkeypatch):
    from piecewise_backend.persist import compile_behind

    monkeypatch.setattr(compile_behind.CompileBehind, "_shared", None)
    monkeypatch.setenv("PIECEWISE_COMPILE_WORKERS", "none")
    with pytest.raises(ValueError, match="PIECEWISE_COMPILE_WORKERS='none': give a whole number"):
        piecewise_backend.start_compile_workers()
    monkeypatch.delenv("PIECEWISE_COMPILE_WORKERS")
    assert compile_behind.worker_count() == 1  # one, unless asked: each worker holds a CUDA context
    monkeypatch.setenv("PIECEWISE_COMPILE_WORKERS", "1")
    piecewise_backend.start_compile_workers()
    first = compile_behind.CompileBehind._shared
    piecewise_backend.start_compile_workers()
    assert compile_behind.CompileBehind._shared is first and len(first.workers) == 1
    first.stop()
