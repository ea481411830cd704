"""The ``piecewise`` torch.compile backend: split, compile, wrap, stitch.

``torch.compile(model, backend="piecewise", options={...})`` calls :func:`piecewise` once per graph
Dynamo captures. It returns a :class:`CompiledGraph`: the split graph (torch's ``split_module``
output) whose compute submodules are replaced by :class:`~piecewise_backend.cudagraphs.PieceRunner`
objects, and whose split/eager submodules run as they are, between the replays. Per call, the
:class:`~piecewise_backend.capture_policy.CapturePolicy` picks the captured size that serves the
batch (padding up to it), or says why the call runs un-graphed.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
import warnings
import weakref
from typing import Any, Iterable, Mapping

import torch
import torch.fx

from . import _torch_internals
from . import graph_facts as facts
from .capture_policy import OVER_BUDGET, WEIGHTS_MOVED, CapturePolicy, Plan
from .compiling import CompiledPiece, PieceCompiler, compile_pieces
from .config import PiecewiseConfig
from . import cudagraphs
from .cudagraphs import PieceRunner, StepState, pool_bytes, synchronize
from .distributed import rank_agreement
from .padding import plan_padding
from .row_independence import evaluate_rows
from .position_writes import PLACEHOLDER, Rewrite, rewrite_writes
from .precapture import run_compute_pieces, symbol_values
from .splitting import COMPUTE, SplitGraph, split_graph
from .staging import stage_keys
from .inspection import piece_signatures
from .stats import CaptureEvent, GraphStats, PieceStats, register
from .weight_sets import WeightSet, WeightSets

log = logging.getLogger("piecewise_backend")

_COMPILED: "weakref.WeakSet[CompiledGraph]" = weakref.WeakSet()


def compiled_graphs() -> list["CompiledGraph"]:
    """Every live graph this backend compiled in this process, oldest first."""
    return sorted(_COMPILED, key=lambda g: g.serial)


def capture(sizes: Iterable[int] | str = "all") -> dict[int, list[tuple]]:
    """Capture ``sizes`` now in every live compiled graph that can (servers: warm up when idle).

    A graph can once it has been called (its weights and other sizes come from that call) and has
    a dynamic batch size. Returns, per graph serial, the shape keys it captured.
    """
    return {g.serial: g.capture(sizes) for g in compiled_graphs() if g.can_capture_up_front}


def release_graphs() -> int:
    """Destroy every CUDA graph this backend captured in this process; returns how many shape keys
    were released. The compiled pieces stay, and later calls capture again, lazily, as at first.

    Why: NCCL counts each CUDA graph that captured one of its collectives and
    ``ncclCommDestroy`` waits until all of them are destroyed, so a tensor-parallel program whose
    graphs are still alive hangs in ``torch.distributed.destroy_process_group()`` (pytorch#115388;
    seen with torch 2.11 on two H200s). Call this before destroying the process group. The graph
    pool's memory stays reserved for later captures.
    """
    graphs = compiled_graphs()
    devices = {g._device for g in graphs if g.captured and g._device.type == "cuda"}
    for device in devices:  # no graph is destroyed while a replay of it may still be running
        synchronize(device)
    return sum(g.release_graphs() for g in graphs)


class CompiledGraph:
    """The callable Dynamo installs for one captured graph."""

    _serial = 0

    def __init__(self, split: SplitGraph, compiled: dict[str, CompiledPiece], runners: dict[str, PieceRunner],
                 step: StepState, stats: GraphStats, config: PiecewiseConfig, key_sources: list,
                 key_symbols: list, pad_position: int | None, policy: CapturePolicy,
                 graphs_disabled_reason: str | None, any_requires_grad: bool, fake_inputs: list,
                 fake_outputs: dict, static_inputs: frozenset, rewrite: Rewrite | None = None,
                 unmasked_writes: tuple = (), weight_indices: tuple = ()):
        CompiledGraph._serial += 1
        self.serial = CompiledGraph._serial
        self.split = split
        self.compiled = compiled
        self.runners = runners
        self.step = step
        self.stats = stats
        self.config = config
        self.key_sources = key_sources
        self.key_symbols = key_symbols
        self.pad_position = pad_position
        self.policy = policy
        self.graphs_disabled_reason = graphs_disabled_reason
        self.any_requires_grad = any_requires_grad
        self.captured: set = set()  # shape keys captured (for the active set of weights)
        self._plans: dict[tuple, Plan] = {}
        self.weights = WeightSets(weight_indices, config.max_weight_sets)
        self._fake_inputs = fake_inputs
        self._fake_outputs = fake_outputs
        self._static_inputs = static_inputs
        self._template: list | None = None  # first call's weights and scalars, for capture()
        self._template_key: tuple = ()
        self._template_values: dict = {}
        self._warned: set = set()
        self._forward = _torch_internals.generated_forward(split.graph_module)
        self.step_scalars = rewrite.scalars if rewrite is not None else None
        self.unmasked_writes = unmasked_writes  # buffers compute pieces write at the caller's positions

    @property
    def pieces(self):
        return self.split.pieces

    @property
    def __code__(self):
        """Tools that walk Dynamo's cache (depyf) expect what a backend returns to be a function and
        read its ``__code__``; ours is this object's ``__call__``."""
        return type(self).__call__.__code__

    @property
    def can_capture_up_front(self) -> bool:
        return (self.graphs_disabled_reason is None and self.pad_position is not None and self._template is not None
                and not self.unmasked_writes)

    def shape_key(self, args) -> tuple:
        """The values of the batch symbols for this call (never the per-step scalars)."""
        return tuple(args[i] if dim is None else args[i].shape[dim] for i, dim in self.key_sources)

    # -- per call ---------------------------------------------------------------------------------

    def __call__(self, *args):
        if self.step_scalars is not None:
            args = self.step_scalars.refresh(args)  # positions of the KV writes moved into the graphs
        step = self.step
        self.stats.calls += 1
        if self.graphs_disabled_reason is not None or not self._grad_allows_graphs():
            step.graphing = False
            return self._forward(*args)
        addresses = self.weights.addresses(args)
        if addresses != self.weights.active_addresses and not self._use_weights(addresses, args):
            step.graphing = False
            self.stats.misses[WEIGHTS_MOVED] += 1
            return self._forward(*args)
        key = self.shape_key(args)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._new_plan(key, args)
        if plan.size is not None:
            self.stats.batch_sizes[plan.size] += 1
        if plan.key is None:
            step.graphing = False
            self.stats.misses[plan.miss] += 1
            return self._forward(*args)
        step.graphing = True
        step.key = plan.key
        step.size = plan.size
        step.padded = plan.padded
        step.refreshed.clear()
        if plan.capture:
            return self._capturing_call(plan, args)
        return self._forward(*args)

    def _use_weights(self, addresses: tuple, args: tuple) -> bool:
        """Make the graphs of this set of parameter addresses the active ones (``weight_sets.py``);
        False when the set is new and ``max_weight_sets`` sets have graphs already."""
        weight_set = self.weights.find(addresses)
        if weight_set is None:
            detail = (f"parameters/buffers at a new set of addresses; {len(self.weights)} sets have graphs, "
                      f"max_weight_sets={self.weights.limit}")
            self.stats.miss_details[WEIGHTS_MOVED] = detail
            self._warn_once("weights bound", f"piecewise: graph {self.serial}: {detail}: calls with these weights "
                                              f"run un-graphed. Raise max_weight_sets, or recompile "
                                              f"(torch._dynamo.reset()) after replacing the weights for good.")
            return False
        if weight_set.number > 1:
            self._warn_once("weights moved", f"piecewise: graph {self.serial}: its parameters/buffers are at "
                                              f"new addresses (load_state_dict(assign=True), .to(), another "
                                              f"model's weights): capturing graphs for them (set "
                                              f"{weight_set.number} of at most {self.weights.limit}); the "
                                              f"tensors captured before are never written.")
        self.stats.weight_sets = max(self.stats.weight_sets, weight_set.number)
        self._activate(addresses, weight_set)
        if self._template is not None:  # capture() uses these weights from now on (and not the old ones)
            self._template = [args[i] if i in self._static_inputs else t for i, t in enumerate(self._template)]
        return True

    def _activate(self, addresses: tuple, weight_set: WeightSet) -> None:
        for name, runner in self.runners.items():
            runner.captures = weight_set.captures.setdefault(name, {})
            runner.failed_keys = weight_set.failed.setdefault(name, set())
        self.captured, self._plans = weight_set.captured, weight_set.plans
        self.weights.activate(addresses, weight_set)

    def _new_plan(self, key: tuple, args: tuple) -> Plan:
        if self._template is None:
            self._remember(key, args)
            if self.config.eager_sizes and self.pad_position is not None:
                if self.unmasked_writes:
                    self._warn_once("eager sizes", f"piecewise: graph {self.serial}: eager_capture_sizes ignored: "
                                                   f"{self._no_up_front_capture()}")
                else:
                    self.capture(self._eager_sizes_within_rows())  # before the first output
        plan = self.policy.plan(key, self.captured, self._pool_bytes)
        if plan.miss is not None:
            self.stats.miss_details[plan.miss] = plan.detail
            if plan.miss == OVER_BUDGET:
                self._warn_once(plan.miss, f"piecewise: graph {self.serial}: not capturing shape key {key}: "
                                           f"{plan.detail}. Those calls run un-graphed (see stats.summary()).")
        if not plan.capture:
            self._plans[key] = plan
        return plan

    def _capturing_call(self, plan: Plan, args: tuple):
        return self._capturing_step(plan.key, "lazy", dict(zip(self.key_symbols, plan.key)),
                                    lambda: self._forward(*args))

    def _capturing_step(self, key: tuple, how: str, sym_values: dict, run):
        """Run ``run()`` as the step that captures ``key``: fresh per-capture state, timed, recorded."""
        step = self.step
        step.pool_ptrs.clear()
        step.staged.clear()
        step.key_size = key[self.pad_position] if self.pad_position is not None else None
        step.sym_values = sym_values
        before, start = self._pool_bytes(), time.perf_counter()
        out = run()
        synchronize(self._device)
        self._record_capture(key, how, time.perf_counter() - start, before)
        return out

    def _grad_allows_graphs(self) -> bool:
        if not (self.any_requires_grad and torch.is_grad_enabled()):
            return True
        self._warn_once("grad", "piecewise: inputs require grad and grad mode is on; CUDA graphs are for "
                                "inference, so this graph runs un-graphed. Call it under torch.no_grad() or "
                                "torch.inference_mode() to get graphs.")
        return False

    def _warn_once(self, topic: str, message: str) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            warnings.warn(message, stacklevel=4)

    # -- capture bookkeeping ----------------------------------------------------------------------

    def release_graphs(self) -> int:
        """Forget every shape key's graphs, for every set of weights (see the module's
        :func:`release_graphs`); the number of keys released. Keys whose capture failed stay un-graphed."""
        released = 0
        for weight_set in self.weights.all():
            released += len(weight_set.captured)
            for captures in weight_set.captures.values():
                captures.clear()
            weight_set.captured.clear()
            weight_set.plans.clear()  # plans of captured keys would replay graphs that are gone
        return released

    def _pool_bytes(self) -> int:
        device = self._device
        return pool_bytes(device) if device.type == "cuda" else 0

    @property
    def _device(self) -> torch.device:
        return next(f.device for f in self._fake_inputs if isinstance(f, torch.Tensor))

    def _record_capture(self, key: tuple, how: str, seconds: float, before: int) -> None:
        after = self._pool_bytes()
        self.captured.add(key)
        self._plans.clear()  # misses may now be served (lazy_capture=False) or refused (budget)
        size = key[self.pad_position] if self.pad_position is not None else None
        self.policy.budget.record(size, after - before)
        pieces = sum(1 for r in self.runners.values() if key in r.captures)
        self.stats.events.append(CaptureEvent(key, how, seconds, after, after - before, pieces,
                                              self.stats.calls))
        log.info("piecewise: graph %d: captured shape key %s (%s) across %d pieces in %.0f ms; graph pool "
                 "%.1f MiB (+%.1f MiB)", self.serial, key, how, pieces, seconds * 1e3, after / 2**20,
                 (after - before) / 2**20)
        cap = self.config.max_graph_memory
        if cap is not None and after > cap:
            self._warn_once("over cap", f"piecewise: graph {self.serial}: graph pool holds {after / 2**20:.1f} "
                                        f"MiB after capturing {key}, above max_graph_memory={cap / 2**20:.1f} "
                                        f"MiB; no further captures.")

    # -- up-front capture -------------------------------------------------------------------------

    def _remember(self, key: tuple, args: tuple) -> None:
        """Keep what capture() needs from a real call: weights (by reference) and symbol values."""
        self._template = [a if i in self._static_inputs or not isinstance(a, torch.Tensor) else None
                          for i, a in enumerate(args)]
        self._template_key = key
        self._template_values = symbol_values(self._fake_inputs, args)

    def capture(self, sizes: Iterable[int] | str = "all") -> list[tuple]:
        """Capture the graphs of ``sizes`` now, largest first; returns the shape keys captured.

        ``sizes``: capture sizes, or ``"all"``. Needs one earlier call (for the weights and the
        sizes of other dynamic dims). Stops, with a warning, at the first size the budget refuses.
        Shows a progress bar (tqdm) when it takes more than a moment.
        """
        if self.graphs_disabled_reason is not None:
            raise RuntimeError(f"piecewise: graph {self.serial} cannot capture: {self.graphs_disabled_reason}.")
        if self.pad_position is None:
            raise RuntimeError(f"piecewise: graph {self.serial} has no dynamic batch size (Dynamo specialised "
                               f"it); it captures its one shape on its first call. Compile with dynamic=True "
                               f"or torch._dynamo.mark_dynamic(input, 0) to capture sizes up front.")
        if self._template is None:
            raise RuntimeError(f"piecewise: graph {self.serial} has not been called yet; call the compiled model "
                               f"once (capture() takes the weights and other sizes from that call).")
        if self.unmasked_writes:
            raise RuntimeError(f"piecewise: graph {self.serial} cannot capture up front: {self._no_up_front_capture()}")
        every = sizes == "all"
        sizes = self.policy.sizes if every else tuple(sizes)
        unknown = [s for s in sizes if s not in self.policy.sizes]
        if unknown:
            raise ValueError(f"piecewise: {unknown} are not capture sizes of graph {self.serial}; "
                             f"its capture sizes are {list(self.policy.sizes)}.")
        rows = self._row_limit()
        too_many = [s for s in sizes if rows is not None and s > rows]
        if too_many and not every:
            raise ValueError(f"piecewise: graph {self.serial} reads or writes tensors of {rows} rows by batch row "
                             f"(a KV cache's batch dim); sizes {too_many} would reach past them.")
        sizes = tuple(s for s in sizes if s not in too_many)
        keys = [self.policy.with_size(self._template_key, s) for s in sorted(set(sizes), reverse=True)]
        todo = [k for k in keys if k not in self.captured]
        done = []
        for key in _progress(todo, f"piecewise: capturing {len(todo)} sizes"):
            plan = self.policy.admit(key, self.captured, self._pool_bytes)
            if not plan.capture:
                self._warn_once(OVER_BUDGET, f"piecewise: graph {self.serial}: stopped capturing at shape key "
                                             f"{key}: {plan.detail}.")
                break
            self._capture_up_front(key)
            done.append(key)
        return done

    def _row_limit(self) -> int | None:
        """The most rows a padded or up-front batch may have (a KV cache's batch dim), None: no limit."""
        return self.policy.row_limit(self._template_key) if self.policy.row_limit is not None else None

    def _eager_sizes_within_rows(self) -> tuple:
        rows = self._row_limit()
        sizes = self.config.eager_sizes
        if rows is not None and any(s > rows for s in sizes):
            self._warn_once("eager rows", f"piecewise: graph {self.serial}: eager_capture_sizes above {rows} are "
                                          f"not captured: the graph reads or writes tensors of {rows} rows by "
                                          f"batch row (a KV cache's batch dim).")
            sizes = tuple(s for s in sizes if s <= rows)
        return sizes

    def _no_up_front_capture(self) -> str:
        return (f"its compute pieces write {', '.join(self.unmasked_writes)} (full mode) at positions the inputs "
                f"give, and capturing on made-up inputs would write garbage there. Its sizes are captured "
                f"lazily, on the first real call at each size.")

    def _capture_up_front(self, key: tuple) -> None:
        step = self.step
        step.graphing, step.key, step.size, step.padded = True, key, key[self.pad_position], False
        step.refreshed.clear()
        values = {**self._template_values, **dict(zip(self.key_symbols, key))}
        scalars = self.step_scalars.writes_disabled() if self.step_scalars is not None else contextlib.nullcontext()
        with scalars:  # the moved KV writes put back what they read: the caller's cache is untouched
            self._capturing_step(key, "eager", values, lambda: run_compute_pieces(
                self.split.graph_module, self.runners, self._fake_outputs, self._fake_inputs, self._template,
                self._static_inputs, values))


def _progress(items: list, desc: str):
    """A tqdm bar that appears only if the loop takes more than a second (plain list without tqdm)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, delay=1.0, unit="size", leave=False)


def _escaping_outputs(split_gm: torch.fx.GraphModule) -> dict[str, set]:
    """For each submodule, the indices of its outputs that the graph returns to the user."""
    out: dict[str, set] = {}
    output_node = next(n for n in split_gm.graph.nodes if n.op == "output")
    for arg in output_node.all_input_nodes:
        if arg.op == "call_module":
            out.setdefault(str(arg.target), set()).add(0)
        elif arg.op == "call_function" and arg.target is operator.getitem and arg.args[0].op == "call_module":
            out.setdefault(str(arg.args[0].target), set()).add(arg.args[1])
    return out


def _input_args(split_gm: torch.fx.GraphModule) -> dict[str, dict[int, str]]:
    """For each submodule: arg position -> name of the graph input passed there directly."""
    return {str(node.target): {i: a.name for i, a in enumerate(node.args)
                               if isinstance(a, torch.fx.Node) and a.op == "placeholder"}
            for node in split_gm.graph.nodes if node.op == "call_module"}


def _positions(inputs: dict[int, str], names) -> frozenset:
    return frozenset(i for i, name in inputs.items() if name in names)


def _key_sources(fake_inputs: list, needed: set) -> tuple[list, list, set]:
    """Where to read each needed symbol at call time: (arg index, dim) or (arg index, None).

    Returns the sources, the symbols in the same order, and the needed symbols no input provides.
    """
    sources, symbols = [], []
    for i, value in enumerate(fake_inputs):
        candidates = [(None, value)] if isinstance(value, torch.SymInt) else (
            list(enumerate(value.shape)) if isinstance(value, torch.Tensor) else [])
        for dim, size in candidates:
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                sym = size.node.expr
                if sym in needed and sym not in symbols:
                    symbols.append(sym)
                    sources.append((i, dim))
    return sources, symbols, needed - set(symbols)


def _graphs_disabled_reason(config: PiecewiseConfig, fake_inputs: list, missing: set) -> str | None:
    if not config.cudagraphs:
        return "cudagraphs=False in options"
    devices = {v.device.type for v in fake_inputs if isinstance(v, torch.Tensor)}
    if devices == {"cpu"} and cudagraphs.EMULATE_ON_CPU:
        return None
    if devices != {"cuda"}:
        return f"graphs need CUDA tensors; inputs are on {', '.join(sorted(devices)) or 'no device'}"
    if missing:
        return f"compute pieces depend on symbols not read from any input ({', '.join(map(str, missing))})"
    return None


def _leading_dynamic_size(fake_inputs: list, symbols: list) -> int | None:
    """Position in the key of the first input's first dynamic dim (the batch, for an LLM step).

    Dynamo passes symbols as SymInt inputs too (often before the tensors), so the key's own order
    does not say which symbol is the batch; the tensors' shapes do.
    """
    for value in fake_inputs:
        if isinstance(value, torch.Tensor):
            for size in value.shape:
                if isinstance(size, torch.SymInt) and size.node.expr in symbols:
                    return symbols.index(size.node.expr)
    return None


def _padding(split: SplitGraph, compiled: dict, fake_outputs: dict, fake_inputs: list, symbols: list,
             unmasked_writes: dict, row_access: dict):
    """(pad position in the key, padding per piece, why not padded or None, row capacities, description).

    The KV writes moved into compute pieces (``position_writes``) are masked to the caller's rows,
    so they neither forbid padding nor count as mixing rows (``row_access`` names them): only each
    piece's ``unmasked_writes`` do. They do read and write their caches by batch row, so a padded
    batch may not exceed those caches' rows: the capacities.
    """
    pad_position = _leading_dynamic_size(fake_inputs, symbols)
    if pad_position is None:
        return None, {}, None, (), "no dynamic batch size: one shape, captured as is"
    sym = symbols[pad_position]
    pieces = {name: (c.fake_args, fake_outputs[name]) for name, c in compiled.items()}
    per_piece, reason, capacities = plan_padding(sym, split.compute_nodes, pieces, unmasked_writes, row_access)
    if reason:
        return pad_position, {}, reason, (), f"off for {sym}: {reason}; only exact capture sizes get graphs"
    note = f"{sym} padded up to the next capture size"
    if capacities:
        rows = sorted({str(c.rows) for c in capacities})
        tensors = {c.tensor for c in capacities}
        note += (f" while the padded batch fits in {' / '.join(rows)} rows, the batch dim of the "
                 f"{len(tensors)} tensor(s) it reads or writes by batch row (e.g. {capacities[0].tensor}, "
                 f"{capacities[0].where}); past that, exact sizes")
    return pad_position, per_piece, None, capacities, note


def _log_graph(title: str, gm: torch.fx.GraphModule) -> None:
    """Log a graph at DEBUG through Dynamo's formatter. Calling it matters even when DEBUG is off:
    under ``depyf.prepare_debug`` it is what writes the graph into the dump folder."""
    log.debug("%s", torch._dynamo.utils.lazy_format_graph_code(title, gm))


def build(gm: torch.fx.GraphModule, example_inputs: list, config: PiecewiseConfig) -> CompiledGraph:
    started = time.perf_counter()
    fake_mode = _torch_internals.detect_fake_mode(example_inputs)
    phs = facts.placeholders(gm.graph)
    if fake_mode is None or any(facts.example_value(n) is None for n in phs):
        raise RuntimeError("piecewise backend: the graph has no fake example values; it must come from "
                           "torch.compile (Dynamo), not be called directly on an FX graph.")
    if any(isinstance(v, torch.Tensor) and v.is_cuda for v in example_inputs):
        _torch_internals.warm_compile_workers()  # ready by the time the first piece reaches Triton
    static_placeholders = {n.name for n in phs if _torch_internals.is_static_input(n)}
    _log_graph("piecewise input graph", gm)
    rewrite = None
    if (config.capture_kv_writes or config.graph_attention) and \
            _graphs_disabled_reason(config, example_inputs, set()) is None:
        rewrite = rewrite_writes(gm, static_placeholders, config.capture_kv_writes, config.graph_attention)
    if rewrite is not None:  # one more graph input: the device tensor of step positions
        gm = rewrite.graph_module
        example_inputs = [*example_inputs, rewrite.scalars.tensor]
        static_placeholders.add(PLACEHOLDER)
        phs = facts.placeholders(gm.graph)
        _log_graph("piecewise graph with the KV writes moved into compute", gm)
    static_inputs = frozenset(i for i, n in enumerate(phs) if n.name in static_placeholders)
    if rewrite is None:
        fake_inputs = _torch_internals.fakify_inputs(example_inputs, fake_mode)
    else:  # a tensor Dynamo never saw: its static shape, not a fresh symbol
        fake_inputs = [*_torch_internals.fakify_inputs(example_inputs[:-1], fake_mode),
                       fake_mode.from_tensor(rewrite.scalars.tensor, static_shapes=True)]
    any_requires_grad = any(isinstance(v, torch.Tensor) and v.requires_grad for v in fake_inputs)

    # buffers whose writes were moved into compute pieces, masked to the caller's rows: padding and
    # repeated runs (warm-up) leave them as one real call would
    masked = rewrite.buffers if rewrite is not None else frozenset()
    writable = (frozenset(static_placeholders) if config.mode == "full" else frozenset()) | masked
    split = split_graph(gm, config.all_splitting_ops, writable)
    split_gm = split.graph_module
    _log_graph("piecewise split graph", split_gm)
    for spec in split.pieces:
        _log_graph(f"piecewise {spec.name} {spec.kind}", getattr(split_gm, spec.name))
    compute_names = {p.name for p in split.pieces if p.kind == COMPUTE}
    # per compute piece, the inputs it writes at the caller's positions (not masked to its rows)
    unmasked = {p.name: tuple(w for w in p.writes_inputs if w not in masked) for p in split.pieces
                if p.kind == COMPUTE}
    compiler = PieceCompiler(fake_mode, split.step_symbols)
    compiled, fake_outputs, node_values = compile_pieces(split_gm, compute_names, fake_inputs, compiler)
    staging = stage_keys(split_gm, node_values, compute_names, split.written_inputs, static_placeholders)
    signatures = piece_signatures(split_gm, node_values)
    del node_values  # fake values of every intermediate: not needed past this point

    needed = set()
    for piece in compiled.values():
        needed |= facts.value_symbols(piece.fake_args, with_offset=False)
    sources, symbols, missing = _key_sources(fake_inputs, needed - split.step_symbols)
    reason = _graphs_disabled_reason(config, fake_inputs, missing)
    pad_position, padding, no_padding, capacities, padding_note = _padding(
        split, compiled, fake_outputs, fake_inputs, symbols, unmasked, rewrite.row_access if rewrite is not None else {})
    if not config.padding and pad_position is not None:
        padding, padding_note = {}, "off (padding=False): only exact capture sizes get graphs"
    row_limit = (lambda key: evaluate_rows(capacities, dict(zip(symbols, key)))) if capacities else None
    policy = CapturePolicy(config, pad_position, no_padding, rank_agreement(gm.graph), row_limit)

    stats = register(GraphStats(
        num_pieces=len(split.pieces), num_compute_pieces=len(compute_names),
        num_split_pieces=len(split.pieces) - len(compute_names),
        inductor_compiles=compiler.inductor_compiles, inductor_seconds=compiler.inductor_seconds,
        graphs_disabled_reason=reason, padding=padding_note))
    step = StepState()
    escaping = _escaping_outputs(split_gm)
    input_args = _input_args(split_gm)
    runners = {}
    for spec in split.pieces:
        submod = getattr(split_gm, spec.name)
        if spec.kind == COMPUTE:
            stats.pieces[spec.name] = PieceStats(spec.name)
            runners[spec.name] = PieceRunner(
                spec.name, compiled[spec.name].fn, compiled[spec.name].fake_args,
                _positions(input_args[spec.name], static_placeholders),
                frozenset(escaping.get(spec.name, ())), step, stats.pieces[spec.name],
                config.warmup_runs, config.clone_outputs, padding.get(spec.name), staging[spec.name],
                _positions(input_args[spec.name], unmasked[spec.name]), policy.agreement)
            # An instance attribute shadows the registered submodule (kept for inspection).
            split_gm.__dict__[spec.name] = runners[spec.name]
        else:
            split_gm.__dict__[spec.name] = submod.forward  # skip nn.Module.__call__ overhead
    unmasked_writes = tuple(dict.fromkeys(w for writes in unmasked.values() for w in writes))
    # the parameters/buffers whose addresses choose the set of graphs (not our own step-scalar tensor)
    weight_indices = tuple(i for i in sorted(static_inputs) if isinstance(fake_inputs[i], torch.Tensor)
                           and not (rewrite is not None and i == len(fake_inputs) - 1))
    graph = CompiledGraph(split, compiled, runners, step, stats, config, sources, symbols, pad_position, policy,
                          reason, any_requires_grad, fake_inputs, fake_outputs, static_inputs, rewrite,
                          unmasked_writes, weight_indices)
    stats.serial = graph.serial
    stats.build_seconds = time.perf_counter() - started
    graph.signatures = signatures
    _COMPILED.add(graph)
    if config.mode == "full" and len(split.pieces) > 1:
        log.warning("piecewise: graph %d: full mode, but %d nodes must run eagerly, so it is captured in %d "
                    "pieces: %s", graph.serial, sum(len(p.eager_reasons) for p in split.pieces),
                    len(compute_names), "; ".join(r for p in split.pieces for r in p.eager_reasons[:1]))
    log.info("piecewise: compiled graph %d: %d pieces (%d compute), %d Inductor compiles; graphs: %s; padding: %s",
             graph.serial, stats.num_pieces, stats.num_compute_pieces, stats.inductor_compiles,
             reason or "per shape key", padding_note)
    return graph


def piecewise(gm: torch.fx.GraphModule, example_inputs: list, options: Mapping[str, Any] | None = None,
              **kwargs) -> CompiledGraph:
    """The backend Dynamo calls: ``torch.compile(model, backend="piecewise", options={...})``."""
    if kwargs:
        raise TypeError(f"piecewise backend: unexpected arguments {sorted(kwargs)}; pass settings as "
                        f"torch.compile(..., options={{...}}).")
    return build(gm, example_inputs, PiecewiseConfig.from_options(options))
