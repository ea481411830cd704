"""A compiled graph as torch's AOT route saves a backend's result, and the checks that refuse a misfit.

``torch.compile(fn, fullgraph=True).aot_compile(...)`` saves Dynamo's bytecode and guards, and asks
the backend's result for its own bytes (torch's ``SerializableCallable``). :class:`SaveableGraph`
is the compiled graph every build returns; its bytes hold

* a header: this format's number, a digest of the package's sources, torch's
  version, the graph's device. Loaded elsewhere (another torch, another package, no GPU where the
  graph ran on one), :class:`ArtifactMismatch` says which, and ``warm_start.load`` compiles instead;
* the plan (a value: no fake tensor, no graph node; its run-time settings too), each compute piece's code
  (``piece_code.py``) and the distinct Inductor artifacts once each.

Loading builds the graph from those with no trace and no compile; it captures lazily, as a fresh
build does (graphs themselves never outlive a process: their memory addresses do not).
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import pickle

import torch

from .._torch_internals import aot as _torch_internals
from ..registry import register
from ..runtime.compiled_graph import CompiledGraph
from .piece_code import ArtifactTable, NotSaveable, load_code, save_code

FORMAT = 2  # 2: the run-time settings travel in the plan


class ArtifactMismatch(RuntimeError):
    """A saved compiled graph does not fit this process (the message says why)."""


@functools.cache
def package_digest() -> str:
    """A digest of the package's sources: an artifact is loaded only by the code that saved it."""
    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _header(device: torch.device) -> dict:
    return {"format": FORMAT, "package": package_digest(), "torch": torch.version.__version__, "device": device.type}


def check_header(saved: dict) -> None:
    """Raise :class:`ArtifactMismatch` naming what differs between the saving process and this one."""
    here = _header(torch.device(saved.get("device", "cpu")))
    for what, name in (("format", "artifact format"), ("package", "piecewise_backend sources"), ("torch", "torch")):
        if saved.get(what) != here[what]:
            raise ArtifactMismatch(f"saved with {name} {saved.get(what)}, this process has {here[what]}")
    if saved["device"] == "cuda" and not torch.cuda.is_available():
        raise ArtifactMismatch("saved for CUDA, and this process has no CUDA device")


class SaveableGraph(CompiledGraph, _torch_internals.SerializableCallable):
    """The compiled graph every build returns: one that torch's AOT route can save."""

    @classmethod
    def serialize_compile_artifacts(cls, fn: SaveableGraph) -> bytes:
        plan = fn.plan
        if plan.collective_groups:
            raise NotSaveable(
                "piecewise: a graph with collectives (tensor parallel) cannot be saved: its "
                "process groups live in one process."
            )
        table = ArtifactTable()
        code = {name: save_code(fn.compiled_code.get(name), name, table) for name in plan.pieces}
        body = pickle.dumps({"plan": plan, "code": code, "artifacts": table.saved})  # the plan holds its settings
        return pickle.dumps((_header(plan.device), body))  # the header is read before anything is built

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> SaveableGraph:
        header, body = pickle.loads(data)
        check_header(header)
        state = pickle.loads(body)
        table = ArtifactTable(state["artifacts"])
        compiled = {name: load_code(saved, table) for name, saved in state["code"].items()}
        graph = register(cls(state["plan"], compiled))
        graph.stats.loaded = True
        graph.stats.inductor_compiles, graph.stats.inductor_seconds = 0, 0.0  # the saving process's, not ours
        return graph
