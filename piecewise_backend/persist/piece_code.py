"""A compute piece's code, saved and loaded: Inductor's, a layer chain of it, or none (traced code).

What a piece runs takes one of three forms (``compiling/``): Inductor's code for the piece; a
*layer chain* (the piece cut at its attention calls, each distinct layer compiled once: an FX module
whose compute sub-pieces are Inductor's code); or no compiled code at all (``compiler="eager"``:
the piece's traced code, which the plan's program holds). Each distinct Inductor artifact is saved
once (pieces of the same code share it, as they shared the compile), in :class:`ArtifactTable`.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import torch

from .._torch_internals import aot as _torch_internals
from ..compiling.layer_chain import CompiledSubPiece, SymbolFedChain, install


class NotSaveable(RuntimeError):
    """A compiled graph holds something that cannot be saved (the message says what and what to do)."""


class ArtifactTable:
    """Each distinct compiled callable's bytes, once (saving), or its loaded callable, once (loading)."""

    def __init__(self, saved: list | None = None):
        self.saved: list = saved if saved is not None else []  # (bytes, single output) per artifact
        self._index: dict[int, int] = {}
        self._loaded: dict[int, Callable] = {}

    def add(self, fn: Callable, piece: str) -> int:
        if id(fn) not in self._index:
            data = _torch_internals.inductor_artifact(fn)
            if data is None:
                raise NotSaveable(
                    f"piecewise: {piece}'s compiled code cannot be saved: it was not compiled under torch's AOT "
                    f"route. Save through piecewise_backend.save(...) (or torch.compile(..., fullgraph=True)"
                    f".aot_compile(...)), which compiles for saving."
                )
            self._index[id(fn)] = len(self.saved)
            self.saved.append((data, _torch_internals.single_output(fn)))
        return self._index[id(fn)]

    def load(self, index: int) -> Callable:
        if index not in self._loaded:
            data, single = self.saved[index]
            self._loaded[index] = _torch_internals.load_inductor_artifact(data, single)
        return self._loaded[index]


def save_code(fn: Callable | None, piece: str, table: ArtifactTable) -> tuple:
    """A piece's compiled code as a picklable value (its Inductor artifacts go to ``table``)."""
    if fn is None:
        return ("traced",)
    readers = None
    if isinstance(fn, SymbolFedChain):
        fn, readers = fn.chain, fn.readers
    if isinstance(fn, torch.fx.GraphModule):
        subs = {name: m.fn for name, m in fn.named_children() if isinstance(m, CompiledSubPiece)}
        if not subs:
            raise NotSaveable(f"piecewise: {piece} runs FX code that is not the plan's; it cannot be saved.")
        chain = torch.fx.GraphModule(fn, fn.graph)  # its own submodule table: the compiled ones left out
        for name in subs:
            setattr(chain, name, torch.nn.Module())
        code = {name: save_code(sub, f"{piece}.{name}", table) for name, sub in subs.items()}
        return ("chain", pickle.dumps(chain), code, readers)
    return ("inductor", table.add(fn, piece))


def load_code(saved: tuple, table: ArtifactTable) -> Callable | None:
    """The callable :func:`save_code` described (None: the piece runs its traced code)."""
    kind = saved[0]
    if kind == "traced":
        return None
    if kind == "inductor":
        return table.load(saved[1])
    _, chain, code, readers = saved
    return install(pickle.loads(chain), {name: load_code(sub, table) for name, sub in code.items()}, readers or [])
