"""Tensor parallel on CPU: two gloo ranks, each compiling its shard with the piecewise backend.

The all-reduces are functional collectives inside the compute pieces; with emulated graphs (CPU)
each replay runs them, as a CUDA graph replay runs NCCL's. Checked: both ranks' logits equal the
whole model's over a decode loop whose batch size changes (padded sizes included), and a budget
that only one rank has still makes both capture exactly the same sizes (distributed.py). The same
check runs on GPUs with ``torchrun --nproc-per-node 2 -m toys.parallel`` (from the repository root).
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
ROOT = pathlib.Path(__file__).resolve().parents[1]  # the repository: toys/ and benchmarks/
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fail_capture_at(key: tuple, nth: int) -> None:
    """Make this process's ``nth`` piece capture at ``key`` fail once the graph is built (where a
    CUDA capture fails: after the warm-up, at capture), as a capture error on one rank only would."""
    from piecewise_backend.runtime.capture import piece as piece_capture

    record, seen = piece_capture._record_graph, []

    def failing_record(runner, *args):
        result = record(runner, *args)
        if runner.step.key == key:
            seen.append(runner.name)
            if len(seen) == nth:
                raise RuntimeError("injected capture failure")
        return result

    piece_capture._record_graph = failing_record


def _rank(
    rank: int, port: int, out_dir, options_by_rank: list, emulate: bool, fail_at=None, move_at=None, sizes=None
) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        from piecewise_backend import emulated_graphs
        from toys.parallel import decode_check

        if fail_at is not None and fail_at[0] == rank:
            _fail_capture_at(*fail_at[1:])
        with emulated_graphs(emulate):
            moved = move_at[1] if move_at is not None and move_at[0] == rank else None
            result = decode_check(
                rank,
                WORLD,
                "cpu",
                options=options_by_rank[rank],
                move_weight_before=moved,
                **({"sizes": sizes} if sizes else {}),
            )
        import piecewise_backend

        result["failures"] = [
            f for g in piecewise_backend.compiled_graphs() for p in g.stats.pieces.values() for f in p.failures
        ]
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
        # Neither rank tears gloo down while the other may still be finishing a collective: once, in
        # the whole CPU suite, rank 0 died of SIGABRT ("terminate called without an active
        # exception") on its way out. Only on success: a rank that raised must not wait here.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    (out_dir / f"rank{rank}.exited").write_text("destroy_process_group returned")


def _run_two_ranks(
    out_dir, options: list, emulate: bool, fail_at=None, timeout_s: float = 600, move_at=None, sizes=None
) -> list[dict]:
    """Both ranks' results; fails (instead of hanging) if the ranks do not finish in ``timeout_s``,
    which is what unpaired collectives do."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    context = mp.spawn(
        _rank, args=(_free_port(), out_dir, options, emulate, fail_at, move_at, sizes), nprocs=WORLD, join=False
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"the two ranks did not finish in {timeout_s} s (collectives out of step?)")
    except mp.ProcessExitedException as exc:  # say how far each rank got: computing, or tearing down
        reached = {r: [p.suffix for p in sorted(out_dir.glob(f"rank{r}.*"))] for r in range(WORLD)}
        raise AssertionError(
            f"{exc}; files each rank wrote (.json: results, .exited: after destroy_process_group): {reached}"
        ) from exc
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    # Only rank 0 has a budget (one size). Deciding alone, rank 1 would capture every size it sees
    # while rank 0 ran un-graphed: their collectives would stop pairing up (a hang on NCCL).
    options = [{"capture_sizes": [2, 4, 8], "max_captured_sizes": 1}, {"capture_sizes": [2, 4, 8]}]
    return _run_two_ranks(tmp_path_factory.mktemp("tp"), options, emulate=True)


def test_two_ranks_ungraphed_give_the_whole_models_logits(tmp_path):
    """The plain CPU path (what torchrun with gloo runs): compiled pieces, no graphs."""
    for result in _run_two_ranks(tmp_path, [{}, {}], emulate=False):
        assert result["max_abs_diff"] < 1e-4 and result["replays"] == 0, result


def test_two_ranks_give_the_whole_models_logits(two_ranks):
    for result in two_ranks:
        assert result["max_abs_diff"] < 1e-4, result
        assert result["replays"] > 0 and result["agreement"], result


def test_ranks_agree_on_what_to_capture(two_ranks):
    first, second = two_ranks
    assert first["captured"] == second["captured"] and len(first["captured"]) == 1, two_ranks
    assert first["misses"] == second["misses"] and first["misses"].get("over the capture budget"), two_ranks


def test_a_graph_without_collectives_decides_alone():
    from piecewise_backend.plan.collectives import collective_groups

    graph = torch.fx.symbolic_trace(torch.nn.Linear(4, 4)).graph
    assert collective_groups(graph) == []  # the plan names no groups: no RankAgreement at run time


def test_a_capture_that_fails_on_one_rank_is_given_up_on_both_and_retried_on_both(tmp_path):
    # On rank 1, the decode step's capture at size 4 fails (the 4th piece capture at that key: the
    # first graphs, Dynamo's for positions 0 and 1, captured 3). Alone, rank 1 would run the step
    # un-graphed on its 3 real rows while rank 0 replays the padded graph: their all-reduces would
    # differ in size (gloo aborts, NCCL hangs). Agreed, both give the size-4 graph up; 8 calls at
    # size 4 later (capture_retries.WAITS), both capture it again, at the same call (not deferred:
    # defer_captures would let size 3 ride the graph of 8 for 64 calls first).
    options = [{"capture_sizes": [2, 4, 8], "defer_captures": False}] * WORLD
    sizes = (3, 3, 2, 5, 8, 7, 4) + (3,) * 8
    first, second = _run_two_ranks(tmp_path, options, emulate=True, fail_at=(1, (4,), 4), timeout_s=300, sizes=sizes)
    for result in (first, second):
        assert result["max_abs_diff"] < 1e-4 and result["replays"] > 0, result
    assert any("injected capture failure" in f for f in second["failures"]), second["failures"]
    assert any("failed on another rank" in f for f in first["failures"]), first["failures"]
    at_4 = [event for event in first["capture_events"] if event[0] == [4]]  # [key, call, pieces captured]
    assert len(at_4) == 2 and at_4[0][2] == 0 and at_4[1][2] == 1, first["capture_events"]
    assert first["capture_events"] == second["capture_events"], (first["capture_events"], second["capture_events"])


def test_weights_that_move_on_one_rank_switch_sets_on_both(tmp_path):
    # Before the fourth call (batch 5, replayed padded to 8) rank 1 moves one weight to new memory,
    # and rank 1 keeps one set of weights only. Alone, rank 1 would run that call un-graphed on 5
    # rows while rank 0 all-reduces the padded graph's 8 (gloo aborts, NCCL hangs), then capture
    # the next calls' sizes while rank 0 replays. Agreed: that call runs un-graphed on both ranks,
    # the next switches both ranks to a fresh set, and both capture the same keys again.
    from piecewise_backend.kinds import Miss

    options = [{"capture_sizes": [2, 4, 8]}, {"capture_sizes": [2, 4, 8], "max_weight_sets": 1}]
    first, second = _run_two_ranks(tmp_path, options, emulate=True, move_at=(1, 3), timeout_s=300)
    for result in (first, second):
        assert result["max_abs_diff"] < 1e-4 and result["replays"] > 0, result
        assert result["misses"].get(Miss.WEIGHTS_MOVED) == 1, result
    assert first["captured"] == second["captured"] and first["captures"] == second["captures"], (first, second)
    assert "another rank" in first["miss_details"][Miss.WEIGHTS_MOVED], first
    assert "max_weight_sets=1" in second["miss_details"][Miss.WEIGHTS_MOVED], second


def test_a_hugging_face_model_under_its_own_tp_plan_gives_the_whole_models_tokens(tmp_path):
    """transformers' ``tp_plan="auto"`` (its row-parallel linears all-reduce through
    ``torch.distributed``, which Dynamo traces into collectives), two gloo ranks, emulated graphs:
    the backend finds the collectives (the ranks agree), captures and replays, and greedy decoding
    gives the tokens of the whole model in one process. The suite's smoke run (``python -m benchmarks
    tensor-parallel --smoke``); the same suite times it on two GPUs."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it for tp_plan
    out = tmp_path / "tp.jsonl"
    command = [sys.executable, "-m", "benchmarks", "tensor-parallel", "--smoke", "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = {row["variant"]: row["figures"] for row in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"eager", "piecewise-static"}, rows
    for row in rows.values():
        assert row["token_agreement"] == 1.0, row
    graphed = rows["piecewise-static"]
    assert graphed["graphs_with_collectives"] > 0 and graphed["replays"] > 0 and graphed["captures"] > 0, graphed
    assert graphed["ungraphed_runs"] == 0, graphed


@pytest.mark.cuda
def test_two_gpus_capture_nccl_all_reduces_and_give_the_whole_models_logits():
    """What users launch: torchrun, one process per GPU, NCCL. The all-reduces are inside the
    captured pieces (replays > 0 with NCCL means they ran from a CUDA graph); a deadlock from ranks
    capturing out of step would end in the timeout instead."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from toys.parallel import MULTICAST_OFF

    command = [
        *TORCHRUN,
        "-m",
        "toys.parallel",
    ]
    # its own process group, so a hang (ranks out of step, or a rank that never exits) can be
    # killed whole: torchrun's workers would otherwise keep the GPUs
    run = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **MULTICAST_OFF},
        cwd=ROOT,
    )  # toys/ importable
    try:
        stdout, stderr = run.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, 9)
        stdout, stderr = run.communicate()
        pytest.fail(
            "the two ranks did not finish in 300 s (collectives out of step, or a rank that could "
            f"not exit: graphs holding NCCL collectives still alive at destroy_process_group?)\n"
            f"{stdout[-2000:]}\n{stderr[-2000:]}"
        )
    assert run.returncode == 0, stderr[-4000:]
    results = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in results) == list(range(WORLD)), stdout
    for result in results:
        assert result["max_abs_diff"] < 1e-3, result
        assert result["replays"] > 0 and result["agreement"] and result["captured"], result
    assert results[0]["captured"] == results[1]["captured"], results
