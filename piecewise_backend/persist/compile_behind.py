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

What the worker gets is run-time values only: each distinct piece's FX code (as torch pickles a
``GraphModule``), its inputs described (``plan.types.TensorSpec``) and a hint for each symbol; it
makes fake inputs of its own. Inductor may assume something of a size while compiling (a guard, such
as ``64*s0 <= 2147483647`` for 32-bit indexing): Dynamo installed this graph's guards long before,
so after the switch each piece checks those assumptions on its own inputs, and a call that breaks
one runs the piece's traced code (``runtime/code_switch.py``).
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import warnings

from ..plan.types import GraphPlan, SymSpec, TensorSpec
from .piece_code import ArtifactTable, load_code

log = logging.getLogger(__name__)
TIMEOUT_S = 3600  # a worker that takes longer is given up on (the graph keeps its traced code)


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
    """A worker process compiling one graph's pieces; its result posted to ``deliver``.

    The process starts when the build does (:meth:`spawn`), so importing torch and warming
    Inductor's compile pool there overlap the split; the job is written to it once the plan is made
    (:meth:`start`), or the process is ended (:meth:`cancel`) when there is nothing to compile."""

    def __init__(self, process: subprocess.Popen):
        self.process = process
        self.thread: threading.Thread | None = None

    @classmethod
    def spawn(cls) -> "CompileBehind":
        return cls(subprocess.Popen([sys.executable, "-m", "piecewise_backend.persist.compile_worker"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=dict(os.environ)))

    def cancel(self) -> None:
        self.process.kill()
        self.process.communicate()

    def start(self, job: dict, attention_ops: frozenset, deliver, plan: GraphPlan, label: str) -> None:
        compiled_as = dict(plan.report.compiled_as)
        payload = pickle.dumps({**job, "attention_ops": attention_ops})
        self.thread = threading.Thread(target=self._run, args=(payload, deliver, compiled_as, label), daemon=True,
                                       name=f"piecewise-compile-behind-{label}")
        self.thread.start()

    def _run(self, payload: bytes, deliver, compiled_as: dict, label: str) -> None:
        started = time.perf_counter()
        try:
            stdout, stderr = self.process.communicate(input=payload, timeout=TIMEOUT_S)
            if self.process.returncode != 0:
                raise RuntimeError(stderr.decode(errors="replace")[-800:])
            result = pickle.loads(stdout)
        except Exception as exc:  # noqa: BLE001 - whatever fails, the traced code keeps serving
            self.process.kill()
            warnings.warn(f"piecewise: graph {label}: compiling behind failed ({type(exc).__name__}: {exc}); "
                          f"it keeps running its traced code", stacklevel=1)
            return
        seconds = time.perf_counter() - started
        result["pieces"] = compiled_as
        log.info("piecewise: graph %s: compiled behind in %.1f s (%d Inductor compiles)", label, seconds,
                 result["compiles"])
        deliver({"load": functools.partial(loaded_code, result), "seconds": seconds,
                 "compiles": result["compiles"], "guards": result["guards"]})


def loaded_code(result: dict) -> dict:
    """Every compute piece's compiled code from the worker's result (pieces of the same code share it)."""
    table = ArtifactTable(result["artifacts"])
    firsts = {name: load_code(saved, table) for name, saved in result["code"].items()}
    return {name: firsts[first] for name, first in result["pieces"].items()}
