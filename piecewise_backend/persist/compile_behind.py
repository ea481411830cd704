"""Serve first, compile behind (``compiler="eager_then_inductor"``): Inductor in a worker process.

The graph is built with no compiler: its pieces run, and are captured, as Dynamo traced them, so it
serves as soon as Dynamo's trace and the split are done. Meanwhile a worker process
(``compile_worker.py``) compiles each distinct compute piece with Inductor, as a cold build would,
and sends back the compiled code as saved artifacts (``piece_code.py``, the same bytes a saved
graph holds). When they arrive, the graph switches to them between two calls, all its pieces at
once, and captures again (``runtime/code_switch.py``).

Why a process, not a thread: Inductor's compile sets torch's process-wide "FX tracing" flag
(``torch.fx._symbolic_trace``) many times (AOTAutograd's trace, Inductor's own small traces), and
while it is set, any call into a ``torch.compile``'d function on another thread raises "Detected
that you are using FX to symbolically trace a dynamo-optimized function" (seen here with a thread:
``benchmarks/README.md``). A process has its own flag, and its own GIL: serving is not slowed by it.

Why a few workers for the whole process, fed piece by piece: a graph's distinct pieces (its first,
middle and last layers, say) compile independently, and Inductor's lowering of one is single-threaded
Python, so they compile side by side in ``WORKERS`` processes (each with its share of the cores for
Triton's kernels); graphs queue their pieces in the order they were built. An earlier design, one
worker per graph each compiling all its pieces, all at once, with a full pool each, took twice the
in-process compile time (``benchmarks/README.md``). The workers run at a lower CPU priority than the
process they serve (``compile_worker.py``): it is serving.

What the worker gets is run-time values only: each distinct piece's FX code (as torch pickles a
``GraphModule``), its inputs described (``plan.types.TensorSpec``) and a hint for each symbol; it
makes fake inputs of its own. Inductor may assume something of a size while compiling (a guard, such
as ``64*s0 <= 2147483647`` for 32-bit indexing): Dynamo installed this graph's guards long before,
so after the switch each piece checks those assumptions on its own inputs, and a call that breaks
one runs the piece's traced code (``runtime/code_switch.py``).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import torch

from ..plan.types import GraphPlan
from ..runtime.symbolic import spec_symbols
from .frames import read_frame, write_frame
from .piece_code import ArtifactTable, load_code

log = logging.getLogger(__name__)


def job_of(plan: GraphPlan, hints: dict) -> dict:
    """What the worker needs: each distinct piece's FX code and described inputs, a hint per symbol."""
    firsts = sorted({first for first in plan.report.compiled_as.values()})
    symbols = set().union(*(spec_symbols(plan.pieces[name].arg_specs) for name in firsts))
    return {
        "pieces": {name: (pickle.dumps(plan.program.piece(name)), plan.pieces[name].arg_specs) for name in firsts},
        "hints": {sym: int(hints[sym]) if sym in hints else None for sym in symbols},
    }  # None: unbacked


WORKERS_VARIABLE = "PIECEWISE_COMPILE_WORKERS"  # the environment's say in how many processes compile at once


def worker_count() -> int:
    """``$PIECEWISE_COMPILE_WORKERS``, else one.

    One worker given every core for Inductor's own compile pool switched a graph as soon as four
    did, with a quarter of the device memory (each worker holds a CUDA context); more help a process
    whose several graphs would otherwise wait in line."""
    value = os.environ.get(WORKERS_VARIABLE, "")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"piecewise: {WORKERS_VARIABLE}={value!r}: give a whole number of worker processes, "
                f"1 or more (or unset it: one)"
            )
        return int(value)
    return 1


def start_compile_workers(device: str | None = None) -> None:
    """Start the compile workers of ``compiler="eager_then_inductor"`` now, not at the first build.

    A worker's start is a Python process importing torch: seconds. The first build happens after
    Dynamo's trace, so the workers started then are ready only seconds after it; started at the top
    of a serving process, they start while the model loads. Idempotent; the workers are shared by
    every graph of the process. ``device``: what the pieces will run on (default: CUDA if there
    is one), for the tiny compile each worker warms Inductor with."""
    CompileBehind.shared(device or ("cuda" if torch.cuda.is_available() else "cpu"))


class CompileBehind:
    """The process's compile workers, each fed by a thread of its own from one queue of pieces.

    :meth:`shared` starts them when the first graph's build starts, so importing torch and warming
    Inductor's compile pools there overlap the trace and the split; :meth:`submit` queues a graph's
    distinct pieces once its plan is made, one task each, in the order graphs came. A graph's code is
    loaded here, off the serving path, once its last piece is back; then posted to its switch. A
    worker found dead is started again for its next task."""

    _lock = threading.Lock()
    _shared: CompileBehind | None = None

    def __init__(self, workers: int | None = None, device: str | None = None):
        self.tasks: queue.Queue = queue.Queue()
        self.stopping = False
        count = workers or worker_count()
        threads = max(1, (os.cpu_count() or 1) // count)  # the workers' Inductor pools share the cores
        self.env = {"TORCHINDUCTOR_COMPILE_THREADS": str(threads), **os.environ}
        self.workers = [_Worker(self.env, device) for _ in range(count)]
        for i, worker in enumerate(self.workers):
            threading.Thread(
                target=self._feed, args=(worker,), daemon=True, name=f"piecewise-compile-behind-{i}"
            ).start()

    @classmethod
    def shared(cls, device: str | None = None) -> CompileBehind:
        """The process's workers, started now if not yet (``device``: see :func:`start_compile_workers`)."""
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls(device=device)
                atexit.register(cls._shared.stop)
            return cls._shared

    def stop(self) -> None:
        """End the workers (at exit: a compile nobody will switch to is not finished)."""
        self.stopping = True
        for worker in self.workers:
            worker.stop()

    def submit(self, job: dict, attention_ops: frozenset, deliver, plan: GraphPlan, label: str) -> None:
        pending = _PendingGraph(deliver, dict(plan.report.compiled_as), label, len(job["pieces"]))
        for name, piece in job["pieces"].items():
            self.tasks.put(({"pieces": {name: piece}, "hints": job["hints"], "attention_ops": attention_ops}, pending))

    def _feed(self, worker: _Worker) -> None:
        while True:
            task, pending = self.tasks.get()
            try:
                result = worker.compile(task)
            except Exception as exc:  # noqa: BLE001 - whatever fails, the traced code keeps serving
                pending.failed(exc if not self.stopping else None)
                continue
            pending.done(result)


class _Worker:
    """One worker process (``compile_worker.py``), started again if it died."""

    def __init__(self, env: dict, device: str | None):
        self.env, self.device = env, device  # None: no warm-up compile
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        self.stderr = tempfile.TemporaryFile()  # read back only to say why the worker died
        return subprocess.Popen(
            [sys.executable, "-m", "piecewise_backend.persist.compile_worker", *([self.device] if self.device else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=self.env,
        )

    def compile(self, task: dict) -> dict:
        if self.process.poll() is not None:
            self.process = self._start()
        try:
            write_frame(self.process.stdin, task)
            result = read_frame(self.process.stdout)
        except (OSError, EOFError) as exc:
            raise RuntimeError(f"{exc}{self._died()}") from None
        if "error" in result:
            raise RuntimeError(result["error"])
        return result

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()

    def _died(self) -> str:
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # alive: the pipe broke for another reason
            return ""
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace")[-800:]
        return f"; the worker exited with {self.process.returncode}: {tail}"


class _PendingGraph:
    """One graph's pieces out at the workers; when the last is back, its code is loaded and posted."""

    def __init__(self, deliver, compiled_as: dict, label: str, pieces: int):
        self.deliver, self.compiled_as, self.label = deliver, compiled_as, label
        self.lock = threading.Lock()
        self.pieces, self.results, self.errors = pieces, [], []
        self.submitted = time.time()

    def done(self, result: dict) -> None:
        self._one_back(result, None)

    def failed(self, exc: Exception | None) -> None:
        """``exc`` None: the workers were stopped (the process is exiting): nothing to say."""
        self._one_back(None, exc)

    def _one_back(self, result: dict | None, error: Exception | None) -> None:
        with self.lock:
            if result is not None:
                self.results.append(result)
            else:
                self.errors.append(error)
            if len(self.results) + len(self.errors) < self.pieces:
                return
        said = [e for e in self.errors if e is not None]
        if said:
            warnings.warn(
                f"piecewise: graph {self.label}: compiling behind failed ({type(said[0]).__name__}: "
                f"{said[0]}); it keeps running its traced code",
                stacklevel=1,
            )
        if not self.errors:
            self._post()

    def _post(self) -> None:
        compiled = time.time()
        try:
            code = loaded_code(self.results, self.compiled_as)
        except Exception as exc:  # noqa: BLE001 - an artifact that does not load: keep the traced code
            warnings.warn(
                f"piecewise: graph {self.label}: the code compiled behind did not load "
                f"({type(exc).__name__}: {exc}); it keeps running its traced code",
                stacklevel=1,
            )
            return
        seconds = sum(r["seconds"] for r in self.results)
        timeline = {
            "submitted": self.submitted,
            "workers_ready": max(r["ready_at"] for r in self.results),
            "first_piece": min(r["started_at"] for r in self.results),
            "compiled": compiled,
            "loaded": time.time(),
        }  # wall clock (``time.time()``): the workers' clocks are other processes'
        log.info(
            "piecewise: graph %s: compiled behind in %.1f s (%.1f s compiling, over %d pieces), loaded in %.1f s",
            self.label,
            compiled - self.submitted,
            seconds,
            len(self.results),
            timeline["loaded"] - compiled,
        )
        self.deliver(
            {
                "code": code,
                "seconds": seconds,
                "compiles": sum(r["compiles"] for r in self.results),
                "guards": [g for r in self.results for g in r["guards"]],
                "timeline": timeline,
            }
        )


def loaded_code(results: list, compiled_as: dict) -> dict:
    """Every compute piece's compiled code from the workers' results (pieces of the same code share it)."""
    firsts = {}
    for result in results:
        table = ArtifactTable(result["artifacts"])
        firsts.update({name: load_code(saved, table) for name, saved in result["code"].items()})
    return {name: firsts[first] for name, first in compiled_as.items()}
