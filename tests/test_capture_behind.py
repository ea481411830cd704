"""Captures behind the calls, on CPU (graphs emulated): a call never captures, every call answers as
eager does, the calls after the capture thread is done replay, and what it records changes nothing
a caller reads. The same with real graphs: ``test_cuda_capture_behind.py``."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

import piecewise_backend
from piecewise_backend.kinds import CaptureHow, Miss
from piecewise_backend.runtime.capture import piece as piece_capture
from piecewise_backend.runtime.capture import retries
from toys.engine import ATTENTION, TINY, Engine, EngineModel, seeded_trace

from .helpers import graphs_since, last_serial

pytestmark = pytest.mark.usefixtures("emulated_graphs")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


def _compiled(**options):
    torch._dynamo.reset()
    start = last_serial()
    model = MLP().eval()
    compiled = torch.compile(model, backend="piecewise", options={"capture_sizes": [2, 4, 8], **options}, dynamic=True)
    return model, compiled, start


def _graph(start):
    return max(graphs_since(start), key=lambda g: g.stats.calls)


def _check(compiled, model, n: int):
    x = torch.randn(n, 16)
    torch.testing.assert_close(compiled(x), model(x))


def test_a_new_size_is_served_at_once_captured_behind_and_replayed_from_the_next_call():
    model, compiled, start = _compiled()
    _check(compiled, model, 3)  # bucket 4: nothing captured, so served un-graphed
    graph = _graph(start)
    assert graph.stats.misses[Miss.CAPTURING_BEHIND] == 1 and graph.stats.request_path_capture_seconds == 0
    assert piecewise_backend.wait_for_captures(timeout=60)
    assert (4,) in graph.captured and graph.stats.captures_behind == 1
    assert [e.how for e in graph.stats.events] == [CaptureHow.BEHIND]
    replays = graph.stats.replays
    _check(compiled, model, 3)
    _check(compiled, model, 4)
    assert graph.stats.replays == replays + 2 * graph.stats.num_compute_pieces
    stats = piecewise_backend.process_stats()
    assert stats["request_path_capture_s"] == 0 and stats["captures_behind"] >= 1


def test_a_size_captured_behind_rides_the_smallest_larger_graph_meanwhile():
    model, compiled, start = _compiled(defer_captures=False)
    _check(compiled, model, 8)
    piecewise_backend.wait_for_captures(timeout=60)
    graph = _graph(start)
    lock = graph.call_guard.capture_lock
    with lock:  # the capture thread waits here: what a long recording looks like to the callers
        for _ in range(3):
            _check(compiled, model, 3)  # its bucket (4) is queued; the graph of 8 serves it, padded
        assert graph.stats.rides == 3 and graph.stats.ungraphed_runs == 1 * graph.stats.num_compute_pieces
    assert piecewise_backend.wait_for_captures(timeout=60)
    assert (4,) in graph.captured
    rides = graph.stats.rides
    _check(compiled, model, 3)
    assert graph.stats.rides == rides  # its own graph now


def test_a_caller_is_never_held_by_a_capture_in_progress():
    """The capture thread holds only the capture lock while it records: calls of any size go on."""
    model, compiled, start = _compiled(defer_captures=False)
    _check(compiled, model, 8)
    graph = _graph(start)
    answered = []

    def caller():
        with torch.no_grad():
            for n in (5, 6, 7, 8, 2, 3):
                _check(compiled, model, n)
                answered.append(n)

    with graph.call_guard.capture_lock:  # as if a recording never ended
        thread = threading.Thread(target=caller)
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive() and len(answered) == 6
    assert piecewise_backend.wait_for_captures(timeout=60)
    assert {(8,), (2,), (4,)} <= graph.captured


def test_inline_capture_stays_available_and_is_counted_as_the_callers():
    model, compiled, start = _compiled(capture_behind=False)
    _check(compiled, model, 3)
    graph = _graph(start)
    assert (4,) in graph.captured and graph.stats.captures_behind == 0
    assert [e.how for e in graph.stats.events] == [CaptureHow.LAZY]
    assert graph.stats.request_path_capture_seconds > 0


def test_a_capture_that_fails_behind_is_said_at_the_next_call_and_its_size_runs_ungraphed(monkeypatch):
    model, compiled, start = _compiled()
    real, failed = piece_capture.EmulatedGraph, []

    def fails_once_behind(fn, args, capture=None):
        if threading.current_thread().name.startswith("piecewise-") and not failed:
            failed.append(1)
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(fn, args, capture)

    monkeypatch.setattr(piece_capture, "EmulatedGraph", fails_once_behind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is said in the calls before the thread is done
        _check(compiled, model, 4)
        piecewise_backend.wait_for_captures(timeout=60)
    graph = _graph(start)
    with pytest.warns(UserWarning, match=r"capture at shape key \(4,\) failed .*operation not permitted"):
        _check(compiled, model, 4)  # said here, at the caller's line, and served un-graphed
    assert graph.stats.failed_captures == 1 and graph.stats.replays == 0, graph.stats.summary()
    for _ in range(retries.WAITS[0] + 2):  # retried behind after a few calls, then replayed
        _check(compiled, model, 4)
        piecewise_backend.wait_for_captures(timeout=60)
    assert graph.stats.replays > 0, graph.stats.summary()


def test_graphs_released_while_they_are_recorded_are_never_used():
    model, compiled, start = _compiled()
    _check(compiled, model, 8)
    piecewise_backend.wait_for_captures(timeout=60)
    graph = _graph(start)
    with graph.call_guard.capture_lock:
        _check(compiled, model, 2)  # (2,) queued
        assert graph.release_graphs() == 1  # the graph of 8; the recording of 2 belongs to a released set
    assert piecewise_backend.wait_for_captures(timeout=60)
    assert graph.captured == set()
    _check(compiled, model, 2)  # captured again, behind this call
    assert piecewise_backend.wait_for_captures(timeout=60) and graph.captured == {(2,)}


def test_eager_capture_sizes_are_captured_behind_the_first_call_largest_first():
    model, compiled, start = _compiled(eager_capture_sizes=[2, 8])
    _check(compiled, model, 5)
    assert piecewise_backend.wait_for_captures(timeout=60)
    graph = _graph(start)
    events = [(e.key, e.how) for e in graph.stats.events]
    assert events[:2] == [((8,), CaptureHow.UP_FRONT), ((2,), CaptureHow.UP_FRONT)], events
    assert graph.capture([4]) == [(4,)] and (4,) in graph.captured  # capture() waits for its sizes


# -- the serving engine: KV cache untouched, eager's tokens, one warning ------------------------------


def _engine(options: dict, model=None) -> tuple[Engine, EngineModel]:
    torch._dynamo.reset()  # (call last_serial() before: the engine's graphs are the ones after it)
    model = model or EngineModel(TINY).init_weights_().eval()
    compiled = torch.compile(model, backend="piecewise", options={"extra_splitting_ops": [ATTENTION], **options})
    return Engine(model, compiled, max_num_tokens=32, max_num_seqs=6, num_blocks=96), model


def test_the_engine_with_captures_behind_gives_eagers_tokens_on_changing_sizes():
    model = EngineModel(TINY).init_weights_().eval()
    trace = dict(prompt=(3, 30), output=(2, 14))
    expected = [
        r.output for r in Engine(model, max_num_tokens=32, max_num_seqs=6, num_blocks=96).run(seeded_trace(10, **trace))
    ]
    engine, _ = _engine({"row_independent_ops": [ATTENTION]}, model)
    engine.warm_up()
    start = piecewise_backend.process_stats()
    assert [r.output for r in engine.run(seeded_trace(10, **trace))] == expected
    piecewise_backend.wait_for_captures(timeout=120)
    engine.finished.clear()
    assert [r.output for r in engine.run(seeded_trace(10, **trace))] == expected  # now replaying them
    stats = piecewise_backend.process_stats()
    assert stats["captures_behind"] > start["captures_behind"] and stats["full_replays"] > 0
    assert stats["request_path_capture_s"] == start["request_path_capture_s"] == 0


def test_a_whole_decode_step_recorded_behind_leaves_the_kv_cache_as_it_was():
    """The decode buffers hold the last step's real slots while the thread records that size's full
    graph: a recording that ran the step (a warm-up) would write there. Bit for bit the same after."""
    start = last_serial()
    engine, _ = _engine({"row_independent_ops": [ATTENTION]})
    engine.warm_up()
    engine.run(seeded_trace(3, prompt=(5, 9), output=(3, 3)))  # prefill, then decode steps of 3 rows
    piecewise_backend.wait_for_captures(timeout=120)
    graph = _graph(start)
    with graph.call_guard.capture_lock:
        engine.run(seeded_trace(6, seed=4, prompt=(3, 4), output=(4, 4)))  # decode steps of 6: size 8, queued
        assert graph.stats.full_fallbacks, graph.stats.summary()
        caches = [(k.clone(), v.clone()) for k, v in engine.kv_caches]
    assert piecewise_backend.wait_for_captures(timeout=120)
    assert (8,) in graph.decisions.active.full.graphs
    for (k, v), (k0, v0) in zip(engine.kv_caches, caches):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_an_undeclared_attention_op_is_named_once_per_graph_with_the_declaration():
    engine, _ = _engine({})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        engine.warm_up()
        engine.run(seeded_trace(6, prompt=(3, 12), output=(2, 8)))
    exact = [str(w.message) for w in said if "captured per exact batch size" in str(w.message)]
    assert len(exact) == len({m.split(":")[1] for m in exact}) >= 1, exact  # once per graph
    assert all(ATTENTION in m and "row_independent_ops" in m for m in exact), exact
    assert piecewise_backend.process_stats()["exact_size_graphs"] == len(exact)
    explained = [line for line in piecewise_backend.explain().splitlines() if "captured per exact batch size" in line]
    assert explained and all(line.startswith("captured per exact batch size: full graphs:") for line in explained)
    assert all(ATTENTION in line and "row_independent_ops" in line for line in explained), explained


def test_a_recording_that_fails_outside_any_piece_fails_the_key_and_is_retried_not_resubmitted(monkeypatch):
    from piecewise_backend.runtime.capture import behind_record

    model, compiled, start = _compiled()

    def broken(*args, **kwargs):
        raise ValueError("cannot evaluate u0")

    monkeypatch.setattr(behind_record, "materialize", broken)  # a stand-in that cannot be made
    _check(compiled, model, 4)
    piecewise_backend.wait_for_captures(timeout=60)
    graph = _graph(start)
    with pytest.warns(UserWarning, match=r"capture at shape key \(4,\) failed \(ValueError: cannot evaluate u0\)"):
        _check(compiled, model, 4)
    assert graph.stats.failed_captures == graph.stats.num_compute_pieces and graph.stats.captures_behind == 1
    for _ in range(3):  # failed: served un-graphed until its retry, not handed over at every call
        _check(compiled, model, 4)
        piecewise_backend.wait_for_captures(timeout=60)
    assert graph.stats.failed_captures == graph.stats.num_compute_pieces


def test_a_key_goes_to_the_capture_thread_only_once_the_call_that_asked_has_run(monkeypatch):
    """Its kernels ran first (Inductor tunes, Triton loads, at a first launch: never inside a capture);
    a call that raised hands nothing over (a later call asks again)."""
    from piecewise_backend.runtime.capture import handover

    model, compiled, start = _compiled()
    _check(compiled, model, 2)
    piecewise_backend.wait_for_captures()
    graph = _graph(start)
    timeline, run_split, capture = [], graph.forward_split, handover.THREAD._capture

    def slow_split(*args):
        out = run_split(*args)
        threading.Event().wait(0.2)  # the thread, were it handed the key already, would start meanwhile
        timeline.append("call ran")
        if any(isinstance(a, torch.Tensor) and a.shape[:1] == (5,) for a in args):
            raise RuntimeError("this call fails")
        return out

    def recorded(job):
        timeline.append(f"capture {job.key}")
        return capture(job)

    monkeypatch.setattr(graph, "forward_split", slow_split)
    monkeypatch.setattr(handover.THREAD, "_capture", recorded)
    with pytest.raises(RuntimeError, match="this call fails"):
        compiled(torch.randn(5, 16))  # asks for the key of 8, then raises
    assert piecewise_backend.wait_for_captures(timeout=30)
    assert timeline == ["call ran"] and graph.stats.captures_behind == 1  # (2's) none for 8
    _check(compiled, model, 7)
    assert piecewise_backend.wait_for_captures(timeout=30)
    assert timeline[1:] == ["call ran", "capture (8,)"] and graph.stats.captures_behind == 2


def test_a_graphs_first_call_runs_holding_the_capture_lock_and_later_calls_do_not(monkeypatch):
    """A first call tunes and loads kernels (a device-wide synchronize): never beside a recording."""
    from piecewise_backend.runtime.compiled_graph import CompiledGraph

    owned, call = [], CompiledGraph._call

    def watched(self, args):
        owned.append(self.call_guard.capture_lock._is_owned())
        return call(self, args)

    monkeypatch.setattr(CompiledGraph, "_call", watched)
    model, compiled, _ = _compiled()
    for n in (2, 2, 3):
        _check(compiled, model, n)
    assert owned == [True, False, False]


def test_device_wide_synchronizes_wait_for_a_recording_in_progress_instead_of_failing(monkeypatch):
    """``torch.cuda.synchronize`` / ``empty_cache`` beside an open capture fail and break it (CUDA):
    once the capture thread is used, they take the device's capture lock first."""
    from piecewise_backend._torch_internals import device_syncs

    calls, lock = [], threading.RLock()

    def synchronize(device=None):
        calls.append(("synchronize", device))

    monkeypatch.setattr(device_syncs, "_ORIGINALS", {})
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(device_syncs, "_get_device_index", lambda device, optional=False: 0)
    device_syncs.guard_device_syncs(lambda index: lock, lambda: [0])
    device_syncs.guard_device_syncs(lambda index: None, lambda: [])  # once per process: a second does nothing
    recording, recorded = threading.Event(), threading.Event()

    def record():  # what the capture thread does: the lock held while a capture is open
        with lock:
            recording.set()
            recorded.wait(10)

    recorder = threading.Thread(target=record)
    recorder.start()
    recording.wait(10)
    callers = [threading.Thread(target=torch.cuda.synchronize), threading.Thread(target=torch.cuda.empty_cache)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(0.3)
    assert calls == [] and all(c.is_alive() for c in callers)  # waiting, not failing
    recorded.set()
    for caller in callers + [recorder]:
        caller.join(10)
    assert sorted(map(str, calls)) == ["('synchronize', None)", "empty_cache"]
    assert torch.cuda.synchronize.__wrapped__ is synchronize  # (functools.wraps: it looks like what it wraps)
