"""Every private torch API the package touches, in this folder only (a structure test greps for it):
this module (tracing, fake tensors, FX, Inductor's workers), ``cuda_capture`` (capture that touches no
random-number generator), ``device_syncs`` (device-wide synchronizes that wait for a capture in
progress) and ``aot`` (torch's AOT route). Checked against torch 2.11.0 (the GPU
machine), 2.13.0 and 2.14.1: after a torch upgrade, read this folder first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from .device_syncs import guard_device_syncs  # noqa: F401 (the package's way in)
from .dispatch_modes import OpsInFlight, RandomOpsSeen  # noqa: F401 (the package's way in)


def detect_fake_mode(example_inputs: Sequence[Any]):
    """Dynamo's FakeTensorMode for this compile (from the tracing context, else the inputs)."""
    from torch._guards import detect_fake_mode as _detect

    return _detect(example_inputs)


def fakify_inputs(example_inputs: Sequence[Any], fake_mode) -> list:
    """Fake versions of the backend's example inputs, carrying Dynamo's symbols.

    Dynamo hands a backend a *fresh* FakeTensorMode that shares its ShapeEnv (the fakes in
    ``node.meta`` belong to the old one). ``from_tensor`` finds each input's symbolic context in the
    tracing context, so the new fakes have the same symbols (``s0`` for the batch) as the graph.
    """
    return [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]


def fake_propagation(fake_mode):
    """Run graph code on fake tensors the way Dynamo and AOTAutograd do: under the fake mode *and*
    the Python dispatcher.

    Without the Python dispatcher, composite ops run their C++ decomposition, and on torch 2.11
    ``linear`` on a 3-D input reads ``input.sizes()`` as plain ints: that turns the batch symbol
    into a constant (a guard ``s0 == 3``), so every batch size recompiled, and ``mark_dynamic``
    raised ConstraintViolationError. With it, the SymInt-aware Python decompositions run.
    """
    import contextlib

    from torch._dispatch.python import enable_python_dispatcher

    stack = contextlib.ExitStack()
    stack.enter_context(fake_mode)
    stack.enter_context(enable_python_dispatcher())
    return stack


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Dynamo's ``mark_dynamic`` (documented for users, but under ``torch._dynamo``): the demo's batch."""
    torch._dynamo.mark_dynamic(tensor, dim)


def warm_compile_workers() -> None:
    """Start Inductor's pool of compile worker processes now, as its own backend does on entry.

    The pool takes seconds to start; a kernel compiled before it is ready is compiled in this
    process, one at a time (``AsyncCompile.use_process_pool``). Inductor's backend warms it before
    tracing with AOTAutograd; calling ``compile_fx`` per piece skips that, so the first pieces'
    Triton kernels were compiled serially. No-op without Triton or with one compile thread.
    ``maybe_warm_pool`` checked on torch 2.11 and 2.13.
    """
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # pragma: no cover - a torch without it: nothing to warm
        return
    maybe_warm_pool()


def inductor_compile(gm: torch.fx.GraphModule, fake_args: list, fake_mode) -> tuple[Callable[..., Any], str | None]:
    """Compile one piece with Inductor, dynamic in the symbols its fake inputs carry.

    A fresh TracingContext around Dynamo's fake mode (what ``torch._inductor.standalone_compile``
    does with ``dynamic_shapes="from_tracing_context"``, whose signature differs across 2.11-2.14):
    each piece's AOTAutograd metadata stays out of Dynamo's own context, while the ShapeEnv, and so
    the guards Inductor adds, stays shared with Dynamo.

    Returns the compiled callable and the Python module Inductor generated for it (for inspection),
    caught through ``GraphLowering.save_output_code``, the hook torch's own ``run_and_get_code``
    uses; Inductor calls it on a fresh compile and on an FX-graph-cache hit (checked on 2.11 and 2.13).
    """
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.graph import GraphLowering
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    codes: list[str] = []
    previous = GraphLowering.save_output_code

    def save_output_code(code: str) -> None:
        codes.append(code)
        if previous is not None:
            previous(code)

    single_output = not isinstance(next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0], (tuple, list))
    GraphLowering.save_output_code = save_output_code
    try:
        with unset_fake_temporarily(), torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            compiled = compile_fx(gm, fake_args)
    finally:
        GraphLowering.save_output_code = previous
    # compile_fx on a GraphModule returns AOTAutograd's ``forward(*args)``, which copies the
    # ``_boxed_call`` flag of what it wraps without being boxed itself (see the "deeply wrong"
    # comment in torch/_functorch/aot_autograd.py): call it with positional args. What it returns
    # for one output comes back from a saved artifact as a list of one: remember which it was.
    try:
        compiled.piecewise_single_output = single_output
    except AttributeError:  # pragma: no cover - not a function: such code is not saved (persist/)
        pass
    return compiled, (codes[-1] if codes else None)


def symbol_hints(fake_mode) -> dict:
    """Each backed symbol's value in the call Dynamo traced (``backed_var_to_val`` on 2.11+,
    ``var_to_val`` before it; unbacked symbols have none)."""
    shape_env = fake_mode.shape_env
    return dict(shape_env.backed_var_to_val if hasattr(shape_env, "backed_var_to_val") else shape_env.var_to_val)


def non_owning_alias(t: torch.Tensor, size: Sequence[int] | None = None) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep that memory allocated (a weak reference).

    Captured outputs live in the shared graph pool; holding them strongly would stop later
    captures (other pieces, other sizes) from reusing that memory. vLLM uses a C++ op for this;
    cudagraph_trees uses these two private constructors, and so do we. ``size`` replaces ``t``'s
    shape (same strides and offset): the padded tensor that ``t`` is the first rows of. The caller
    checks that it fits in the storage (``runtime.piece_runner._fits_in_storage``).
    """
    storage = t.untyped_storage()
    meta = {
        "nbytes": storage.nbytes(),
        "data_ptr": storage.data_ptr(),
        "size": tuple(size) if size is not None else t.shape,
        "stride": t.stride(),
        "dtype": t.dtype,
        "device": t.device,
        "storage_offset": t.storage_offset(),
    }
    weak_storage = torch._C._construct_storage_from_data_pointer(meta["data_ptr"], t.device, meta["nbytes"])
    return torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata(meta, weak_storage)


def stop_pool_recording(device_index: int, pool) -> None:
    """End the allocator's "allocate into this graph pool" mode if a failed capture left it on.

    ``CUDAGraph.capture_end`` raising (a capture invalidated by a host sync, say) can skip the
    allocator's end-of-capture bookkeeping; every later capture into that pool then fails with
    "beginAllocateToPool: already recording to mempool_id" (seen on torch 2.11).
    """
    try:
        torch._C._cuda_endAllocateToPool(device_index, tuple(pool))
    except Exception:  # not recording (the normal case) or an older binding: nothing to undo
        pass


def free_cublas_workspaces() -> None:
    """Drop cuBLAS's cached workspace of every (handle, stream) (and cuBLASLt's, in the versions that
    keep one apart), so that the next matmul on a stream allocates a new one.

    A captured matmul writes its workspace at the address it had at capture. Left to itself, the
    workspace of our capture stream is allocated by the warm-up, outside the graph pool; then
    anyone who clears the workspaces hands that memory back to the allocator under our graphs.
    torch's own ``mode="reduce-overhead"`` does exactly that around each of its warm-ups and
    captures (``cudagraph_trees.clear_cublas_manager``), and the ``empty_cache()`` of its capture
    returns the memory to the driver: our next replay then wrote through a freed address
    ("illegal memory access", seen on the H200 with both backends in one process). Cleared just
    before our capture, the captured matmuls get a workspace allocated from the graph pool, which
    stays mapped while the pool lives, whoever clears the cache later. The same call
    ``clear_cublas_manager`` makes; checked on torch 2.11 and 2.13.
    """
    torch._C._cuda_clearCublasWorkspaces()


def on_dynamo_compiles(start: Callable[[], None], end: Callable[[], None]) -> None:
    """Call ``start()`` and ``end()`` around each of Dynamo's compiles, in the compiling thread.

    ``torch._dynamo.callback.callback_handler`` (the hooks cudagraph trees and vLLM time compiles
    with); its callbacks take one ``CallbackArgs`` argument. Checked on torch 2.11 and 2.13."""
    from torch._dynamo.callback import callback_handler

    callback_handler.register_start_callback(lambda _args: start())
    callback_handler.register_end_callback(lambda _args: end())


def current_raw_stream(device_index: int) -> int:
    """The caller's current CUDA stream on a device, as CUDA's handle (an int): what Inductor's
    generated code reads per kernel launch (``get_raw_stream``), far cheaper than building a
    ``torch.cuda.Stream`` to compare (checked on torch 2.11 and 2.13)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def data_ptrs_check() -> Callable[[list, list, list], bool] | None:
    """torch's C++ check ``(tensors, data_ptrs, indices) -> bool``: does ``tensors[i].data_ptr()``
    equal ``data_ptrs[i]`` for every ``i`` in ``indices``? None where torch lacks it (CPU builds).

    What ``mode="reduce-overhead"`` (``cudagraph_trees``) checks its static inputs with: one C++
    loop instead of a ``data_ptr()`` call from Python per parameter, which on the H200 machine was
    ~15 µs per decode step of a 16-layer model (150 parameters and buffers). It wants lists, and
    ``data_ptrs`` indexed like ``tensors``. Defined by CUDA builds in ``torch/csrc/cuda/Module.cpp``;
    checked on torch 2.11 (CUDA) and 2.13 (CPU: absent).
    """
    return getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def is_static_input(node: torch.fx.Node) -> bool:
    """Did Dynamo mark this graph input as a parameter/buffer with a fixed address?"""
    return "_dynamo_static_input_type" in node.meta.get("tensor_dict", {})


def is_python_scalar_input(node: torch.fx.Node) -> bool:
    """Is this graph input a Python float that Dynamo passes as a 0-dim CPU tensor?

    Under ``dynamic=True`` (``specialize_float=False``, the default) Dynamo makes each float it meets
    (``eps`` of every norm, attention's ``scaling``) a graph input, a float64 scalar tensor built per
    call, read by ``.item()`` in the graph and guarded only on its type. ``GraphArg.pass_arg_as_tensor``
    marks them (checked on torch 2.11 and 2.13).
    """
    return bool(getattr(node.meta.get("grapharg"), "pass_arg_as_tensor", False))


def generated_forward(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """``gm``'s generated ``forward``, bound, with nothing around it.

    Calling ``gm(...)`` goes through FX's lazy-recompile stub, its error-context wrapper and
    ``nn.Module.__call__``: three Python layers per decode step for nothing, once the code exists.
    ``_LazyGraphModule.force_recompile`` generates the code now (a no-op for a plain GraphModule).
    """
    generate_code(gm)
    return gm.forward


def generate_code(gm: torch.fx.GraphModule) -> None:
    """Generate a lazy graph module's code now (:func:`lazy_graph_modules`; a no-op for a plain
    one): before it serves calls, so its first call does not, under a capture or from two threads."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    _LazyGraphModule.force_recompile(gm)


def resolve_process_group(group_name: str):
    """The ProcessGroup a functional collective in a graph names (``group_name`` is a string there).

    ``torch.distributed.distributed_c10d._resolve_process_group`` is what the functional collectives
    themselves use to find it (same name and behaviour on 2.11 and 2.13).
    """
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


# -- symbols, ops, storages, graph code: small private corners read at compile time ----------------

# The C binding ``F.scaled_dot_product_attention`` wraps; Dynamo records either (2.11-2.14).
C_SDPA = torch._C._nn.scaled_dot_product_attention


def bind_fresh_unbacked_symbols(fake_mode, outputs: Any) -> None:
    """After a piece ran on fake values: bind the data-dependent symbols it made (a fresh ``u0``
    from ``.item()``) to its outputs, or drop them when it returns none of them. Left pending, the
    next op under the fake mode raises ``PendingUnbackedSymbolNotFound`` (Dynamo binds them per FX
    node; a piece is run as one call). ``compute_unbacked_bindings`` and
    ``ShapeEnv.pending_fresh_unbacked_symbols`` checked on 2.11 and 2.13."""
    from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings

    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is None or not shape_env.pending_fresh_unbacked_symbols:
        return
    try:
        compute_unbacked_bindings(shape_env, outputs)
    except Exception:  # made and used inside the piece only: nothing outside it needs them bound
        shape_env.pending_fresh_unbacked_symbols.clear()


def sym_expr(value: Any) -> Any:
    """The sympy expression behind a SymInt/SymFloat/SymBool (``s0``, ``s0 + 1``); anything else as is.

    ``SymInt.node.expr`` is how Dynamo and Inductor read a symbol (same on 2.11, 2.13, 2.14).
    """
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.expr
    return value


def is_symbol(value: Any) -> bool:
    """Is ``value`` a SymInt that is one plain symbol (``s0``, not ``s0 + 1``)?"""
    return isinstance(value, torch.SymInt) and value.node.expr.is_Symbol


def is_op_overload(target: Any) -> bool:
    """An ATen/custom op overload (``aten.add.Tensor``): what AOT-traced graphs call."""
    return isinstance(target, torch._ops.OpOverload)


def is_op_packet(target: Any) -> bool:
    """An op's overload packet (``aten.add``): what Dynamo records for ``torch.ops.ns.name(...)``."""
    return isinstance(target, torch._ops.OpOverloadPacket)


def is_higher_order_op(target: Any) -> bool:
    return isinstance(target, torch._ops.HigherOrderOperator)


def op_schema_name(target: Any) -> str:
    """``"ns::name"`` of an op overload (the overload name left off)."""
    return target._schema.name


def op_schema_arguments(target: Any) -> list:
    """The schema's arguments of an op overload (each with ``.name``, ``.alias_info``)."""
    return list(target._schema.arguments)


def storage_ref(tensor: torch.Tensor):
    """A hashable reference to ``tensor``'s storage, equal for every view of it (fake tensors too).

    ``StorageWeakRef`` is what AOTAutograd uses to find aliasing inputs (2.11-2.14); None for a
    tensor without storage.
    """
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        return StorageWeakRef(tensor.untyped_storage())
    except Exception:  # tensors without storage
        return None


def format_graph_code(title: str, gm: torch.fx.GraphModule):
    """Dynamo's lazily formatted graph code, for ``log.debug``. Formatting it matters even with DEBUG
    off: under ``depyf.prepare_debug`` this call is what writes the graph into the dump folder."""
    return torch._dynamo.utils.lazy_format_graph_code(title, gm)


def split_partition(call: torch.fx.Node) -> int:
    """The partition number of a submodule call in ``split_module``'s output: it names partition N's
    submodule ``submod_N`` (checked on torch 2.11 and 2.13)."""
    return int(str(call.target).rsplit("_", 1)[1])


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A graph module over a copy of ``gm``'s graph (nodes keep their meta, and the graph keeps
    Dynamo's codegen, which flattens the inputs as Dynamo calls them: ``graph._codegen``); lazy
    under :func:`lazy_graph_modules`."""
    from torch.fx._lazy_graph_module import _make_graph_module

    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    graph.output(graph.graph_copy(gm.graph, {}))
    return _make_graph_module(gm, graph)


def lazy_graph_modules():
    """Graph modules made inside generate their Python code when first called, not when made.

    A build makes about a hundred graph modules (``split_module``'s pieces, the pieces' fallback
    copies, the layer chains' sub-pieces) and calls few of them: most go to Inductor as graphs, and
    a fallback copy runs only if its compiled code raises. Generating and ``compile()``-ing each
    one's code cost 1.1 s of a 5.7 s warm build on the H200 (Qwen2.5-1.5B's widths, 8 layers). The
    same switch Dynamo and Inductor use (``torch.fx._lazy_graph_module``, checked on 2.11 and 2.13).
    """
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)
