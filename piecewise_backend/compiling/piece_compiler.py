"""Compile each compute piece with Inductor, once per *distinct* piece.

The example inputs of each piece come from running the split graph under Dynamo's fake mode, so
they carry Dynamo's symbols (``s0`` for the batch size) and Inductor compiles each piece dynamic in
exactly the symbols it receives.

The middle layers of a transformer produce pieces that differ only in which weights they read.
Because Dynamo lifts weights to graph inputs, those pieces have the same code up to placeholder
names; :func:`structural_key` ignores the names, so layer 2..N-1 reuse layer 1's compiled code
(vLLM sees 3 distinct compiles for a 16-layer Llama: first, middle, last; so do we). A piece that
holds many layers' attention (a decode step graphed whole) is compiled the same way, layer by layer,
and runs as one callable (``layer_chain.py``).

Such a piece is not run on fake values either: the same code on the same input metadata gives the
same output metadata and draws random numbers or not alike, so its outputs are made fresh from the
first piece's (:class:`_SharedCode`); only when they alias an input or carry a symbol made inside
(``.item()``) is it run. Running every piece cost about 1 s of a 5.7 s warm build on the H200.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from .. import _torch_internals
from ..fx.graph_facts import value_symbols
from ..split.graph_cleanup import drop_unused_scalar_inputs
from . import layer_chain

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CompiledPiece:
    fn: Callable[..., Any]
    fake_args: list
    structural_key: str
    shared_with: str  # name of the first piece compiled with this code (itself if it was first)
    inductor_code: str | None = None  # the module Inductor generated (shared with ``shared_with``)
    draws_random: bool = False  # it calls an op that draws from the default generator (a graph must advance it)
    eager: Callable[..., Any] | None = None  # the piece's FX code, run as it is if the compiled code raises


def _describe_value(v) -> str:
    if isinstance(v, torch.Tensor):
        return (
            f"T[{v.dtype},{v.device.type},{tuple(map(str, v.shape))},"
            f"{tuple(map(str, v.stride()))},rg={v.requires_grad}]"
        )
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"S[{_torch_internals.sym_expr(v)}]"
    return f"C[{v!r}]"


def _describe_target(target) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{module}.{name}" if module else str(name)


def structural_key(gm: torch.fx.GraphModule, fake_args: list | None) -> str:
    """A hash of the piece's code and input metadata that ignores node names (``fake_args`` None:
    the metadata Dynamo traced, in the placeholders' ``example_value``)."""
    index: dict = {}
    lines = []
    placeholder_i = 0
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "placeholder":
            value = fake_args[placeholder_i] if fake_args is not None else node.meta.get("example_value")
            lines.append(f"ph {_describe_value(value)}")
            placeholder_i += 1
            continue
        if node.op == "get_attr":  # module state inside the piece: never share
            lines.append(f"attr {id(gm)} {node.target}")
            continue
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        lines.append(f"{node.op} {_describe_target(node.target)} {args!r}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _sanitize_fake_arg(value, step_symbols: frozenset, fake_mode):
    """A fake input with a per-step storage offset (``cos[pos:pos+S]``) becomes offset 0.

    The compiled code reads the tensor through its data pointer, so the offset does not matter to
    it; keeping the symbolic offset would make the piece depend on ``pos``.
    """
    if isinstance(value, torch.Tensor) and value_symbols(value.storage_offset()) & step_symbols:
        with fake_mode:
            return torch.empty_strided(
                value.shape, value.stride(), dtype=value.dtype, device=value.device, requires_grad=value.requires_grad
            )
    return value


def run_on_fakes(gm: torch.fx.GraphModule, fake_args: list, fake_mode) -> tuple[Any, bool]:
    """``gm``'s output on fake inputs (under the fake mode), and whether it drew random numbers."""
    watch = _torch_internals.RandomOpsSeen()
    with watch:
        out = gm(*fake_args)
    _torch_internals.bind_fresh_unbacked_symbols(fake_mode, out)  # an eager piece's .item()
    return out, watch.seen


def _tensors(value) -> list[torch.Tensor] | None:
    """The tensors in a piece's output (a tensor, or a plain list or tuple of values); None if it
    holds something else (a named tuple)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if type(value) in (list, tuple):
        inner = [_tensors(v) for v in value]
        return None if None in inner else [t for ts in inner for t in ts]
    return [] if value is None or isinstance(value, (int, float, bool, torch.SymInt, torch.SymFloat)) else None


def _fresh_like(value, bases: dict | None = None):
    """Fake tensors with ``value``'s metadata in storages of their own (under the fake mode); outputs
    that shared a storage share a fresh one, at the same offsets (a piece's q, k and v are views of
    one projection), so what the plan reads of aliasing holds for them as for a run."""
    bases = {} if bases is None else bases
    if isinstance(value, torch.Tensor):
        ref = _torch_internals.storage_ref(value)
        if ref not in bases:
            numel = value.untyped_storage().nbytes() // value.element_size()
            bases[ref] = torch.empty(numel, dtype=value.dtype, device=value.device)
        out = bases[ref].as_strided(value.shape, value.stride(), value.storage_offset())
        return out.requires_grad_(value.requires_grad) if value.requires_grad else out
    if type(value) in (list, tuple):
        return type(value)(_fresh_like(v, bases) for v in value)
    return value


def _fresh_outputs_suffice(out, fake_args: list) -> bool:
    """Can a piece with the same code on inputs of the same metadata take fresh copies of ``out``
    instead of being run? Only if every output tensor is strided at a constant offset, no output is
    in an input's storage, outputs sharing a storage share its dtype, and every symbol in ``out``
    (its storages' sizes too) is one of the inputs' (a symbol made inside, by ``.item()``, would be
    another one in another piece). Running the piece again on fakes costs a fake dispatch per op:
    most of a build without Inductor, were each layer's piece run again."""
    tensors = _tensors(out)
    if tensors is None or any(t.layout != torch.strided or not isinstance(t.storage_offset(), int) for t in tensors):
        return False
    storages = [_torch_internals.storage_ref(t) for t in tensors]
    inputs = {_torch_internals.storage_ref(t) for t in fake_args if isinstance(t, torch.Tensor)} - {None}
    if any(ref is None for ref in storages) or inputs & set(storages):
        return False
    dtypes = {}
    if any(dtypes.setdefault(ref, t.dtype) != t.dtype for ref, t in zip(storages, tensors)):
        return False
    sizes = [t.untyped_storage().nbytes() for t in tensors]
    return value_symbols([out, sizes]) <= value_symbols(list(fake_args))


@dataclasses.dataclass(frozen=True)
class _SharedCode:
    """What the first piece of a structural key leaves for the pieces with the same code."""

    fn: Callable[..., Any]
    first: str  # that piece's name
    code: str | None  # Inductor's module
    draws_random: bool
    output: Any  # its fake output, copied fresh for each later piece; None: they are run instead


class PieceCompiler:
    """Compiles pieces, reusing the compiled code of structurally identical ones."""

    def __init__(
        self, fake_mode, step_symbols: frozenset, attention_ops: frozenset = frozenset(), inductor: bool = True
    ):
        self.fake_mode = fake_mode
        self.step_symbols = step_symbols
        self.inductor = inductor  # False: a piece runs its FX code as it is (``compiler="eager"``)
        # where a piece holding many layers is cut (layer_chain.py): only worth it to compile layers once
        self.attention_ops = attention_ops if inductor else frozenset()
        self._by_key: dict[str, _SharedCode] = {}
        self.inductor_compiles = 0
        self.inductor_seconds = 0.0

    def compile(
        self, name: str, gm: torch.fx.GraphModule, fake_args: list, keep_eager: bool = True
    ) -> tuple[CompiledPiece, Any]:
        """The compiled piece and its fake output on ``fake_args`` (under the fake mode).
        ``keep_eager``: keep the piece's FX code to run should the compiled code raise (a sub-piece
        of a chain needs none: its chain's piece keeps its own)."""
        sanitized = [_sanitize_fake_arg(a, self.step_symbols, self.fake_mode) for a in fake_args]
        key = structural_key(gm, sanitized)
        # the piece as Dynamo traced it, before Inductor's passes rewrite ``gm`` in place (its code is
        # generated when it first runs: lazily, see piece_runner)
        eager = _torch_internals.copy_graph_module(gm) if keep_eager else None
        shared = self._by_key.get(key)
        if shared is not None:
            out = (
                _fresh_like(shared.output)
                if shared.output is not None
                else run_on_fakes(gm, fake_args, self.fake_mode)[0]
            )
            return CompiledPiece(shared.fn, sanitized, key, shared.first, shared.code, shared.draws_random, eager), out
        chained = self._compile_chain(name, gm, sanitized) if self.attention_ops else None
        if chained is not None:
            fn, code, out, draws_random = chained
            if any(a is not b for a, b in zip(sanitized, fake_args)) and not _fresh_outputs_suffice(out, sanitized):
                out, _ = run_on_fakes(gm, fake_args, self.fake_mode)  # outputs may be views of the inputs it was given
        else:
            out, draws_random = run_on_fakes(gm, fake_args, self.fake_mode)  # before Inductor rewrites ``gm``
            fn, code = self._compile(gm, sanitized) if self.inductor else (eager, None)
        reusable = out if _fresh_outputs_suffice(out, fake_args) else None
        self._by_key[key] = _SharedCode(fn, name, code, draws_random, reusable)
        return CompiledPiece(fn, sanitized, key, name, code, draws_random, eager), out

    def _compile(self, gm: torch.fx.GraphModule, fake_args: list) -> tuple[Callable, str | None]:
        start = time.perf_counter()
        fn, code = _torch_internals.inductor_compile(gm, fake_args, self.fake_mode)
        self.inductor_seconds += time.perf_counter() - start
        self.inductor_compiles += 1
        return fn, code

    def _compile_chain(
        self, name: str, gm: torch.fx.GraphModule, fake_args: list
    ) -> tuple[Callable, str | None, Any, bool] | None:
        """Compile a piece cut at its attention calls: its sub-pieces (``name.submod_N``) share compiled
        code with each other as pieces do. Returns the chain as one callable, Inductor's code of each
        distinct sub-piece, the chain's fake output and whether any sub-piece draws random numbers;
        None where cutting does not pay or fails (then the piece is compiled whole, as it would be
        without this: a failure here costs compile time, nothing else)."""
        try:
            chain = layer_chain.split_at_attention(gm, self.attention_ops, lambda sub: structural_key(sub, None))
            if chain is None:
                return None
            chain, compute, readers = chain
            drop_unused_scalar_inputs(chain, compute, self.step_symbols)
            chain_args = fake_args + layer_chain.read_symbols(fake_args, readers)
            run = compile_pieces(chain, compute, chain_args, self, prefix=f"{name}.", keep_eager=False)
        except Exception as e:  # noqa: BLE001 - any failure: compile the piece whole instead
            log.info(
                "piecewise: piece %s compiled whole: compiling it layer by layer failed: %s: %s",
                name,
                type(e).__name__,
                e,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            return None
        codes = {p.shared_with: p.inductor_code for p in run.pieces.values() if p.inductor_code}
        code = "\n".join(f"# ---- {sub} ----\n{text}" for sub, text in codes.items()) or None
        fn = layer_chain.install(chain, {sub: p.fn for sub, p in run.pieces.items()}, readers)
        return fn, code, run.output, run.draws_random


@dataclasses.dataclass
class PiecesRun:
    """What :func:`compile_pieces` gives: the compiled compute pieces, every piece's fake output (by
    submodule name), the fake value of every node of the split graph, the graph's fake output, and
    whether any piece (compute or eager) draws random numbers."""

    pieces: dict[str, CompiledPiece]
    fake_outputs: dict[str, Any]
    node_values: dict
    output: Any
    draws_random: bool


class _FakeRun(torch.fx.Interpreter):
    """Runs the split graph on fake values, compiling each compute piece on its fake inputs.

    Records every piece's fake output too: padding needs the compute pieces' output shapes, and
    up-front capture builds stand-ins for the eager pieces' outputs from them.
    """

    def __init__(self, split_gm, compute_names: set[str], compiler: PieceCompiler, prefix: str, keep_eager: bool):
        super().__init__(split_gm, garbage_collect_values=False)  # compile_pieces returns them all
        self.compute_names = compute_names
        self.compiler, self.prefix, self.keep_eager = compiler, prefix, keep_eager
        self.compiled: dict[str, CompiledPiece] = {}
        self.fake_outputs: dict[str, Any] = {}
        self.draws_random = False

    def call_module(self, target, args, kwargs):
        assert not kwargs
        submod = self.fetch_attr(target)
        if target in self.compute_names:
            piece, out = self.compiler.compile(self.prefix + target, submod, list(args), self.keep_eager)
            self.compiled[target] = piece
            draws_random = piece.draws_random
        else:
            out, draws_random = run_on_fakes(submod, list(args), self.compiler.fake_mode)
        self.draws_random |= draws_random
        self.fake_outputs[target] = out
        return out


def compile_pieces(
    split_gm: torch.fx.GraphModule,
    compute_names: set[str],
    fake_inputs: list,
    compiler: PieceCompiler,
    prefix: str = "",
    keep_eager: bool = True,
) -> PiecesRun:
    """Compile every compute piece of ``split_gm`` (``prefix``: before the names the compiler sees;
    ``keep_eager``: as :meth:`PieceCompiler.compile`'s)."""
    with _torch_internals.fake_propagation(compiler.fake_mode):
        run = _FakeRun(split_gm, compute_names, compiler, prefix, keep_eager)
        output = run.run(*fake_inputs)
    return PiecesRun(run.compiled, run.fake_outputs, dict(run.env), output, run.draws_random)
