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

Why one worker for the whole process, its jobs one after another: a serving process builds several
graphs (a prefill and a decode graph, several models), mostly of the same layers. One worker at a
time lets a later graph's pieces hit Inductor's caches the earlier one filled, and keeps to one pool
of compile processes; one worker per graph, all at once, compiled the same layers twice over, every
worker's pool competing for the cores with each other and with the serving process. The worker
runs at a lower CPU priority than the process it serves (``compile_worker.py``).

What the worker gets is run-time values only: each distinct piece's FX code (as torch pickles a
``GraphModule``), its inputs described (``plan.types.TensorSpec``) and a hint for each symbol; it
makes fake inputs of its own. Inductor may assume something of a size while compiling (a guard, such
as ``64*s0 <= 2147483647`` for 32-bit indexing): Dynamo installed this graph's guards long before,
so after the switch each piece checks those assumptions on its own inputs, and a call that breaks
one runs the piece's traced code (``runtime/code_switch.py``).
"""

from __future__ import annotations

import atexit
import functools
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

from ..plan.types import GraphPlan, SymSpec, TensorSpec
from .frames import read_frame, write_frame
from .piece_code import ArtifactTable, load_code

log = logging.getLogger(__name__)


def _symbols(specs) -> set:
    out = set()
    for spec in specs:
        if isinstance(spec, TensorSpec):
            for size in (*spec.shape, *spec.strides):
                out |= set(getattr(size, "free_symbols", ()))
        elif isinstance(spec, SymSpec):
            out |= set(getattr(spec.expr, "free_symbols", ()))
    return out


def job_of(plan: GraphPlan, hints: dict) -> dict:
    """What the worker needs: each distinct piece's FX code and described inputs, a hint per symbol."""
    firsts = sorted({first for first in plan.report.compiled_as.values()})
    symbols = set().union(*(_symbols(plan.pieces[name].arg_specs) for name in firsts)) if firsts else set()
    return {"pieces": {name: (pickle.dumps(plan.program.piece(name)), plan.pieces[name].arg_specs) for name in firsts},
            "hints": {sym: int(hints[sym]) if sym in hints else None for sym in symbols}}  # None: unbacked


class CompileBehind:
    """The process's one compile worker, and the thread that feeds it jobs in the order they came.

    :meth:`shared` starts it when the first graph's build starts, so importing torch and warming
    Inductor's compile pool there overlap the trace and the split; :meth:`submit` queues a graph's
    job once its plan is made. A worker that died is started again by the next build."""

    _lock = threading.Lock()
    _shared: "CompileBehind | None" = None

    def __init__(self):
        self.stderr = tempfile.TemporaryFile()  # read back only to say why the worker died
        self.process = subprocess.Popen([sys.executable, "-m", "piecewise_backend.persist.compile_worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                        env=dict(os.environ))
        self.jobs: queue.Queue = queue.Queue()
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True, name="piecewise-compile-behind")
        self.thread.start()

    @classmethod
    def shared(cls) -> "CompileBehind":
        with cls._lock:
            if cls._shared is None or cls._shared.process.poll() is not None:
                cls._shared = cls()
                atexit.register(cls._shared.stop)
            return cls._shared

    def stop(self) -> None:
        """End the worker (at exit: a compile nobody will switch to is not finished)."""
        self.stopping = True
        self.process.kill()
        self.process.wait()

    def submit(self, job: dict, attention_ops: frozenset, deliver, plan: GraphPlan, label: str) -> None:
        self.jobs.put(({**job, "attention_ops": attention_ops}, deliver, dict(plan.report.compiled_as), label, time.perf_counter()))

    def _serve(self) -> None:
        while True:
            job, deliver, compiled_as, label, queued = self.jobs.get()
            try:
                write_frame(self.process.stdin, job)
                result = read_frame(self.process.stdout)
                if "error" in result:
                    raise RuntimeError(result["error"])
            except Exception as exc:  # noqa: BLE001 - whatever fails, the traced code keeps serving
                if not self.stopping:
                    warnings.warn(f"piecewise: graph {label}: compiling behind failed ({type(exc).__name__}: "
                                  f"{exc}{self._died()}); it keeps running its traced code", stacklevel=1)
                continue
            seconds = time.perf_counter() - queued
            result["pieces"] = compiled_as
            log.info("piecewise: graph %s: compiled behind in %.1f s (%.1f s compiling, %d Inductor compiles)",
                     label, seconds, result["seconds"], result["compiles"])
            deliver({"load": functools.partial(loaded_code, result), "seconds": result["seconds"],
                     "compiles": result["compiles"], "guards": result["guards"]})

    def _died(self) -> str:
        if self.process.poll() is None:
            return ""
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace")[-800:]
        return f"; the worker exited with {self.process.returncode}: {tail}"


def loaded_code(result: dict) -> dict:
    """Every compute piece's compiled code from the worker's result (pieces of the same code share it)."""
    table = ArtifactTable(result["artifacts"])
    firsts = {name: load_code(saved, table) for name, saved in result["code"].items()}
    return {name: firsts[first] for name, first in result["pieces"].items()}
