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
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from typing import Any, Callable

import torch
import torch.fx

from .. import _torch_internals
from ..fx.graph_facts import value_symbols
from ..split.splitting import drop_unused_scalar_inputs
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
        return (f"T[{v.dtype},{v.device.type},{tuple(map(str, v.shape))},"
                f"{tuple(map(str, v.stride()))},rg={v.requires_grad}]")
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
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device,
                                       requires_grad=value.requires_grad)
    return value


class PieceCompiler:
    """Compiles pieces, reusing the compiled code of structurally identical ones."""

    def __init__(self, fake_mode, step_symbols: frozenset, attention_ops: frozenset = frozenset()):
        self.fake_mode = fake_mode
        self.step_symbols = step_symbols
        self.attention_ops = attention_ops  # where a piece holding many layers is cut (layer_chain.py)
        self._by_key: dict[str, tuple[Callable, str, str | None]] = {}
        self.inductor_compiles = 0
        self.inductor_seconds = 0.0

    def compile(self, name: str, gm: torch.fx.GraphModule, fake_args: list, keep_eager: bool = True) -> CompiledPiece:
        """``keep_eager``: keep the piece's FX code to run should the compiled code raise (a
        sub-piece of a chain needs none: its chain's piece keeps its own)."""
        fake_args = [_sanitize_fake_arg(a, self.step_symbols, self.fake_mode) for a in fake_args]
        key = structural_key(gm, fake_args)
        # the piece as Dynamo traced it, before Inductor's passes rewrite ``gm`` in place
        eager = _torch_internals.generated_forward(_torch_internals.copy_graph_module(gm)) if keep_eager else None
        if key in self._by_key:
            fn, first, code = self._by_key[key]
            return CompiledPiece(fn, fake_args, key, first, code, eager=eager)
        fn, code = self._compile_chain(name, gm, fake_args) if self.attention_ops else (None, None)
        if fn is None:
            start = time.perf_counter()
            fn, code = _torch_internals.inductor_compile(gm, fake_args, self.fake_mode)
            self.inductor_seconds += time.perf_counter() - start
            self.inductor_compiles += 1
        self._by_key[key] = (fn, name, code)
        return CompiledPiece(fn, fake_args, key, name, code, eager=eager)

    def _compile_chain(self, name: str, gm: torch.fx.GraphModule, fake_args: list) -> tuple[Callable | None, str | None]:
        """Compile a piece cut at its attention calls: its sub-pieces (``name.submod_N``) share compiled
        code with each other as pieces do. Returns the chain as one callable and Inductor's code of
        each distinct sub-piece; (None, None) where cutting does not pay or fails (then the piece is
        compiled whole, as it would be without this: a failure here costs compile time, nothing else)."""
        try:
            chain = layer_chain.split_at_attention(gm, self.attention_ops, lambda sub: structural_key(sub, None))
            if chain is None:
                return None, None
            chain, compute, readers = chain
            drop_unused_scalar_inputs(chain, compute, self.step_symbols)
            chain_args = fake_args + layer_chain.read_symbols(fake_args, readers)
            pieces, _, _ = compile_pieces(chain, compute, chain_args, self, prefix=f"{name}.", keep_eager=False)
        except Exception as e:  # noqa: BLE001 - any failure: compile the piece whole instead
            log.info("piecewise: piece %s compiled whole: compiling it layer by layer failed: %s: %s",
                     name, type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
            return None, None
        codes = {p.shared_with: p.inductor_code for p in pieces.values() if p.inductor_code}
        code = "\n".join(f"# ---- {sub} ----\n{text}" for sub, text in codes.items()) or None
        return layer_chain.install(chain, {sub: p.fn for sub, p in pieces.items()}, readers), code


class _FakeRun(torch.fx.Interpreter):
    """Runs the split graph on fake values, compiling each compute piece on its fake inputs.

    Records every piece's fake output too: padding needs the compute pieces' output shapes, and
    up-front capture builds stand-ins for the eager pieces' outputs from them.
    """

    def __init__(self, split_gm, compute_names: set[str], on_compute, fake_mode=None):
        super().__init__(split_gm, garbage_collect_values=False)  # compile_pieces returns them all
        self.compute_names = compute_names
        self.on_compute = on_compute
        self.fake_mode = fake_mode
        self.fake_outputs: dict[str, Any] = {}

    def call_module(self, target, args, kwargs):
        assert not kwargs
        submod = self.fetch_attr(target)
        watch = _torch_internals.RandomOpsSeen()
        with watch:
            out = submod(*args)  # before compiling: Inductor may rewrite the graph it is given
        _torch_internals.bind_fresh_unbacked_symbols(self.fake_mode, out)  # an eager piece's .item()
        self.fake_outputs[target] = out
        if target in self.compute_names:
            self.on_compute(target, submod, list(args), watch.seen)
        return out


def compile_pieces(split_gm: torch.fx.GraphModule, compute_names: set[str], fake_inputs: list,
                   compiler: PieceCompiler, prefix: str = "", keep_eager: bool = True
                   ) -> tuple[dict[str, CompiledPiece], dict[str, Any], dict]:
    """Compile every compute piece of ``split_gm`` (``prefix``: before the names the compiler sees;
    ``keep_eager``: as :meth:`PieceCompiler.compile`'s).

    Returns the compiled pieces and every piece's fake output, by submodule name, and the fake
    value of every node of the split graph.
    """
    compiled: dict[str, CompiledPiece] = {}

    def on_compute(name, submod, fake_args, draws_random):
        compiled[name] = dataclasses.replace(compiler.compile(prefix + name, submod, fake_args, keep_eager),
                                             draws_random=draws_random)

    with _torch_internals.fake_propagation(compiler.fake_mode):
        run = _FakeRun(split_gm, compute_names, on_compute, compiler.fake_mode)
        run.run(*fake_inputs)
    return compiled, run.fake_outputs, dict(run.env)
