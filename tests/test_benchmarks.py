"""The benchmark suite's plumbing on CPU: failures are rows, ratios and merges are right."""

import argparse
import pathlib
import sys

import pytest
import torch

from benchmarks import (
    host_speed,
    plot,
    record,
    suite,
    suite_models,
    suite_variants,
    timing,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path (the limit needs a GPU)")
def test_suite_rows_include_failures_as_rows():
    args = argparse.Namespace(models=["tiny"], batches=[2], variants=["eager", "piecewise", "limit"], steps=4, prompt=4)
    rows = suite.decode_rows(args, "cpu", [])
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
    rows = {r["variant"]: r for r in suite.decode_rows(args, "cpu", [])}
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
    monkeypatch.setattr(host_speed, "FASTEST_PROBE", [float("inf")])

    args = argparse.Namespace(
        models=["tiny"], batches=[2], variants=["eager", "piecewise", "limit"], steps=3, prompt=4, rounds=3
    )
    rows = {r["variant"]: r for r in suite.decode_rows(args, "cpu", [])}
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
            p <= host_speed.FAST_HOST * fastest for p in rows[variant]["host_probe_us_rounds"]
        ), rows[variant]
    assert rows["piecewise"]["piecewise"]["compute_pieces"] == 3 and "piecewise" not in rows["eager"]
    assert rows["limit"]["step_ms"] is None and "needs a GPU" in rows["limit"]["error"]


def test_pipelined_decode_makes_the_same_calls_as_the_waiting_one():
    """Same prefill, same positions, the same greedy tokens fed back: only the waiting differs."""
    from benchmarks.timing import time_decode

    model = suite_models.toy_model("tiny", "cpu", max_batch=2, max_seq=16)
    runs = []
    for decode in (
        lambda step: time_decode(step, model, 2, 4, 5, "cpu")[0],
        lambda step: timing.pipelined_decode_ms(step, model, 2, 4, 5, "cpu"),
    ):
        calls = []

        def step(ids, pos):
            calls.append((ids.clone(), pos))
            return model(ids, pos)

        torch.manual_seed(0)
        with torch.inference_mode():
            assert decode(step) > 0
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
    assert suite._pipelined_ms(row, measure) is None
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
    rows = {r["variant"]: r for r in suite.decode_rows(args, "cpu", [])}
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

    model = suite_models.toy_model("tiny", "cpu", suite_models.IDIOMS["tiny-whole-cache"][1], max_batch=2, max_seq=32)
    model.set_batch(2)
    step = torch.compile(model, backend=suite_variants.floor_backend(replay))
    with torch.inference_mode():
        results = [step(torch.zeros(2, 1, dtype=torch.long), pos) for pos in (3, 4, 5)]
    assert len(calls) == 3 and all(r is out for r in results)
    assert model.layers[0].attn.k_cache.abs().sum() == 0, "the model itself ran: the floor must not"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path (the limit needs a GPU)")
def test_dynamo_floor_row_on_cpu_is_an_error_row():
    args = argparse.Namespace(models=["tiny-whole-cache"], batches=[2], variants=["dynamo-floor"], steps=3, prompt=4)
    (row,) = suite.decode_rows(args, "cpu", [])
    assert row["step_ms"] is None and "needs a GPU" in row["error"], row


def test_weights_check_costs_time_the_python_check_and_the_cpp_one_where_torch_has_it():
    from benchmarks import host_breakdown
    from piecewise_backend._torch_internals import data_ptrs_check

    costs = host_breakdown.weights_check_costs("cpu", torch.float32, count=5)
    assert costs["weights check, Python tuple (5)"] > 0
    assert ("weights check, torch C++ (5)" in costs) == (data_ptrs_check() is not None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the limit is a CUDA graph: needs a GPU")
def test_limit_replays_its_own_inputs_after_their_memory_is_reused():
    """The limit's graph reads its token ids by address, so they must live as long as the graph.
    They did not: freed when ``limit_graph`` returned, their memory went to later allocations, and
    on the H200 the replays read ids out of the vocabulary (a device-side assert at batch 8)."""
    from toys.models import reset_caches

    model = suite_models.toy_model("tiny", "cuda")
    with torch.inference_mode():
        replay, _ = suite_variants.limit_graph(model, batch=2, prompt=8, device="cuda")
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
    host_speed.fast_host_times(rows)
    host_speed.fast_host_times(rows, fastest=8.0)  # the process's fastest probe counts when faster
    assert [(r.get("fast_host_rounds"), r.get("step_ms_fast_host")) for r in rows] == [
        (1, 0.70),
        (0, None),
        (0, None),
        (None, None),
    ]
    host_speed.fast_host_times(rows)
    assert [(r.get("fast_host_rounds"), r.get("step_ms_fast_host")) for r in rows] == [
        (2, 0.705),
        (2, 0.85),
        (0, None),
        (None, None),
    ]
    assert rows[0]["host_probe_fastest_us"] == 10.0
    ratios = {r["variant"]: r for r in plot.ratios_to_limit(rows)}
    assert ratios["piecewise"]["vs_limit"] == round(1.0 / 0.71, 3)
    assert ratios["piecewise"]["vs_limit_fast_host"] == round(0.85 / 0.705, 3)
    assert "vs_limit_fast_host" not in ratios["eager"]
    assert "| piecewise | 1.21× |" in plot.ratio_table(rows, "step_ms_fast_host")


def test_host_probe_times_python_in_microseconds():
    from benchmarks.timing import host_probe_us

    assert 0 < host_probe_us(reps=3) < 1e5


def test_a_settled_probe_waits_for_the_host_at_full_speed(monkeypatch):
    """Probes slower than ``FAST_HOST`` times the fastest so far are taken again, up to the wait."""
    probes = iter([10.0, 30.0, 29.0, 11.0, 40.0])
    monkeypatch.setattr(host_speed, "host_probe_us", lambda: next(probes))
    monkeypatch.setattr(host_speed, "FASTEST_PROBE", [float("inf")])
    monkeypatch.setattr(host_speed.time, "sleep", lambda s: None)
    assert host_speed.settled_probe(0) == 10.0
    assert host_speed.settled_probe(60) == 11.0  # 30 and 29 waited out
    assert host_speed.settled_probe(0) == 40.0  # no wait allowed: the slow probe is what it is


def test_ratios_to_limit_and_table():
    rows = [
        {"model": "m", "variant": "limit", "batch": 1, "step_ms": 0.5},
        {"model": "m", "variant": "piecewise", "batch": 1, "step_ms": 0.6},
        {"model": "m", "variant": "inductor", "batch": 1, "step_ms": None, "error": "boom"},
    ]
    assert plot.ratios_to_limit(rows) == [
        {"model": "m", "variant": "limit", "batch": 1, "vs_limit": 1.0},
        {"model": "m", "variant": "piecewise", "batch": 1, "vs_limit": 1.2},
    ]
    table = plot.ratio_table(rows)
    assert "| piecewise | 1.20× |" in table and "| inductor | error |" in table
    assert "| eager |" not in table  # a variant with no row gets no line
    rows.append({"model": "m", "variant": "piecewise+pinned-sdpa", "batch": 1, "step_ms": 0.55})
    lines = plot.ratio_table(rows).splitlines()
    assert lines[2:5] == ["| inductor | error |", "| piecewise | 1.20× |", "| piecewise+pinned-sdpa | 1.10× |"]


def test_ratio_uses_the_limit_of_the_rows_own_process():
    rows = [
        {"model": "m", "variant": "limit", "batch": 1, "step_ms": 0.5, "limit_same_process_ms": 0.5},
        {"model": "m", "variant": "eager", "batch": 1, "step_ms": 6.0, "limit_same_process_ms": 0.6},
        {"model": "m", "variant": "piecewise", "batch": 1, "step_ms": 0.6},
    ]
    assert [r["vs_limit"] for r in plot.ratios_to_limit(rows)] == [1.0, 10.0, 1.2]
    assert "| eager | 10.00× |" in plot.ratio_table(rows)
    for row, pipelined in zip(rows, (0.4, 4.0, 0.5)):
        row["pipelined_ms"] = pipelined
    rows[1]["limit_same_process_pipelined_ms"] = 0.5
    assert [r["pipelined_vs_limit"] for r in plot.ratios_to_limit(rows)] == [1.0, 8.0, 1.25]
    assert "| eager | 8.00× |" in plot.ratio_table(rows, "pipelined_ms")


def test_figure_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        {"model": "m", "variant": v, "batch": b, "step_ms": ms}
        for v, ms in (("eager", 8.0), ("piecewise", 1.0), ("limit", 0.7))
        for b in (1, 8, 32)
    ]
    png = tmp_path / "fig.png"
    plot.plot(rows, png)
    assert png.stat().st_size > 1000
    for row in rows:
        row["pipelined_ms"] = row["step_ms"] * 0.9
    plot.plot(rows, png)  # the pipelined view adds a row of panels: a taller figure
    from matplotlib.image import imread

    assert imread(png).shape[0] > 1.5 * 4.5 * 120


def test_merge_keeps_same_hash_rows_and_drops_stale_ones():
    old = [
        {"model": "a", "variant": "eager", "batch": 1, "step_ms": 1.0, "code_hash": "h1"},
        {"model": "b", "variant": "eager", "batch": 1, "step_ms": 2.0, "code_hash": "h1"},
        {"model": "c", "variant": "eager", "batch": 1, "step_ms": 3.0, "code_hash": "old"},
    ]
    new = [{"model": "a", "variant": "eager", "batch": 1, "step_ms": 1.5}]
    merged = record.merge_rows(old, new, ("model", "variant", "batch"), "h1")
    assert [(r["model"], r["step_ms"], r["code_hash"]) for r in merged] == [("b", 2.0, "h1"), ("a", 1.5, "h1")]


def test_notes_about_an_earlier_run_go_when_its_rows_do():
    result = {
        "code_hash": "old",
        "tests_note": "1 failure was ...",
        "decode_note": "four processes ...",
        "peer_process_rows": [{"variant": "limit", "code_hash": "old"}, {"variant": "limit", "code_hash": "new"}],
    }
    same = dict(result, code_hash="new")
    record.drop_stale_notes(same, "new", {"suite"})  # another part of the same run: its note stays
    assert (
        same["decode_note"]
        and same["tests_note"]
        and same["peer_process_rows"] == [{"variant": "limit", "code_hash": "new"}]
    )
    record.drop_stale_notes(result, "new", {"suite", "tests"})
    assert "decode_note" not in result and "tests_note" not in result
    assert result["peer_process_rows"] == [{"variant": "limit", "code_hash": "new"}]
    stale_only = {
        "code_hash": "old",
        "peer_process_rows": [{"code_hash": "old"}],
        "host_breakdown_more": [{"code_hash": "old"}],
    }
    record.drop_stale_notes(stale_only, "new", {"suite"})
    assert "peer_process_rows" not in stale_only and stale_only["host_breakdown_more"]  # not a host part
    record.drop_stale_notes(stale_only, "new", {"host"})
    assert "host_breakdown_more" not in stale_only


def test_a_tests_run_of_a_selection_says_which(tmp_path):
    """A device run of some of the CUDA tests must not read as the whole suite's result."""
    import json

    junit = tmp_path / "pytest.xml"
    junit.write_text('<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1"/></testsuites>')
    out = tmp_path / "h200.json"
    for selection in ([], ["--tests-selection", "-m cuda -k 'not hf'"]):
        _run_script(
            [
                "-m",
                "benchmarks.record",
                "--junit",
                str(junit),
                "--previous",
                str(tmp_path / "none.json"),
                "--out",
                str(out),
                *selection,
            ]
        )
        tests = json.loads(out.read_text())["tests"]
        assert (tests["passed"], tests["failed"], tests["skipped"]) == (3, 1, 1)
        assert tests.get("selection") == (selection[1] if selection else None), tests


def test_shards_junit_files_are_summed_and_startup_rows_stamped(tmp_path):
    """``record.py --junit`` over the shards of ``run_device.sh cuda-tests`` and ``--hf-startup``."""
    import json

    shards = []
    for i, (tests, failures) in enumerate(((5, 1), (4, 0))):
        shards.append(tmp_path / f"pytest_{i}.xml")
        shards[-1].write_text(
            f'<testsuites><testsuite tests="{tests}" failures="{failures}" errors="0" skipped="1"/></testsuites>'
        )
    startup = tmp_path / "startup.json"
    startup.write_text(json.dumps({"hf_startup": [{"model": "qwen3", "layers": 4, "cache": "dynamic", "cold_s": 9.0}]}))
    out = tmp_path / "h200.json"
    _run_script(
        [
            "-m",
            "benchmarks.record",
            "--junit",
            *map(str, shards),
            "--hf-startup",
            str(startup),
            "--previous",
            str(tmp_path / "none.json"),
            "--out",
            str(out),
            "--tests-collected",
            "12",
        ]
    )
    result = json.loads(out.read_text())
    assert (result["tests"]["passed"], result["tests"]["failed"], result["tests"]["skipped"]) == (6, 1, 2)
    assert result["tests"]["not_run"] == 3  # 12 collected, 9 with a result: a shard cut by its timeout
    (row,) = result["hf_startup"]
    assert row["cold_s"] == 9.0 and row["code_hash"] == result["tests"]["code_hash"]
    assert row["specialize_float"] is False  # a row from before the option: torch's default


def test_results_are_filed_by_the_kind_of_gpu():
    """``run_device.sh`` records into ``results/<gpu_slug>.json``: the device lends H100s and H200s
    from call to call, and rows of one must not be merged with (or divided by) rows of the other."""
    assert record.gpu_slug("NVIDIA H200") == "h200"
    assert record.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert record.gpu_slug("NVIDIA A100-SXM4-80GB") == "a100"


def test_record_stamps_the_graph_kernels_rows(tmp_path):
    """``record.py --graph-kernels``: ``graph_kernels.py``'s rows, each stamped with the code hash."""
    import json

    kernels = tmp_path / "graph_kernels.json"
    kernels.write_text(
        json.dumps(
            [{"model": "16L-whole-cache", "batch": 8, "limit": {"k": [1.0, 2.0]}, "piecewise": {"k": [1.0, 2.5]}}]
        )
    )
    out = tmp_path / "h200.json"
    _run_script(
        [
            "-m",
            "benchmarks.record",
            "--graph-kernels",
            str(kernels),
            "--previous",
            str(tmp_path / "none.json"),
            "--out",
            str(out),
        ]
    )
    (row,) = json.loads(out.read_text())["graph_kernels"]
    assert row["piecewise"] == {"k": [1.0, 2.5]} and len(row["code_hash"]) == 64


def test_record_merges_seed_workload_rows_of_two_calls(tmp_path):
    """``record.py --seed-workload``: a second call's variants join the first's (same code hash), each
    row stamped; the seed's vLLM numbers travel with them."""
    import json

    def call(variants, previous):
        seed = tmp_path / "seed.json"
        seed.write_text(
            json.dumps(
                {
                    "seed_vllm": {"full": {"tpot_median_ms": 5.33}},
                    "seed_workload": [{"variant": v, "tpot_median_ms": 1.0} for v in variants],
                    "concurrency": [{"variant": v, "in_flight": 8, "out_tok_s": 9.0} for v in variants],
                }
            )
        )
        out = tmp_path / "h200.json"
        _run_script(
            ["-m", "benchmarks.record", "--seed-workload", str(seed), "--previous", str(previous), "--out", str(out)]
        )
        return out

    first = call(["eager", "piecewise"], tmp_path / "none.json")
    result = json.loads(call(["inductor"], first).read_text())
    assert [r["variant"] for r in result["seed_workload"]] == ["eager", "piecewise", "inductor"]
    assert {(r["variant"], r["in_flight"]) for r in result["concurrency"]} == {
        ("eager", 8),
        ("piecewise", 8),
        ("inductor", 8),
    }
    assert all(len(r["code_hash"]) == 64 for r in result["seed_workload"] + result["concurrency"])
    assert result["seed_vllm"]["full"]["tpot_median_ms"] == 5.33


def test_suites_of_two_processes_merge_and_divide_by_the_other_processes_limit(tmp_path):
    """What ``run_device.sh suite-apart`` relies on: the limit and the floor recorded from one process,
    piecewise from another (``coresidence.py``: building the limit slows the piecewise step), both
    rows kept, and piecewise divided by the limit row of its model and batch."""
    import json

    out = tmp_path / "h200.json"
    previous = tmp_path / "none.json"
    for name, rows in (
        (
            "limit",
            [
                {"model": "m", "variant": "limit", "batch": 8, "step_ms": 0.68},
                {"model": "m", "variant": "dynamo-floor", "batch": 8, "step_ms": 0.74, "limit_same_process_ms": 0.68},
            ],
        ),
        ("piecewise", [{"model": "m", "variant": "piecewise", "batch": 8, "step_ms": 0.78}]),
    ):
        part = tmp_path / f"suite_{name}.json"
        part.write_text(json.dumps({"decode": rows}))
        _run_script(["-m", "benchmarks.record", "--suite", str(part), "--previous", str(previous), "--out", str(out)])
        previous = out
    result = json.loads(out.read_text())
    assert sorted(r["variant"] for r in result["decode"]) == ["dynamo-floor", "limit", "piecewise"]
    ratios = {r["variant"]: r["vs_limit"] for r in result["vs_limit"]}
    assert ratios == {"limit": 1.0, "dynamo-floor": round(0.74 / 0.68, 3), "piecewise": round(0.78 / 0.68, 3)}


def test_rows_say_what_shared_their_process_and_its_limit():
    args = argparse.Namespace(models=["tiny"], batches=[1, 2], variants=["eager", "limit"], rounds=3)
    rows = [{"variant": "eager", "step_ms": 5.0}, {"variant": "limit", "step_ms": 0.5}]
    suite._mark_process(rows, args)
    assert rows[0]["process"] == rows[1]["process"] == "tiny b1/2, interleaved: eager, limit"
    assert rows[0]["limit_same_process_ms"] == 0.5 and "limit_same_process_ms" not in rows[1]
    failed_limit = [{"variant": "eager", "step_ms": 5.0}, {"variant": "limit", "step_ms": None}]
    suite._mark_process(failed_limit, argparse.Namespace(models=["tiny"], batches=[1], variants=["eager", "limit"]))
    assert "one at a time" in failed_limit[0]["process"] and "limit_same_process_ms" not in failed_limit[0]


def _run_script(args: list, cwd=ROOT) -> str:
    import subprocess

    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_startup_row_splits_the_time_to_first_output():
    """What a device run's ``--startup`` does per variant, on the tiny model (a fresh process)."""
    import json

    row = json.loads(
        _run_script(["-m", "benchmarks.suite", "--first-output", "piecewise", "--models", "tiny", "--device", "cpu"])
        .strip()
        .splitlines()[-1]
    )
    parts = row["before_compile_s"] + row["compile_s"] + row["first_run_s"]
    assert row["compile_s"] > 0 and abs(parts - row["seconds"]) < 0.01, row
    assert row["inductor_graphs"] == 3 and row["backend_s"]["inductor"] > 0, row


@pytest.mark.parametrize("model", ["tiny", "tiny-whole-cache"])
def test_host_breakdown_of_the_default_one_graph_decode_step(tmp_path, model):
    import json

    out = tmp_path / "host.json"
    _run_script(["-m", "benchmarks.host_breakdown", "--model", model, "--steps", "5", "--json", str(out)])
    step = json.loads(out.read_text())["step"]
    assert step["graph_attention"] and step["pieces"] == 1, step  # the decode step is one graph
    assert step["us_per_step"]["whole call (enqueue, no sync)"] > 0 and step["us_per_step"]["eager pieces"] == 0


def test_ab_versions_summarises_medians_and_ratio():
    from benchmarks import ab_versions

    def rows(limit, piecewise):
        return ab_versions._with_ratios(
            [
                {"model": "m", "variant": "limit", "batch": 1, "step_ms": limit},
                {"model": "m", "variant": "piecewise", "batch": 1, "step_ms": piecewise},
            ]
        )

    runs = {
        "A": [rows(1.0, 1.5), rows(1.0, 1.3), rows(2.0, 1.4)],
        "B": [rows(1.0, 1.2), rows(1.0, 1.1), rows(1.0, 9.0)],
    }
    piecewise = next(r for r in ab_versions._summary(runs) if r["variant"] == "piecewise")
    assert piecewise["A_step_ms"] == 1.4 and piecewise["B_step_ms"] == 1.2 and piecewise["B_over_A"] == 0.857
    assert piecewise["A_vs_limit"] == 1.3 and piecewise["B_vs_limit"] == 1.2


def test_ab_versions_runs_each_versions_own_suite(tmp_path):
    """Both sides the same checkout here (CI's clone may lack other revisions); on the device they are
    two exports (``--export REV DIR``)."""
    import json

    root = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / "ab.json"
    _run_script(
        [
            "-m",
            "benchmarks.ab_versions",
            str(root),
            str(root),
            "--models",
            "tiny",
            "--batches",
            "2",
            "--steps",
            "3",
            "--prompt",
            "4",
            "--rounds",
            "1",
            "--variants",
            "piecewise",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert result["versions"]["A"]["code_hash"] == record.code_hash(root)
    (row,) = result["summary"]
    assert row["variant"] == "piecewise" and row["A_step_ms"] > 0 and row["B_over_A"] is not None, row


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_gpu_timed_records_events_and_waits_only_when_asked():
    timed = timing.GpuTimed(lambda: torch.ones(1024, device="cuda").mul_(2), "cuda")
    outs = [timed() for _ in range(6)]
    assert len(timed.marks) == 6 and all(isinstance(m, torch.cuda.Event) for pair in timed.marks for m in pair)
    assert timed.median_ms(6) > 0  # elapsed_time raises on an event that has not completed: the wait worked
    assert all(float(o[0]) == 2.0 for o in outs)


def test_hf_generate_rows_time_decode_steps_and_compare_tokens(tmp_path):
    """``hf_generate.py`` on CPU, two interleaved rounds: an eager row first (the reference), then a
    piecewise row with its token agreement, speed-up and the decode graph's facts, one row per
    variant with a time per round; a variant that fails is a row with its error, once."""
    pytest.importorskip("transformers")
    import statistics

    from benchmarks import hf_generate

    rows: list = []
    hf_generate.bench_model(
        "tiny", [2], 5, ["eager", "piecewise-static", "no-such-variant"], rows, lambda: None, "cpu", rounds=2
    )
    by_variant = {r["variant"]: r for r in rows}
    assert [r["variant"] for r in rows] == ["eager", "piecewise-static", "no-such-variant"]
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
    from benchmarks import hf_generate

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
    before = hf_generate.graph_calls()
    old.stats.calls, new.stats.calls = 110, 30
    assert hf_generate.piecewise_facts(before)["captures"] == 2
    assert hf_generate.piecewise_facts()["captures"] == 1  # without a baseline: the busiest overall


def test_hf_generate_builds_each_architecture_at_a_depth_and_refuses_an_unknown_key():
    """``ARCH-NL-DIMS`` keys (the issue's Qwen3, Phi-3, Gemma 3 rows), built on the meta device."""
    pytest.importorskip("transformers")
    from benchmarks import hf_generate

    for key, cls, layers in (
        ("qwen3-4L-512", "Qwen3ForCausalLM", 4),
        ("phi3-28L-1.5b", "Phi3ForCausalLM", 28),
        ("gemma3-4L-512", "Gemma3ForCausalLM", 4),
        ("8L-512", "LlamaForCausalLM", 8),
    ):
        model = hf_generate.build_model(key, "meta", torch.bfloat16)
        assert (
            type(model).__name__ == cls and model.config.num_hidden_layers == layers and model.dtype == torch.bfloat16
        )
        assert hf_generate.model_config(key)[3] == layers
    with pytest.raises(ValueError, match="unknown model 'mamba-4L-512'.*ARCH-NL-DIMS"):
        hf_generate.model_config("mamba-4L-512")


def test_hf_startup_times_the_recipes_start_and_the_first_calls_at_a_new_batch_and_length():
    """``hf_startup.py``'s child on CPU (graphs emulated): the README's start-up (batch 1, then 2),
    after which a new batch size and a longer ``max_new_tokens`` compile nothing."""
    pytest.importorskip("transformers")
    import piecewise_backend
    from benchmarks import hf_startup

    torch._dynamo.reset()
    with piecewise_backend.emulated_graphs():
        row = hf_startup.first_calls("tiny", "dynamic", "piecewise", "cpu", torch.float32, after_start=True)
    assert row["compiles_after_start"] == 0, row
    assert row["start_s"] > 0 and row["new_batch_s"] >= 0 and row["new_length_s"] >= 0
    assert row["backend_build_s"] > 0 and "capture_s" in row
    assert 0 < row["backend_inductor_s"] <= row["backend_build_s"] and row["inductor_compiles"] >= 2, row
    # the breakdown: prefill and decode are Dynamo graphs of their own; the backend is part of their compile
    assert row["dynamo_frames"] >= 2 and row["dynamo_traces"] >= row["dynamo_frames"], row
    assert (
        0
        < row["backend_call_s"]
        <= row["dynamo_compile_s"]
        <= row["start_s"] + row["new_batch_s"] + row["new_length_s"]
    )


def test_threads_benchmark_counts_a_neighbours_errors_and_concurrent_callers_outputs():
    """``threads.py``'s two scenarios on CPU (graphs emulated, so captures and replays happen): the
    neighbour thread ran and erred nowhere, every call was compared with eager."""
    pytest.importorskip("transformers")
    import piecewise_backend
    from benchmarks import threads

    with piecewise_backend.emulated_graphs():
        torch._dynamo.reset()
        seen = threads.background("cpu", 6)
        torch._dynamo.reset()
        calls = threads.concurrent("cpu", 12)
    assert seen["background_calls"] == 6 and seen["background_wrong"] == 0, seen
    assert seen["background_iterations"] > 0 and seen["background_errors"] == 0, seen
    assert seen["captures"] > 0 and seen["failed_captures"] == 0, seen
    assert calls == {"concurrent_calls": 12, "concurrent_wrong": 0, "concurrent_errors": 0, "concurrent_threads": 2}


def test_serving_benchmark_times_an_engine_and_counts_its_captures_and_replaced_sizes():
    """``serving.py``'s row on CPU (graphs emulated): the engine warmed up, served a trace, and with
    ``max_captured_sizes=8`` the sizes captured followed the traffic (lazy captures happened while
    serving, and show as stalls)."""
    import piecewise_backend
    from benchmarks import serving

    args = argparse.Namespace(
        config="tiny", requests=10, rate=0.0, max_num_tokens=32, max_num_seqs=4, agreement_requests=3
    )
    with piecewise_backend.emulated_graphs():
        torch._dynamo.reset()
        row = serving.serve(args, "piecewise-cap8", "cpu")
        agreement = serving.agreement(args, "piecewise", "cpu")
    assert row["output_tokens"] > 0 and row["tokens_per_s"] > 0 and row["itl_p50_ms"] > 0, row
    assert 0 < row["captures"] and row["failed_captures"] == 0 and row["replays"] > 0, row
    assert row["worst_capture_stall_ms"] is not None and row["steps"] > 0
    assert agreement == 1.0


def test_dynamo_entry_benchmark_times_each_guard_filter():
    pytest.importorskip("transformers")
    from benchmarks import dynamo_entry

    rows = dynamo_entry.entry_us(1, "cpu")
    variants = [r["variant"] for r in rows]
    assert variants[0] == "guards" and variants[-1] == "set_stance(skip_guard_eval_unsafe=True)" and len(rows) >= 3
    assert all(r["entry_us"] > 0 for r in rows), rows


def test_profile_build_profiles_the_backends_build_only():
    """``profile_build.py`` on CPU (graphs emulated, as on CUDA): the build's total and Inductor share,
    then the backend's own functions by cumulative time."""
    pytest.importorskip("transformers")
    out = _run_script(
        ["-m", "benchmarks.profile_build", "--model", "tiny", "--cache", "static", "--device", "cpu", "--top", "6"]
    )
    head = out.splitlines()[0]
    assert head.startswith("generate ") and "Inductor" in head and "compiles" in head, out[:500]
    assert "piecewise_backend/backend.py" in out and "(build)" in out, out[:3000]


def test_seed_workload_times_the_engine_as_vllm_bench_serve_and_sweeps_concurrency():
    """``seed_workload.py``'s rows on CPU (graphs emulated): vLLM's serving metrics over a seeded trace,
    the full graphs and piecewise graphs it used, a sweep row per level, and the figure."""
    import piecewise_backend
    from benchmarks import seed_workload

    args = argparse.Namespace(
        config="tiny", device="cpu", requests=4, rate=0.0, in_flight=[1, 3], max_num_tokens=32, agreement_variants=""
    )
    with piecewise_backend.emulated_graphs():
        torch._dynamo.reset()
        row, sweep = seed_workload.serve(args, "full-and-piecewise")
    for name in ("ttft", "tpot", "itl"):
        assert row[f"{name}_median_ms"] > 0 and row[f"{name}_p99_ms"] >= row[f"{name}_median_ms"], row
    assert row["full_replays"] > 0 and row["piecewise_replays"] > 0 and row["full_fallbacks"] == 0, row
    assert row["out_tok_s"] > 0 and row["requests"] == 4 and row["inductor_cache"] in ("cold", "warm", "mixed")
    assert [(r["in_flight"], r["out_tok_s"] > 0) for r in sweep] == [(1, True), (3, True)]
    assert [r["decode_batch_median"] for r in sweep][0] == 1 and all(r["decode_step_median_ms"] > 0 for r in sweep)
    assert all(r["decode_steps"] > 0 and "floor_ms" not in r for r in sweep)  # no floor without a GPU's bandwidth
    done = [toy_request(i, [0, 1], [5, 6, 7], arrival=0.5 * i) for i in range(2)]
    metrics = seed_workload.latencies(done, start=100.0)
    assert metrics["ttft_median_ms"] == pytest.approx(1000.0) and metrics["tpot_median_ms"] == pytest.approx(500.0)


def test_a_decode_steps_floor_is_the_weights_once_and_its_rows_keys():
    """``floor_ms``: the bytes a decode step must read (every weight once, a key and a value per cached
    token per layer) over the copy bandwidth; ``vs_floor`` each step over its own floor."""
    from benchmarks.seed_workload import StepFloor
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


def test_paged_kernel_benchmark_rows_carry_the_issues_schema(tmp_path):
    """``paged_kernel.py --smoke`` (CPU: the reference path checked against SDPA, no timing): one row per
    (B, context), each naming its GPU and code hash; record.py files them under ``"paged_kernel"``."""
    import json

    out = tmp_path / "k.json"
    _run_script(["-m", "benchmarks.paged_kernel", "--out", str(out), "--smoke"])
    rows = json.loads(out.read_text())["paged_kernel"]
    assert [(r["B"], r["context"]) for r in rows] == [(1, 40), (8, 40)]
    for row in rows:
        assert {"B", "context", "paged_us", "sdpa_us", "floor_us", "gpu", "code_hash"} <= set(row)
        assert row["gpu"] == "cpu" and len(row["code_hash"]) == 64
    recorded = tmp_path / "h.json"
    _run_script(
        [
            "-m",
            "benchmarks.record",
            "--paged-kernel",
            str(out),
            "--previous",
            str(tmp_path / "no.json"),
            "--out",
            str(recorded),
        ]
    )
    assert [(r["B"], r["context"]) for r in json.loads(recorded.read_text())["paged_kernel"]] == [(1, 40), (8, 40)]


def toy_request(i, prompt, output, arrival):
    """A finished request whose tokens came at 101 s + arrival, then every 0.5 s."""
    from toys.engine import Request

    request = Request(i, prompt, len(output), arrival, list(output))
    request.token_times = [101.0 + arrival + 0.5 * k for k in range(len(output))]
    return request


def test_second_call_rows_are_filed_as_hf_second_call(tmp_path):
    """``hf_generate.py``'s second-call variant (a new static cache length in a second ``generate()``)
    goes to its own key; the other rows stay under ``"hf"``."""
    import json

    rows = [
        {"model": "granite", "layers": 28, "cache": "static", "batch": 1, "variant": v, "ms_per_token": ms}
        for v, ms in (("eager", 20.0), ("piecewise-static-second-call", 5.0))
    ]
    hf = tmp_path / "hf.json"
    hf.write_text(json.dumps({"hf": rows, "torch": "2.13", "transformers": "5.17"}))
    out = tmp_path / "h200.json"
    _run_script(
        ["-m", "benchmarks.record", "--hf", str(hf), "--previous", str(tmp_path / "none.json"), "--out", str(out)]
    )
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["hf"]] == ["eager"]
    assert [r["variant"] for r in result["hf_second_call"]] == ["piecewise-static-second-call"]
    assert result["hf_second_call"][0]["code_hash"] == result["hf"][0]["code_hash"]


def test_hf_generate_second_call_times_a_generate_with_a_new_static_cache_length():
    """``piecewise-static-second-call``: a first ``generate()`` at a quarter of the tokens, then the
    timed one (a new static cache, new length): eager's tokens, and the whole call's time beside the
    per-step one (graphs emulated: the decode steps are served by them)."""
    pytest.importorskip("transformers")
    import piecewise_backend
    from benchmarks import hf_generate

    rows: list = []
    with piecewise_backend.emulated_graphs():
        hf_generate.bench_model("tiny", [1], 8, ["eager", hf_generate.SECOND_CALL], rows, lambda: None, "cpu")
    second = rows[1]
    assert second["variant"] == hf_generate.SECOND_CALL and second["cache"] == "static", second
    assert second["token_agreement"] == 1.0 and second["call_ms_per_token"] >= second["ms_per_token"] > 0, second
    assert second["replays"] > 0 and second["ungraphed_runs"] == 0, second


def test_hybrid_check_row_says_tokens_and_the_share_of_decode_calls_graphed():
    """``hybrid_check.py``'s row on CPU (graphs emulated; no Inductor, for time)."""
    pytest.importorskip("transformers")
    import piecewise_backend
    from benchmarks import hybrid_check

    with piecewise_backend.emulated_graphs():
        row = hybrid_check.check("exaone4", "dynamic", 3, 4, 6, "cpu", "eager")  # sliding, sliding, full
    assert row["same_tokens"] and row["decode_calls"] == 10, row
    assert row["decode_share_graphed"] >= 0.9 and row["captures"] > 0, row
    assert row["layer_types"].count("sliding_attention") >= 1, row


def test_triton_compiles_are_counted_per_put_group_and_not_per_cache_hit(tmp_path, monkeypatch):
    """``start_up.py``'s ``triton_compiles``: Triton writes a kernel's group once, when it compiles it."""
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
