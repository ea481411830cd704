"""Suite ``reliability``: outputs against eager under random models (``fuzz``), lazy capture inside a
live process (``threads``: another thread's CUDA work during captures, concurrent callers), and the
package's CUDA tests (``cuda-tests``), and which calls of a neighbour thread an open capture
tolerates (``capture-neighbours``).

    python -m benchmarks reliability [--variants fuzz,threads] [--calls 200] [--concurrent 400] [--capture-modes]
    python -m benchmarks reliability --smoke      # CPU: graphs emulated, a few calls and models

``fuzz``: ``tests/fuzz`` (its ``__main__`` says what it checks): random models compiled with the
backend beside their eager twins, step by step, with a neighbour thread beside the whole run
(``--threads``), then, on a GPU, one model's memory over many replays; ``wrong`` counts every
output, buffer or view that differs from eager's.

``cuda-tests``: ``pytest -m cuda`` over ``--tests`` (its counts, the tests that failed by name, and the
transformers it ran with); ``--tests-procs N`` deals the collected tests round-robin to N pytest
processes at once (Inductor's compiles are CPU-bound and the models tiny, so N of them share one GPU
and the counts add up in one row); ``--row-name`` names the row (a run in another environment, e.g.
newer transformers, then keeps the image's row at the same code hash).

``threads``:
The model is transformers' ``LlamaForCausalLM`` (4 layers, hidden 256, random weights, fp32), its
``forward`` compiled with ``backend="piecewise"`` and the batch marked dynamic, prompts of 8 tokens.

* ``background``: the main thread makes ``--calls`` calls at random batch sizes 1..64 (so it
  captures lazily, at each new capture size) while a background thread loops what a server's
  output and sampling threads do: ``(y * 2).sum().item()`` (a sync) and
  ``torch.empty(1 << 16, device="cuda").normal_()`` (an allocation and random numbers from the
  default generator). Counted: the background thread's errors, the backend's failed captures and
  un-graphed piece runs, and the main thread's outputs that differ from eager's. Run twice: the
  loop as the issue wrote it, and (``own_generator``) drawing from a ``torch.Generator`` of its own.
* ``concurrent``: after sizes 4, 8 and 16 are captured, two threads, each on a CUDA stream of its
  own, call the one compiled function ``--concurrent`` times in all, batch sizes drawn from
  {4, 8, 16, 5, 12}; each output is compared with eager's on the same input, in the same thread.
* ``single_thread_overhead_us``: what the call guard (``runtime/call_guard.py``) adds to one call
  on one thread: its ``with`` (a lock, the stream-id compare) and the frame around the call's body,
  timed on the host against the bare body, interleaved over rounds (median of the differences).

``--capture-modes`` also runs the background scenario, each in a child process, with the capture
as it was before (torch's default ``"global"`` capture error mode, the default generator registered
with every graph), with ``"thread_local"`` mode alone, and with ``"aside"`` (thread-local, the
default generator's state set aside for ``capture_begin``: the capture of pieces that draw nothing
before ``_torch_internals.cuda_capture.RawGraph``): the evidence for what each part removes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator

import torch

from benchmarks.harness import PREFIX, Suite
from toys.neighbour import Neighbour

TOKENS = 8


def build_model(device: str):
    from benchmarks import hf

    return hf.build_model("4L-256", device)


def compiled_forward(model):
    return torch.compile(model.forward, backend="piecewise")


def ids_of(batch: int, device: str, rng: random.Random) -> torch.Tensor:
    ids = torch.tensor([[rng.randrange(1024) for _ in range(TOKENS)] for _ in range(batch)], device=device)
    if batch > 1:
        torch._dynamo.mark_dynamic(ids, 0)
    return ids


def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    scale = expected.abs().max().item()
    return actual.shape == expected.shape and (actual - expected).abs().max().item() <= 1e-3 * max(scale, 1e-2)


def graph_totals(since: int) -> dict:
    """The backend's counts over the graphs compiled after serial ``since`` (``misses``: calls the
    capture policy ran un-graphed, by reason; failed captures are ``failed_captures``)."""
    import collections

    import piecewise_backend

    graphs = [g for g in piecewise_backend.compiled_graphs() if g.serial > since]
    misses = collections.Counter()
    for g in graphs:
        misses.update({str(k): v for k, v in g.stats.misses.items()})
    return {
        "failed_captures": sum(g.stats.failed_captures for g in graphs),
        "ungraphed_runs": sum(g.stats.ungraphed_runs for g in graphs),
        "replays": sum(g.stats.replays for g in graphs),
        "captures": sum(g.stats.captures for g in graphs),
        "misses": dict(misses),
    }


def last_serial() -> int:
    import piecewise_backend

    graphs = piecewise_backend.compiled_graphs()
    return graphs[-1].serial if graphs else 0


def background(device: str, calls: int, seed: int = 0, own_generator: bool = False) -> dict:
    """The main thread's lazily capturing calls beside ``Neighbour``'s loop; ``own_generator``: the
    loop draws its random numbers from a generator of its own instead of the default one."""
    since = last_serial()
    model = build_model(device)
    forward = compiled_forward(model)
    rng = random.Random(seed)
    wrong = 0
    other = Neighbour(device, own_generator)
    with torch.no_grad():
        forward(ids_of(2, device, rng))  # compiled before the other thread starts: captures are what is measured
        other.start()
        start = time.perf_counter()
        for _ in range(calls):
            ids = ids_of(rng.randint(1, 64), device, rng)
            out = forward(ids).logits
            wrong += not close(out, model(ids).logits)
        seconds = time.perf_counter() - start
        other.finish()
    return {
        "background_errors": other.error_count,
        "background_error_kinds": other.errors,
        "background_iterations": other.iterations,
        "background_calls": calls,
        "background_wrong": wrong,
        "background_seconds": round(seconds, 1),
        **graph_totals(since),
    }


def concurrent(device: str, calls: int, threads: int = 2) -> dict:
    model = build_model(device)
    forward = compiled_forward(model)
    rng = random.Random(1)
    with torch.no_grad():
        for batch in (4, 8, 16):  # captured before the threads start
            forward(ids_of(batch, device, rng))
    counts = {"calls": 0, "wrong": 0, "errors": 0}
    lock = threading.Lock()

    def caller(seed: int) -> None:
        local = random.Random(seed)
        stream = torch.cuda.Stream() if device == "cuda" else None
        with torch.no_grad():  # grad mode is per thread
            for _ in range(calls // threads):
                ids = ids_of(local.choice([4, 8, 16, 5, 12]), device, local)
                try:
                    with torch.cuda.stream(stream) if stream is not None else _nothing():
                        out = forward(ids).logits
                        ok = close(out, model(ids).logits)
                except Exception:
                    with lock:
                        counts["errors"] += 1
                    continue
                with lock:
                    counts["calls"] += 1
                    counts["wrong"] += not ok

    workers = [threading.Thread(target=caller, args=(seed,)) for seed in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {
        "concurrent_calls": counts["calls"],
        "concurrent_wrong": counts["wrong"],
        "concurrent_errors": counts["errors"],
        "concurrent_threads": threads,
    }


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def single_thread_overhead_us(device: str, rounds: int = 9, calls: int = 200_000) -> dict:
    """What the call guard adds to one caller's call, in µs: its ``with`` (lock, stream-id compare)
    and the extra frame around the body, timed against the bare body on a host-only stand-in
    (median of interleaved rounds). Host time only: a whole call's timing is noisier than the guard."""
    model = build_model(device)
    forward = compiled_forward(model)
    rng = random.Random(2)
    with torch.no_grad():
        ids = ids_of(4, device, rng)
        forward(ids)
        forward(ids)  # captured, then replayed
    import piecewise_backend

    graph = max(piecewise_backend.compiled_graphs(), key=lambda g: g.stats.replays)
    guard = graph._guard

    def body(args):
        return args

    def guarded(*args):  # what CompiledGraph.__call__ adds around its body
        if graph._graphs_off:
            return body(args)
        with guard:
            return body(args)

    runs = {"guarded": lambda: guarded(1), "bare": lambda: body((1,))}
    diffs = []
    for r in range(rounds):
        times = {}
        for name in sorted(runs, reverse=r % 2 == 1):  # each goes first in every other round
            run = runs[name]
            start = time.perf_counter()
            for _ in range(calls):
                run()
            times[name] = (time.perf_counter() - start) / calls
        diffs.append((times["guarded"] - times["bare"]) * 1e6)
    return {
        "single_thread_overhead_us": round(statistics.median(diffs), 3),
        "single_thread_overhead_rounds_us": [round(d, 3) for d in diffs],
    }


def _run_child(mode: str, args) -> dict:
    """The background scenario with an older capture, in a process of its own (``--as-mode``)."""
    cmd = [sys.executable, "-m", "benchmarks", "reliability", "--as-mode", mode, "--calls", str(args.calls),
           "--device", args.device, "--child", "threads", "--work", args.work]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 240 s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    return json.loads(lines[-1][len(PREFIX) :]) if lines else {"error": done.stderr[-800:]}


def _as_mode(mode: str) -> None:
    """Capture as the backend did before: torch's default global mode, thread-local alone, or
    thread-local with the generator set aside."""
    from piecewise_backend.runtime import devices

    devices._begin_route = lambda: "aside"  # every capture through CUDAGraph.capture_begin, as before
    if mode == "aside":
        return

    def begin(self, graph, pool):
        if mode == "global":
            graph.capture_begin(pool=pool)
        else:
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")

    devices.GeneratorAside.capture_begin = begin


def threads(args) -> dict:
    if args.device == "cpu":  # graphs emulated (compiled graphs read it on this thread)
        import piecewise_backend

        emulating = piecewise_backend.emulated_graphs()  # kept: a dropped one restores the default at once
        emulating.__enter__()
    if args.as_mode:
        _as_mode(args.as_mode)
        return background(args.device, args.calls)
    result = background(args.device, args.calls)
    torch._dynamo.reset()
    own = background(args.device, args.calls, own_generator=True)
    result["own_generator"] = {k: v for k, v in own.items() if k.startswith("background_") or k == "failed_captures"}
    torch._dynamo.reset()
    result.update(concurrent(args.device, args.concurrent))
    torch._dynamo.reset()
    result.update(single_thread_overhead_us(args.device))
    if args.capture_modes:
        result["before"] = {mode: _run_child(mode, args) for mode in ("global", "thread_local", "aside")}
    return result


def cuda_tests(args) -> dict:
    """The CUDA tests of ``--tests`` (pytest ``-m cuda``), in this process's environment: passed, failed
    (by name), skipped, over ``--tests-procs`` pytest processes at once."""
    selection = ["-m", "cuda", *(["-k", args.tests_k] if args.tests_k else []), *args.tests.replace(",", " ").split()]
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    commands = [selection]  # one process: the selection itself
    if args.tests_procs > 1:
        listing = [*pytest, "-s", "-p", __name__, "--collect-only", *selection]  # __name__: the hook below
        listed = subprocess.run(listing, capture_output=True, text=True)
        ids = [line.removeprefix(TEST_ID) for line in listed.stdout.splitlines() if line.startswith(TEST_ID)]
        if not ids:
            raise SystemExit(f"cuda-tests: collected no test from {' '.join(selection)}: {listed.stdout[-400:]}")
        commands = [["-m", "cuda", *ids[i :: args.tests_procs]] for i in range(min(args.tests_procs, len(ids)))]
    runs = []
    for i, command in enumerate(commands):
        junit = f"{args.work}/cuda-tests-{i}.xml"
        proc = subprocess.Popen([*pytest, f"--junitxml={junit}", *command], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        runs.append((junit, proc))
    counts, failed, summary = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0), [], []
    for i, (junit, proc) in enumerate(runs):
        out = proc.communicate()[0].strip()
        if args.tests_logs:  # each process's whole output: the failures' tracebacks
            pathlib.Path(args.tests_logs, f"cuda-tests-{i}.log").write_text(out)
        summary += out.splitlines()[-1:] if out else [f"pytest exited {proc.returncode} and printed nothing"]
        got, names = _junit_counts(junit)
        counts = {k: counts[k] + got[k] for k in counts}
        failed += names
    return {
        "variant": args.row_name,
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"] + counts["errors"],
        "skipped": counts["skipped"],
        "failed_tests": failed,
        "selection": " ".join(selection) + (f", {len(runs)} processes at once" if len(runs) > 1 else ""),
        "transformers": _version_of("transformers"),
        "summary": summary,
    }


TEST_ID = "CUDA-TEST "


def pytest_collection_finish(session) -> None:
    """pytest's hook, in the pytest that ``cuda_tests`` lists the selection with (``-p`` loads this module):
    each test's node id made absolute, which pytest's own ``-q`` listing is not (it is relative to a
    root directory the other processes need not share)."""
    for item in session.items:
        print(f"{TEST_ID}{session.config.rootpath}/{item.nodeid}")


def _version_of(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _junit_counts(path: str) -> tuple[dict, list[str]]:
    """pytest's JUnit XML: its counts and the tests that failed or erred, by name."""
    import xml.etree.ElementTree as ET

    suite = ET.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]  # fmt: skip
    return counts, failed


# -- capture-neighbours ------------------------------------------------------------------------------
# Which CUDA calls of another thread fail, or break the capture, while one thread captures a CUDA graph
# in "thread_local" mode on a non-blocking side stream (what the capture thread does behind the calls).
# Pure torch. Why: the capture thread records while the callers' threads go on, so whatever a caller
# may do then (sync a value, synchronize the device, allocate, free the cache, compile a Triton kernel)
# must be safe beside an open capture. Thread-local mode spares only other threads' *unsafe* calls; a
# device-wide synchronize waits for every stream, the capturing one included (NVIDIA/TensorRT#2888).
# Each action runs once in the main thread while the other holds a capture open; per action: what the
# main thread's call raised ("ok": nothing) and how the capture ended.


def _triton_first_launch(device) -> None:
    """A Triton kernel compiled and loaded at its first launch (a module load)."""
    import triton
    import triton.language as tl

    @triton.jit
    def fill(out, n: tl.constexpr):
        tl.store(out + tl.arange(0, n), tl.arange(0, n).to(tl.float32))

    fill[(1,)](torch.empty(64, device=device), 64)


def _actions(device, x) -> dict:
    def event(sync: bool):
        e = torch.cuda.Event()
        e.record()
        return e.synchronize() if sync else e.query()

    def other_stream():
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        s.synchronize()

    return {
        "launch": lambda: x * 2,
        "item": lambda: x.sum().item(),
        "tolist": lambda: x[:4, 0].tolist(),
        "stream_synchronize": lambda: torch.cuda.current_stream(device).synchronize(),
        "other_stream_synchronize": other_stream,
        "device_synchronize": lambda: torch.cuda.synchronize(device),
        "event_query": lambda: event(False),
        "event_synchronize": lambda: event(True),
        "malloc_1gib": lambda: torch.empty(1 << 30, dtype=torch.uint8, device=device),
        "empty_cache": torch.cuda.empty_cache,
        "pinned_alloc": lambda: torch.empty(1000, pin_memory=True),
        "host_to_device": lambda: torch.arange(100).to(device),
        "triton_first_launch": lambda: _triton_first_launch(device),
    }


def _trial(action, x, side) -> dict:
    opened, done, out = threading.Event(), threading.Event(), {}

    def capture():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            x @ x  # cuBLAS's handle and workspace of this thread, outside the capture
            side.synchronize()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                y = x @ x
                opened.set()
                done.wait(10)
                y + 1
            except Exception as exc:  # noqa: BLE001 - what the capturing thread's own launches met
                out["capturing_thread"] = f"{type(exc).__name__}: {exc}"[:160]
            finally:
                try:
                    graph.capture_end()
                    out["capture"] = "ok"
                except Exception as exc:  # noqa: BLE001
                    out["capture"] = f"{type(exc).__name__}: {exc}"[:160]

    thread = threading.Thread(target=capture)
    thread.start()
    opened.wait(10)
    try:
        action()
        out["neighbour"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the finding
        out["neighbour"] = f"{type(exc).__name__}: {exc}"[:160]
    done.set()
    thread.join()
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - left behind by the action
        out["after"] = f"{type(exc).__name__}: {exc}"[:120]
    return out


def capture_neighbours(device: str) -> dict:
    """One entry per action: {neighbour, capture[, capturing_thread, after]}."""
    if not device.startswith("cuda"):
        return {"error": "capture-neighbours needs a CUDA device"}
    device = torch.device(device)
    x = torch.randn(512, 512, device=device)
    side = torch.cuda.Stream(device)
    torch.cuda.synchronize()
    return {name: _trial(action, x, side) for name, action in _actions(device, x).items()}


def rows(variant: str, args) -> Iterator[dict]:
    warnings.simplefilter("ignore")
    if variant == "cuda-tests":
        yield cuda_tests(args)
        return
    if variant == "threads":
        yield threads(args)
        return
    if variant == "capture-neighbours":
        yield capture_neighbours(args.device)
        return
    from tests.fuzz.__main__ import run

    out = run(args)
    yield {**out, "failures": out["failures"][:10]}


def options(parser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=200, help="threads: calls beside the background thread")
    parser.add_argument("--concurrent", type=int, default=400, help="threads: calls of two threads at once")
    parser.add_argument("--capture-modes", action="store_true", help="threads: the capture as it was, per mode")
    parser.add_argument("--as-mode", choices=["global", "thread_local", "aside"], help=argparse.SUPPRESS)
    parser.add_argument("--tests", default="tests/", help="cuda-tests: the test files (comma-separated)")
    parser.add_argument("--tests-k", default="", help="cuda-tests: pytest's -k expression")
    parser.add_argument("--tests-procs", type=int, default=1, help="cuda-tests: pytest processes at once")
    parser.add_argument("--tests-logs", default="", help="cuda-tests: a folder for each process's output")
    parser.add_argument("--row-name", default="cuda-tests", help="cuda-tests: the row's variant name")
    from tests.fuzz.__main__ import options as fuzz_options

    fuzz_options(parser)


# fmt: off
SUITE = Suite("reliability", "outputs against eager: random models (fuzz), capture beside other threads (threads), CUDA tests",
              ("fuzz", "threads", "cuda-tests", "capture-neighbours"), rows, options, default=("fuzz", "threads"), timeout=900,
              smoke=("--device cpu --calls 12 --concurrent 16 --models 2 --steps 6 --max-batch 20 --replays 0 "
                     "--concurrent-models 1 --concurrent-calls 8").split())
# fmt: on
