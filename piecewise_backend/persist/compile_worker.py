"""The worker process of ``compile_behind.py``: compile pieces with Inductor, hand back saved artifacts.

Started when the process's first graph build starts; warms Inductor's compile pool and Inductor
itself (a tiny compile on the device named on its command line), then reads jobs
(``frames.py``) on stdin until it closes: each job a graph's distinct pieces' FX code, their inputs
described, a hint per symbol. Makes fake inputs in a fake mode of its own (one symbol per symbol of
the job), compiles each piece as a cold build would (``PieceCompiler``: many-layer pieces layer by
layer), under the settings torch's AOT route compiles with (so the code can be saved), and writes
back the pieces' code as ``piece_code.save_code`` describes it, the artifacts, and any guard
Inductor added; a job that fails is answered with its error, and the next one is read.

It runs at a lower CPU priority (its compile pool inherits it): the process it serves is serving,
and the compile is what should wait for a core.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback

import torch

from .. import _torch_internals as internals
from .._torch_internals import aot as _torch_internals
from ..compiling.piece_compiler import PieceCompiler
from ..plan.types import SymSpec, TensorSpec
from .frames import read_frame, write_frame
from .piece_code import ArtifactTable, save_code

NICENESS = 10


def _fake_of(spec, symbols: tuple, fake_mode):
    """A fake value in this process's ``fake_mode`` for a described input, its symbols mapped."""
    if isinstance(spec, TensorSpec):
        like = {"dtype": spec.dtype, "device": spec.device, "requires_grad": spec.requires_grad}
        return _torch_internals.fake_value(spec.shape, spec.strides, symbols, fake_mode, **like)
    if isinstance(spec, SymSpec):
        return _torch_internals.symint(spec.expr, symbols, fake_mode)
    return spec


def compile_job(job: dict) -> dict:
    started_at, started = time.time(), time.perf_counter()
    fake_mode, shape_env, symbols = _torch_internals.fresh_fake_mode(job["hints"])
    guards_before = len(shape_env.guards)
    compiler = PieceCompiler(fake_mode, frozenset(), job["attention_ops"], inductor=True)
    table, code = ArtifactTable(), {}
    with (
        _torch_internals.aot_compile_settings(),
        _torch_internals.tracing(fake_mode),
        internals.fake_propagation(fake_mode),
    ):
        for name, (module, specs) in job["pieces"].items():
            gm = pickle.loads(module)
            fakes = [_fake_of(spec, symbols, fake_mode) for spec in specs]
            _torch_internals.propagate_fake_values(gm, fakes, fake_mode)  # what cutting into layers reads
            piece, _ = compiler.compile(name, gm, fakes, keep_eager=False)
            code[name] = save_code(piece.fn, name, table)
    return {
        "code": code,
        "artifacts": table.saved,
        "compiles": compiler.inductor_compiles,
        "seconds": time.perf_counter() - started,
        "started_at": started_at,
        "guards": [_torch_internals.in_their_symbols(g.expr, symbols) for g in shape_env.guards[guards_before:]],
    }


def main() -> None:
    results = os.fdopen(os.dup(sys.stdout.fileno()), "wb")  # the pipe back; fd 1 now goes to stderr,
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # so nothing printed can corrupt a result
    jobs = sys.stdin.buffer
    if hasattr(os, "nice"):
        os.nice(NICENESS)
    internals.warm_compile_workers()  # while the first job is still being planned
    if len(sys.argv) > 1:  # the device its pieces will be compiled for
        try:
            _torch_internals.warm_inductor(sys.argv[1])
        except Exception:  # noqa: BLE001 - a warm-up that fails leaves the cost to the first piece
            traceback.print_exc()
    ready_at = time.time()  # torch imported, Inductor warmed
    while True:
        try:
            job = read_frame(jobs)
        except EOFError:  # the serving process closed the pipe (or exited)
            return
        try:
            result = compile_job(job)
        except Exception:  # noqa: BLE001 - the job's graph keeps its traced code; say why
            result = {"error": traceback.format_exc(limit=8)[-1500:]}
        write_frame(results, {**result, "ready_at": ready_at})


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
