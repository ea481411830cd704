"""The benchmarks on CPU: every suite's smoke run gives rows of the harness's schema, failures are rows,
ratios are right, results are recorded per GPU and the README's numbers are what the results say."""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from benchmarks import decode, decode_variants, harness, report, timing
from benchmarks.__main__ import SUITES
from piecewise_backend.kinds import Miss

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _decode_args(args: argparse.Namespace) -> argparse.Namespace:
    """The decode suite's child arguments from a test's short form (``models``, ``variants``)."""
    return argparse.Namespace(
        child=args.models[0], backends=args.variants, batches=args.batches, steps=getattr(args, "steps", 3),
        prompt=getattr(args, "prompt", 4), rounds=getattr(args, "rounds", 1),
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path (the limit needs a GPU)")
def test_suite_rows_include_failures_as_rows():
    args = argparse.Namespace(models=["tiny"], batches=[2], variants=["eager", "piecewise", "limit"], steps=4, prompt=4)
    rows = decode.decode_rows(_decode_args(args), "cpu")
    by_variant = {r["variant"]: r for r in rows}
    assert set(by_variant) == {"eager", "piecewise", "limit"}
    assert by_variant["eager"]["step_ms"] > 0 and by_variant["piecewise"]["step_ms"] > 0
    # on a CPU nothing runs asynchronously: the time to enqueue a step is nearly all of it
    for variant in ("eager", "piecewise"):
        row = by_variant[variant]
        assert 0.5 * row["step_ms"] < row["host_ms"] <= row["step_ms"] * 1.05, row
        assert row["sm_clock_mhz"] is None  # no GPU clock to read
        assert row["pipelined_ms"] > 0 and "pipelined_error" not in row, row
    assert by_variant["piecewise"]["piecewise"]["compute_pieces"] == 3
    assert by_variant["limit"]["step_ms"] is None and "needs a GPU" in by_variant["limit"]["error"]
    assert "pipelined_ms" not in by_variant["limit"]
    # what first_call_s timed: the piecewise warm-up compiled (or loaded) every piece of its graphs
    # (prefill and decode), eager nothing
    piecewise = by_variant["piecewise"]
    assert (
        piecewise["inductor_compiled"] + piecewise["inductor_cache_hits"]
        == piecewise["piecewise"]["inductor_compiles"]
        >= 3
    ), piecewise
    assert by_variant["eager"]["inductor_compiled"] == by_variant["eager"]["inductor_cache_hits"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_rows_say_their_sdpa_setting_and_a_pinned_twin_compiles_its_own_graphs():
    """Rows run with torch's SDPA defaults unless the variant's name says pinned; the pinned twin,
    interleaved in the same process, must not be served the unpinned variant's compiled graphs
    (Inductor picks SDPA's kernel at compile time)."""
    args = argparse.Namespace(
        models=["tiny"],
        batches=[2],
        steps=3,
        prompt=4,
        rounds=2,
        variants=["piecewise", "piecewise+pinned-sdpa", "inductor", "inductor+pinned-sdpa"],
    )
    rows = {r["variant"]: r for r in decode.decode_rows(_decode_args(args), "cpu")}
    assert {v: r["sdpa"] for v, r in rows.items()} == {
        "piecewise": "torch default",
        "piecewise+pinned-sdpa": "pinned flash/efficient",
        "inductor": "torch default",
        "inductor+pinned-sdpa": "pinned flash/efficient",
    }
    assert all(r["step_ms"] > 0 for r in rows.values()), rows
    assert rows["piecewise+pinned-sdpa"]["piecewise"]["compute_pieces"] == 3  # graphs of its own
    pinned = rows["inductor+pinned-sdpa"]
    assert pinned["inductor_compiled"] + pinned["inductor_cache_hits"] > 0, pinned  # compiled, not Dynamo-cached


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path (the limit needs a GPU)")
def test_interleaved_rounds_time_every_variant_each_round(monkeypatch):
    import statistics

    # "full speed" is relative to the process's fastest probe: one an earlier test took on a quieter
    # moment of a shared machine could leave none of these rounds within it
    monkeypatch.setattr(timing, "FASTEST_PROBE", [float("inf")])

    args = argparse.Namespace(
        models=["tiny"], batches=[2], variants=["eager", "piecewise", "limit"], steps=3, prompt=4, rounds=3
    )
    rows = {r["variant"]: r for r in decode.decode_rows(_decode_args(args), "cpu")}
    for variant in ("eager", "piecewise"):
        assert len(rows[variant]["step_ms_rounds"]) == 3, rows[variant]
        assert rows[variant]["step_ms"] == round(statistics.median(rows[variant]["step_ms_rounds"]), 4)
        assert rows[variant]["host_ms"] == round(statistics.median(rows[variant]["host_ms_rounds"]), 4)
        assert len(rows[variant]["host_ms_rounds"]) == 3
        assert len(rows[variant]["pipelined_ms_rounds"]) == 3, rows[variant]
        assert rows[variant]["pipelined_ms"] == round(statistics.median(rows[variant]["pipelined_ms_rounds"]), 4)
        assert len(rows[variant]["host_probe_us_rounds"]) == 3 and 0 <= rows[variant]["fast_host_rounds"] <= 3
        # a round counts as full speed when its probe (the slower of the two around it) is within
        # FAST_HOST of the fastest single probe; how many are is up to the machine, not asserted (a busy
        # CI host once left none), the rule is
        fastest = rows[variant]["host_probe_fastest_us"]
        assert rows[variant]["fast_host_rounds"] == sum(
            p <= timing.FAST_HOST * fastest for p in rows[variant]["host_probe_us_rounds"]
        ), rows[variant]
    assert rows["piecewise"]["piecewise"]["compute_pieces"] == 3 and "piecewise" not in rows["eager"]
    assert rows["limit"]["step_ms"] is None and "needs a GPU" in rows["limit"]["error"]


def test_pipelined_decode_makes_the_same_calls_as_the_waiting_one():
    """Same prefill, same positions, the same greedy tokens fed back: only the waiting differs."""
    from benchmarks.timing import time_decode

    model = decode_variants.toy_model("tiny", "cpu", max_batch=2, max_seq=16)
    runs = []
    for decoding in (
        lambda step: time_decode(step, model, 2, 4, 5, "cpu")[0],
        lambda step: timing.pipelined_decode_ms(step, model, 2, 4, 5, "cpu"),
    ):
        calls = []

        def step(ids, pos):
            calls.append((ids.clone(), pos))
            return model(ids, pos)

        torch.manual_seed(0)
        with torch.inference_mode():
            assert decoding(step) > 0
        runs.append(calls)
    waiting, pipelined = runs
    assert [pos for _, pos in pipelined] == [0, 4, 5, 6, 7, 8] == [pos for _, pos in waiting]
    for (a, _), (b, _) in zip(waiting, pipelined):
        assert torch.equal(a, b)


def test_a_failed_pipelined_run_keeps_the_rows_waiting_times():
    def measure(pipelined=False):
        if pipelined:
            raise RuntimeError("boom")
        return 1.0, 0.5

    row = {"step_ms": 1.0}
    assert decode._pipelined_ms(row, measure) is None
    assert row["step_ms"] == 1.0 and "RuntimeError: boom" in row["pipelined_error"]


def test_skip_guards_variant_decodes_its_base_variants_graphs():
    """``piecewise-full-skip-guards`` must time full mode's own graphs with guards skipped, not
    compile something else (``piecewise`` default, say) under that name."""
    args = argparse.Namespace(
        models=["tiny"],
        batches=[2],
        steps=3,
        prompt=4,
        rounds=2,
        variants=["piecewise-full", "piecewise-full-skip-guards"],
    )
    rows = {r["variant"]: r for r in decode.decode_rows(_decode_args(args), "cpu")}
    full, skipping = rows["piecewise-full"], rows["piecewise-full-skip-guards"]
    assert full["step_ms"] > 0 and skipping["step_ms"] > 0, rows
    assert "piecewise" in full and "piecewise" not in skipping, "the skip-guards variant compiled graphs of its own"
    assert skipping["inductor_compiled"] == 0 and skipping["inductor_cache_hits"] == 0, skipping


def test_dynamo_floor_runs_nothing_but_the_replay_behind_dynamo():
    """``dynamo-floor`` times Dynamo's entry plus one replay: its backend must call the replay once
    per step and return its output, whatever the inputs, through a real ``torch.compile``."""
    calls, out = [], torch.full((2, 1, 256), 7.0)

    def replay():
        calls.append(1)
        return out

    model = decode_variants.toy_model(
        "tiny", "cpu", decode_variants.IDIOMS["tiny-whole-cache"][1], max_batch=2, max_seq=32
    )
    model.set_batch(2)
    step = torch.compile(model, backend=decode_variants.floor_backend(replay))
    with torch.inference_mode():
        results = [step(torch.zeros(2, 1, dtype=torch.long), pos) for pos in (3, 4, 5)]
    assert len(calls) == 3 and all(r is out for r in results)
    assert model.layers[0].attn.k_cache.abs().sum() == 0, "the model itself ran: the floor must not"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path (the limit needs a GPU)")
def test_dynamo_floor_row_on_cpu_is_an_error_row():
    args = argparse.Namespace(models=["tiny-whole-cache"], batches=[2], variants=["dynamo-floor"], steps=3, prompt=4)
    (row,) = list(decode.decode_rows(_decode_args(args), "cpu"))
    assert row["step_ms"] is None and "needs a GPU" in row["error"], row


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the limit is a CUDA graph: needs a GPU")
def test_limit_replays_its_own_inputs_after_their_memory_is_reused():
    """The limit's graph reads its token ids by address, so they must live as long as the graph.
    They did not: freed when ``limit_graph`` returned, their memory went to later allocations, and
    on the H200 the replays read ids out of the vocabulary (a device-side assert at batch 8)."""
    from toys.models import reset_caches

    model = decode_variants.toy_model("tiny", "cuda")
    with torch.inference_mode():
        replay, _ = decode_variants.limit_graph(model, batch=2, prompt=8, device="cuda")
        junk = [torch.full((2, 1), 3, device="cuda") for _ in range(1024)]  # lands in any freed block of that size
        logits = replay().clone()
        ids, pos = replay.inputs
        assert not torch.equal(ids, junk[0]), "the graph's token ids were overwritten by later allocations"
        reset_caches(model)  # the limit's own warm-up started from empty caches too
        expected = model(ids, pos)
    torch.testing.assert_close(logits.float(), expected.float(), atol=0.1, rtol=0.05)


def test_fast_host_rounds_are_those_whose_probes_ran_at_the_batchs_fastest():
    """A round whose host probe took more than ``FAST_HOST`` times the batch's fastest probe (any
    variant's) met a slowed host: ``step_ms_fast_host`` is the median of the other rounds, and the
    ratio to the limit's own fast-host time is reported beside the all-rounds one."""
    rows = [
        {
            "model": "m",
            "variant": "limit",
            "batch": 1,
            "step_ms": 0.71,
            "step_ms_rounds": [0.70, 0.71, 0.73],
            "host_probe_us_rounds": [10.0, 11.0, 30.0],
        },
        {
            "model": "m",
            "variant": "piecewise",
            "batch": 1,
            "step_ms": 1.0,
            "step_ms_rounds": [0.84, 1.0, 1.02, 0.86],
            "host_probe_us_rounds": [12.5, 29.0, 31.0, 13.0],
        },
        {
            "model": "m",
            "variant": "eager",
            "batch": 1,
            "step_ms": 5.0,
            "step_ms_rounds": [5.0, 5.1],
            "host_probe_us_rounds": [27.0, 28.0],
        },
        {
            "model": "m",
            "variant": "inductor",
            "batch": 1,
            "step_ms": None,
            "error": "boom",
            "step_ms_rounds": [],
            "host_probe_us_rounds": [1.0],
        },
    ]  # an error row's probes do not count
    timing.fast_host_times(rows)
    timing.fast_host_times(rows, fastest=8.0)  # the process's fastest probe counts when faster
    assert [(r.get("fast_host_rounds"), r.get("step_ms_fast_host")) for r in rows] == [
        (1, 0.70),
        (0, None),
        (0, None),
        (None, None),
    ]
    timing.fast_host_times(rows)
    assert [(r.get("fast_host_rounds"), r.get("step_ms_fast_host")) for r in rows] == [
        (2, 0.705),
        (2, 0.85),
        (0, None),
        (None, None),
    ]
    assert rows[0]["host_probe_fastest_us"] == 10.0
    decode._mark_process(rows, argparse.Namespace(child="m", batches=[1], backends=["limit", "piecewise"]))
    ratios = {r["variant"]: r for r in rows}
    assert ratios["piecewise"]["vs_limit"] == round(1.0 / 0.71, 3)
    assert ratios["piecewise"]["vs_limit_fast_host"] == round(0.85 / 0.705, 3)
    assert "vs_limit_fast_host" not in ratios["eager"] and "vs_limit" not in ratios["inductor"]


def test_host_probe_times_python_in_microseconds():
    from benchmarks.timing import host_probe_us

    assert 0 < host_probe_us(reps=3) < 1e5


def test_a_settled_probe_waits_for_the_host_at_full_speed(monkeypatch):
    """Probes slower than ``FAST_HOST`` times the fastest so far are taken again, up to the wait."""
    probes = iter([10.0, 30.0, 29.0, 11.0, 40.0])
    monkeypatch.setattr(timing, "host_probe_us", lambda: next(probes))
    monkeypatch.setattr(timing, "FASTEST_PROBE", [float("inf")])
    monkeypatch.setattr(timing.time, "sleep", lambda s: None)
    assert timing.settled_probe(0) == 10.0
    assert timing.settled_probe(60) == 11.0  # 30 and 29 waited out
    assert timing.settled_probe(0) == 40.0  # no wait allowed: the slow probe is what it is


def test_rows_say_what_shared_their_process_and_their_ratio_to_its_limit():
    args = argparse.Namespace(child="tiny", batches=[1, 2], backends=["eager", "limit"], rounds=3)
    rows = [{"variant": "eager", "step_ms": 5.0, "pipelined_ms": 4.0}, {"variant": "limit", "step_ms": 0.5}]
    decode._mark_process(rows, args)
    assert rows[0]["process"] == rows[1]["process"] == "tiny b[1, 2], interleaved: ['eager', 'limit']"
    assert rows[0]["vs_limit"] == 10.0 and rows[1]["vs_limit"] == 1.0
    assert "pipelined_vs_limit" not in rows[0]  # the limit's pipelined time was not measured
    failed_limit = [{"variant": "eager", "step_ms": 5.0}, {"variant": "limit", "step_ms": None}]
    decode._mark_process(failed_limit, argparse.Namespace(child="tiny", batches=[1], backends=["eager", "limit"]))
    assert "one at a time" in failed_limit[0]["process"] and "vs_limit" not in failed_limit[0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_gpu_timed_records_events_and_waits_only_when_asked():
    timed = timing.GpuTimed(lambda: torch.ones(1024, device="cuda").mul_(2), "cuda")
    outs = [timed() for _ in range(6)]
    assert len(timed.marks) == 6 and all(isinstance(m, torch.cuda.Event) for pair in timed.marks for m in pair)
    assert timed.median_ms(6) > 0  # elapsed_time raises on an event that has not completed: the wait worked
    assert all(float(o[0]) == 2.0 for o in outs)


def test_hf_generate_rows_time_decode_steps_and_compare_tokens(tmp_path):
    """``hf.py`` on CPU, two interleaved rounds: an eager row first (the reference), then a
    piecewise row with its token agreement, speed-up and the decode graph's facts, one row per
    variant with a time per round; a variant that fails is a row with its error, once."""
    pytest.importorskip("transformers")
    import statistics

    from benchmarks import hf

    rows = list(hf.bench_model("tiny", [2], 5, ["eager", "piecewise-static", "no-such-variant"], "cpu", rounds=2))
    by_variant = {r["variant"]: r for r in rows}
    # a row comes once: a failed one at once, the others after their last round
    assert [r["variant"] for r in rows] == ["no-such-variant", "eager", "piecewise-static"]
    eager, static = by_variant["eager"], by_variant["piecewise-static"]
    for row in (eager, static):
        assert row["rounds"] == "interleaved" and len(row["ms_rounds"]) == 2, row
        assert row["ms_per_token"] == round(statistics.median(row["ms_rounds"]), 3)
    assert eager["speedup_vs_eager"] == 1.0 and eager["ms_per_token"] > 0
    assert static["speedup_vs_eager"] == round(eager["ms_per_token"] / static["ms_per_token"], 2)
    assert static["cache"] == "static" and static["token_agreement"] == 1.0 and static["decode_pieces"] == 1, static
    assert "error" in by_variant["no-such-variant"] and "ms_rounds" not in by_variant["no-such-variant"]


def test_hf_generate_facts_come_from_the_graph_that_served_the_row(monkeypatch):
    """A row's graph facts are the graph that served most of *its* calls, not the busiest overall (a
    batch-4 row used to report the batch-1 decode graph, which had served more calls)."""
    import types

    import piecewise_backend
    from benchmarks import hf

    def graph(serial, calls, captures):
        stats = types.SimpleNamespace(
            calls=calls,
            num_pieces=1,
            num_compute_pieces=1,
            replays=0,
            captures=captures,
            ungraphed_runs=0,
            misses={},
            miss_details={},
        )
        plan = types.SimpleNamespace(report=types.SimpleNamespace(attention=()), key=types.SimpleNamespace(symbols=()))
        return types.SimpleNamespace(serial=serial, stats=stats, plan=plan)

    old, new = graph(1, 100, 1), graph(2, 0, 2)
    monkeypatch.setattr(piecewise_backend, "compiled_graphs", lambda: [old, new])
    before = hf.graph_calls()
    old.stats.calls, new.stats.calls = 110, 30
    assert hf.piecewise_facts(before)["captures"] == 2
    assert hf.piecewise_facts()["captures"] == 1  # without a baseline: the busiest overall


def test_hf_generate_builds_each_architecture_at_a_depth_and_refuses_an_unknown_key():
    """``ARCH-NL-DIMS`` keys (the issue's Qwen3, Phi-3, Gemma 3 rows), built on the meta device."""
    pytest.importorskip("transformers")
    from benchmarks import hf

    for key, cls, layers in (
        ("qwen3-4L-512", "Qwen3ForCausalLM", 4),
        ("phi3-28L-1.5b", "Phi3ForCausalLM", 28),
        ("gemma3-4L-512", "Gemma3ForCausalLM", 4),
        ("8L-512", "LlamaForCausalLM", 8),
    ):
        model = hf.build_model(key, "meta", torch.bfloat16)
        assert (
            type(model).__name__ == cls and model.config.num_hidden_layers == layers and model.dtype == torch.bfloat16
        )
        assert hf.model_config(key)[3] == layers
    with pytest.raises(ValueError, match="unknown model 'mamba-4L-512'.*ARCH-NL-DIMS"):
        hf.model_config("mamba-4L-512")


def test_threads_benchmark_counts_a_neighbours_errors_and_concurrent_callers_outputs():
    """``reliability``'s ``threads`` scenarios on CPU (graphs emulated, so captures and replays happen): the
    neighbour thread ran and erred nowhere, every call was compared with eager."""
    pytest.importorskip("transformers")
    import piecewise_backend
    from benchmarks import reliability as threads

    with piecewise_backend.emulated_graphs():
        torch._dynamo.reset()
        seen = threads.background("cpu", 6)
        torch._dynamo.reset()
        calls = threads.concurrent("cpu", 12)
    assert seen["background_calls"] == 6 and seen["background_wrong"] == 0, seen
    assert seen["background_iterations"] > 0 and seen["background_errors"] == 0, seen
    assert seen["captures"] > 0 and seen["failed_captures"] == 0, seen
    assert calls == {"concurrent_calls": 12, "concurrent_wrong": 0, "concurrent_errors": 0, "concurrent_threads": 2}


def test_cuda_tests_deal_the_tests_to_processes_and_add_their_counts(tmp_path):
    """``reliability``'s ``cuda-tests`` over two pytest processes: every ``-m cuda`` test runs once, the
    counts add up in one row, the failed test is named, the row takes ``--row-name``."""
    from benchmarks import reliability

    (tmp_path / "test_marked.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.cuda\n"
        "@pytest.mark.parametrize('n', range(4))\n"
        "def test_passes(n): assert n < 4\n"
        "def test_fails(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='says why')\n"
        "def test_skipped(): pass\n"
    )
    (tmp_path / "test_unmarked.py").write_text("def test_not_selected(): assert False\n")
    args = argparse.Namespace(tests=f"{tmp_path}/test_marked.py,{tmp_path}/test_unmarked.py", tests_k="not skipped",
                              tests_logs=str(tmp_path), tests_procs=2, row_name="cuda-tests-here", work=str(tmp_path))  # fmt: skip
    row = reliability.cuda_tests(args)
    assert (row["passed"], row["failed"], row["skipped"]) == (4, 1, 0), row
    logs = sorted(tmp_path.glob("cuda-tests-*.log"))  # --tests-logs: each process's output, tracebacks in it
    assert len(logs) == 2 and any("assert 1 == 2" in log.read_text() for log in logs)
    assert [name.rsplit("::", 1)[-1] for name in row["failed_tests"]] == ["test_fails"], row
    assert row["variant"] == "cuda-tests-here" and "2 processes at once" in row["selection"], row
    assert len(row["summary"]) == 2 and sorted(tmp_path.glob("cuda-tests-*.xml")), row


def test_seed_workload_times_the_engine_as_vllm_bench_serve_and_sweeps_concurrency():
    """``serving``'s rows on CPU (graphs emulated): vLLM's serving metrics over a seeded trace,
    the full graphs and piecewise graphs it used, a sweep row per level, and the figure."""
    import piecewise_backend
    from benchmarks import serving

    args = argparse.Namespace(
        config="tiny",
        device="cpu",
        requests=4,
        rate=0.0,
        in_flight=[1, 3],
        max_num_tokens=32,
        agreement_variants="",
        profile=[3],
    )
    with piecewise_backend.emulated_graphs():
        torch._dynamo.reset()
        row, profiled, *sweep = serving.serve(args, "full-and-piecewise")
    for name in ("ttft", "tpot", "itl"):
        assert row[f"{name}_median_ms"] > 0 and row[f"{name}_p99_ms"] >= row[f"{name}_median_ms"], row
    assert row["full_replays"] > 0 and row["piecewise_replays"] > 0 and row["full_fallbacks"] == 0, row
    assert row["out_tok_s"] > 0 and row["requests"] == 4 and row["inductor_cache"] in ("cold", "warm", "mixed")
    # the profile: decode steps are the second wave's extra steps (3 rows each), the host time per forward
    assert profiled["workload"] == "profile" and profiled["decode_steps"] == serving.PROFILED, profiled
    assert profiled["prefill_steps"] >= 1 and profiled["decode_forward_host_ms"] > 0, profiled
    assert serving._summed({"Memcpy DtoD": (4, 1.0), "gemv": (6, 2.0)}, 2) == {
        "kernels_per_step": 3.0,
        "kernel_ms_per_step": 1.5,
        "copies_per_step": 2.0,
    }
    assert [(r["in_flight"], r["out_tok_s"] > 0) for r in sweep] == [(1, True), (3, True)]
    assert [r["decode_batch_median"] for r in sweep][0] == 1 and all(r["decode_step_median_ms"] > 0 for r in sweep)
    assert all(r["decode_steps"] > 0 and "floor_ms" not in r for r in sweep)  # no floor without a GPU's bandwidth
    done = [toy_request(i, [0, 1], [5, 6, 7], arrival=0.5 * i) for i in range(2)]
    metrics = serving.latencies(done, start=100.0)
    assert metrics["ttft_median_ms"] == pytest.approx(1000.0) and metrics["tpot_median_ms"] == pytest.approx(500.0)


def test_a_decode_steps_floor_is_the_weights_once_and_its_rows_keys():
    """``floor_ms``: the bytes a decode step must read (every weight once, a key and a value per cached
    token per layer) over the copy bandwidth; ``vs_floor`` each step over its own floor."""
    from benchmarks.serving import StepFloor
    from toys import engine as toy

    model = toy.EngineModel(toy.TINY)
    floor = StepFloor(model, "cpu")
    assert floor.key_bytes == toy.TINY.layers * 2 * toy.TINY.kv_heads * toy.TINY.head_dim * 4
    floor.bandwidth = 1e9  # bytes/s
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert floor.ms(100) == pytest.approx((weights + 100 * floor.key_bytes) / 1e6)
    steps = [
        toy.StepRecord(0.0, 2 * floor.ms(100) / 1e3, 2, 2, 0, keys=100),
        toy.StepRecord(0.0, 0.5, 40, 1, 39, keys=50),  # a prefill chunk: not a decode step
        toy.StepRecord(0.0, 4 * floor.ms(300) / 1e3, 3, 3, 0, keys=300),
    ]
    row = floor.decode_steps(steps)
    assert row["decode_steps"] == 2 and row["decode_batch_median"] == 2.5
    assert row["floor_ms"] == pytest.approx((floor.ms(100) + floor.ms(300)) / 2, abs=0.01)
    assert row["vs_floor"] == pytest.approx(3.0, abs=0.01)


def test_hf_generate_second_call_times_a_generate_with_a_new_static_cache_length():
    """``piecewise-static-second-call``: a first ``generate()`` at a quarter of the tokens, then the
    timed one (a new static cache, new length): eager's tokens, and the whole call's time beside the
    per-step one (graphs emulated: the decode steps are served by them)."""
    pytest.importorskip("transformers")
    import piecewise_backend
    from benchmarks import hf

    with piecewise_backend.emulated_graphs():
        rows = list(hf.bench_model("tiny", [1], 8, ["eager", hf.SECOND_CALL], "cpu"))
    second = rows[1]
    assert second["variant"] == hf.SECOND_CALL and second["cache"] == "static", second
    assert second["token_agreement"] == 1.0 and second["call_ms_per_token"] >= second["ms_per_token"] > 0, second
    # (the new static cache is a new set of graphs: the timed call's first steps run while they are captured behind)
    assert second["replays"] > 0 and set(second["misses"]) <= {str(Miss.CAPTURING_BEHIND)}, second


def test_triton_compiles_are_counted_per_put_group_and_not_per_cache_hit(tmp_path, monkeypatch):
    """``startup``'s ``triton_compiles``: Triton writes a kernel's group once, when it compiles it."""
    pytest.importorskip("triton")
    from benchmarks import triton_compiles

    log = str(tmp_path / "compiles.log")
    env = triton_compiles.counted_env(log)
    assert env["TRITON_CACHE_MANAGER"] == "benchmarks.triton_compiles:CountingCacheManager"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from triton.runtime.cache import get_cache_manager

    manager = get_cache_manager("a" * 64)
    assert type(manager).__name__ == "CountingCacheManager"  # Triton took the class from the environment
    path = manager.put(b"binary", "kernel_a.cubin")
    manager.put_group("kernel_a.json", {"kernel_a.cubin": path})  # what a compile does last
    assert manager.get_group("kernel_a.json") == {"kernel_a.cubin": path}  # a cache hit writes nothing
    get_cache_manager("b" * 64).put_group("kernel_b.json", {})
    assert triton_compiles.compiled(log) == {"kernel_a": 1, "kernel_b": 1}
    assert triton_compiles.compiled(str(tmp_path / "none.log")) == {}


# -- the suites, the harness, the results files and the report ------------------------------------------


def _run(args: list, timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_bench_folder_is_a_handful_of_modules_and_list_names_every_suite():
    modules = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
    assert len(modules) <= 15, modules
    listed = _run(["--list"]).stdout.splitlines()
    assert [line.split()[0] for line in listed] == list(SUITES)


#: what each suite's smoke rows must carry among their figures (``tensor-parallel``'s smoke run is
#: ``tests/test_tensor_parallel.py``'s, with its tokens checked)
SMOKE_FIGURES = {
    "decode": {"model", "batch", "step_ms", "host_ms", "first_call_s"},
    "serving": {"workload", "tpot_median_ms", "out_tok_s"},
    "hf": {"model", "batch", "ms_per_token", "token_agreement", "transformers"},
    "startup": {"caches", "startup_s", "trace_s", "load_s", "triton_compiles", "tpot_median_ms"},
    "kernels": {"B", "context", "paged_us", "sdpa_us", "floor_us"},
    "reliability": {"fuzz": {"steps", "wrong"}, "threads": {"background_wrong", "concurrent_wrong"}},
}


@pytest.mark.parametrize("suite", sorted(SMOKE_FIGURES))
def test_every_suite_runs_its_smoke_on_cpu_in_the_harness_schema(suite, tmp_path):
    if suite in ("hf",):
        pytest.importorskip("transformers")
    out = tmp_path / "rows.jsonl"
    printed = _run([suite, "--smoke", "--out", str(out)], timeout=900).stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and [json.loads(line) for line in printed.splitlines() if line.startswith("{")] == rows
    digest = harness.code_hash()
    for row in rows:
        assert list(row) == list(harness.SCHEMA) and row["suite"] == suite, row
        assert row["gpu"] == harness.gpu_name() and row["torch"] == torch.__version__ and row["code_hash"] == digest
        assert "error" not in row["figures"], row
        wanted = SMOKE_FIGURES[suite]
        wanted = wanted[row["variant"]] if isinstance(wanted, dict) else wanted
        assert wanted <= set(row["figures"]), (suite, sorted(row["figures"]))
        assert all(row["figures"][k] == 0 for k in wanted if k.endswith("wrong")), row  # outputs as eager's


def _toy_suite(run):
    return harness.Suite(name="toy", about="a suite of the test's own", variants=("a", "b"), run=run, timeout=5)


def test_a_child_that_fails_or_hangs_leaves_a_row_saying_so_and_the_others_run(monkeypatch):
    """The harness's children: a variant that raises is an ``error`` row, one past its timeout too
    (killed, with the rows it gave before), and the next variant still runs. The child here is a script
    of the test's own in place of ``python -m benchmarks SUITE --child VARIANT``."""
    script = (
        "import sys, time; v = sys.argv[sys.argv.index('--child') + 1]; print('ROW {\"n\": 1}', flush=True)\n"
        "if v == 'a': raise SystemExit('variant a broke')\n"
        "time.sleep(60)\n"
    )
    real = subprocess.Popen

    def popen(cmd, **kwargs):  # the harness's command, its ``--child VARIANT`` kept
        return real([sys.executable, "-c", script, *cmd[cmd.index("--child") :]], **kwargs)

    monkeypatch.setattr(harness.subprocess, "Popen", popen)
    suite = _toy_suite(None)
    rows = {v: list(harness._child_rows(suite, v, [], t, dict(os.environ))) for v, t in (("a", 30), ("b", 3))}
    assert rows["a"][0] == {"n": 1} and "variant a broke" in rows["a"][1]["error"], rows
    assert rows["b"] == [{"n": 1}, {"error": "timed out after 3 s (1 rows before)"}]


def test_a_timed_out_child_is_killed_with_the_processes_it_started(monkeypatch, tmp_path):
    """What a child starts (Inductor's compile workers, torchrun's ranks) goes with it at its timeout."""
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('ROW {{}}', flush=True); time.sleep(60)\n"
    )
    real = subprocess.Popen
    monkeypatch.setattr(harness.subprocess, "Popen", lambda cmd, **kw: real([sys.executable, "-c", script], **kw))
    rows = list(harness._child_rows(_toy_suite(None), "a", [], 5, dict(os.environ)))
    assert rows == [{}, {"error": "timed out after 5 s (1 rows before)"}]
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # killed; gone once its parent's reaper (init) collects it
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        state = pathlib.Path(f"/proc/{grandchild}/stat").read_text().split()[2]
        assert state == "Z", f"the grandchild {grandchild} still runs ({state})"


def test_smoke_options_come_first_and_the_command_line_wins_and_unknown_variants_are_refused():
    suite = _toy_suite(None)
    suite = harness.Suite(**{**suite.__dict__, "smoke": ("--variants", "a")})
    assert harness.parse(suite, ["--smoke"]).variants == "a"
    assert harness.parse(suite, ["--smoke", "--variants", "b"]).variants == "b"
    with pytest.raises(SystemExit, match="no variant c; the suite has a, b"):
        harness.parse(suite, ["--variants", "a,c"])


def _row(suite, variant, digest, gpu="NVIDIA H100 80GB HBM3", **figures):
    return harness.row(suite, variant, figures, gpu=gpu, torch_version="2.11.0", digest=digest)


def test_record_files_rows_by_gpu_and_a_run_again_replaces_its_own_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    first = [_row("kernels", "paged", "h1", B=1, paged_us=9.0), _row("kernels", "paged", "h1", B=8, paged_us=12.0)]
    other = [_row("kernels", "paged", "h1", gpu="NVIDIA H200", B=1, paged_us=8.0)]
    assert sorted(p.name for p in harness.record(first + other)) == ["h100.json", "h200.json"]
    again = [_row("kernels", "paged", "h1", B=1, paged_us=7.0)]
    newer = [_row("kernels", "paged", "h2", B=1, paged_us=6.0)]
    harness.record(again)
    harness.record(newer)
    rows = json.loads((tmp_path / "h100.json").read_text())["rows"]
    assert [(r["code_hash"], r["figures"]["paged_us"]) for r in rows] == [("h1", 7.0), ("h2", 6.0)]
    assert report.current(rows) == {"kernels": [rows[-1]]}  # the newest hash recorded, only
    with pytest.raises(SystemExit, match="measured on CPU"):
        harness.record([_row("kernels", "paged", "h1", gpu="cpu")])
    with pytest.raises(SystemExit, match="not written by the harness"):
        harness.record([{"suite": "kernels", "gpu": "NVIDIA H100"}])


def test_report_writes_each_block_from_the_results_and_check_catches_a_hand_edit(tmp_path, monkeypatch):
    rows = [
        _row("startup", "eager", "h1", startup_s=10.0),
        _row("startup", "warm", "h1", startup_s=12.0),
        _row("startup", "inductor", "h1", startup_s=25.0, trace_s=3.0, build_s=11.0, compile_s=9.0),
    ]
    files = {"h100": {"rows": rows}}
    line = report.startup_line(files)
    assert line == (
        "eager 10.0 s, warm artifact 12.0 s (1.20×), first deploy 25.0 s (2.50×) (H100, torch 2.11.0, code hash "
        "`h1…`). A first deploy adds Dynamo's trace (3.0 s) and Inductor's compile (9.0 s); the backend's own "
        "share is 2.0 s (8%)."
    )
    text = "before\n<!-- startup:begin -->\nold numbers\n<!-- startup:end -->\nafter\n"
    assert (
        report.replace_block(text, "startup", line, "x")
        == f"before\n<!-- startup:begin -->\n{line}\n<!-- startup:end -->\nafter\n"
    )
    with pytest.raises(SystemExit, match="no <!-- kernels:begin -->"):
        report.replace_block(text, "kernels", "", "x")
    assert "| startup | H100 | `h1` | eager 10.0 s" in report.numbers_table(files)


def test_the_serving_headline_puts_the_hand_captured_peer_beside_the_backend():
    rows = [
        _row("serving", "full-and-piecewise", "h1", workload="seed", tpot_median_ms=2.5, ttft_median_ms=22.5),
        _row("serving", "hand-captured", "h1", workload="seed", tpot_median_ms=2.25, ttft_median_ms=15.4),
        _row("serving", "piecewise", "h1", workload="seed", tpot_median_ms=4.9),
    ]
    assert report.headline("serving", rows) == "seed TPOT/TTFT 2.50/22.5 ms (hand-captured 2.25/15.4, piecewise 4.90)"


def test_the_readme_takes_a_suite_from_the_gpu_that_recorded_that_suite_last():
    """H100 measured ``startup`` last; H200 recorded another suite later: the README's start-up line
    stays H100's, and each suite's tables list its GPUs in the order they recorded it."""
    files = {
        "h100": {"rows": [_row("startup", "eager", "new", startup_s=9.0)],
                 "recorded": {"startup": "2026-12-07T05:00:00Z"}},
        "h200": {"rows": [_row("startup", "eager", "old", gpu="NVIDIA H200", startup_s=10.0),
                          _row("reliability", "cuda-tests", "new", gpu="NVIDIA H200", passed=3, failed=0)],
                 "recorded": {"startup": "2026-12-01T00:00:00Z", "reliability": "2026-12-07T06:00:00Z"}},
    }  # fmt: skip
    assert report.startup_line(files).startswith("eager 9.0 s (H100, torch 2.11.0, code hash `new…`)")
    assert [(suite, slug) for suite, slug, _ in report._each_current(files)] == [
        ("startup", "h200"),
        ("startup", "h100"),
        ("reliability", "h200"),
    ]


def test_the_committed_readme_numbers_are_what_the_results_files_give():
    """``python -m benchmarks report --check``: every generated block in README.md and
    benchmarks/README.md equals what the committed results give (a hand edit or a stale table fails)."""
    _run(["report", "--check"])


def toy_request(i, prompt, output, arrival):
    """A finished request whose tokens came at 101 s + arrival, then every 0.5 s."""
    from toys.engine import Request

    request = Request(i, prompt, len(output), arrival, list(output))
    request.token_times = [101.0 + arrival + 0.5 * k for k in range(len(output))]
    return request


def test_the_ramp_row_times_two_waves_of_a_fresh_engine_and_what_their_calls_captured(tmp_path):
    """``serving``'s ``ramp`` on CPU (graphs emulated, the tiny engine): a row of the issue's keys, no
    capture in a caller's call (captures behind them), and the ``-inline`` reference that does."""
    from benchmarks import ramp, serving

    args = argparse.Namespace(
        device="cpu", config="tiny", max_num_tokens=32, ramp_prompt=12, ramp_output=6, work=str(tmp_path)
    )
    torch._dynamo.reset()
    (row,) = ramp.ramp("ramp-4-declared", args, serving)
    keys = {"in_flight", "declared", "caches", "wave1_tok_s", "wave2_tok_s", "wave1_over_wave2", "wave1_longest_step_ms",
            "steady_step_median_ms", "wave1_itl_p99_ms", "wave2_itl_p99_ms", "request_path_capture_s",
            "request_path_compile_s", "captures_behind", "triton_compiles_during_waves"}  # fmt: skip
    assert keys <= set(row), sorted(keys - set(row))
    assert row["in_flight"] == 4 and row["declared"] and row["capture"] == "behind"
    assert row["captures_behind"] > 0 and row["request_path_capture_s"] == 0 and row["wave1_tok_s"] > 0
    torch._dynamo.reset()
    (inline,) = ramp.ramp("ramp-4-declared-inline", args, serving)
    assert inline["capture"] == "inline" and inline["captures_behind"] == 0 and inline["request_path_capture_s"] > 0
    assert ramp.env("ramp-4-declared", args)["TRITON_CACHE_DIR"].startswith(str(tmp_path))
