"""The worker process of ``compile_behind.py``: compile pieces with Inductor, hand back saved artifacts.

Started when the build starts; warms Inductor's compile pool, then reads a job (pickled) on stdin:
each distinct piece's FX code, its inputs described, a hint per symbol. Makes fake inputs in a fake mode of its own (one symbol per symbol of the job), compiles each
piece as a cold build would (``PieceCompiler``: many-layer pieces layer by layer), under the
settings torch's AOT route compiles with (so the code can be saved), and writes on stdout the
pieces' code as ``piece_code.save_code`` describes it, the artifacts, and any guard Inductor added.
"""

from __future__ import annotations

import pickle
import sys

import torch

from .. import _torch_internals as internals
from ..compiling.piece_compiler import PieceCompiler
from . import _torch_internals
from .piece_code import ArtifactTable, save_code


def compile_job(job: dict) -> dict:
    fake_mode, shape_env, symbols = _torch_internals.fresh_fake_mode(job["hints"])
    guards_before = len(shape_env.guards)
    compiler = PieceCompiler(fake_mode, frozenset(), job["attention_ops"], inductor=True)
    table, code = ArtifactTable(), {}
    with _torch_internals.aot_compile_settings(), _torch_internals.tracing(fake_mode), \
            internals.fake_propagation(fake_mode):
        for name, (module, specs) in job["pieces"].items():
            gm = pickle.loads(module)
            fakes = [_torch_internals.fake_of(spec, symbols, fake_mode) for spec in specs]
            _torch_internals.propagate_fake_values(gm, fakes, fake_mode)  # what cutting into layers reads
            piece, _ = compiler.compile(name, gm, fakes, keep_eager=False)
            code[name] = save_code(piece.fn, name, table)
    return {"code": code, "artifacts": table.saved, "compiles": compiler.inductor_compiles,
            "guards": [_torch_internals.in_their_symbols(g.expr, symbols) for g in shape_env.guards[guards_before:]]}


def main() -> None:
    internals.warm_compile_workers()  # while the job is still being planned (started with the build)
    job = pickle.loads(sys.stdin.buffer.read())
    result = compile_job(job)
    sys.stdout.buffer.write(pickle.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
