"""The private torch APIs that saving and loading compiled graphs touch (torch's AOT route).

Checked against torch 2.11.0 (the GPU machine) and 2.13.0: ``torch._dynamo.aot_compile_types``
(``SerializableCallable``, ``BundledAOTAutogradSerializableCallable``), the ``enable_aot_compile``
switch that gives ``torch.compile(...)`` its ``aot_compile``, and ``AOTCompiledFunction``'s
artifacts (its guards and the sources Dynamo traced). The rest of the package's private torch
use is in the rest of this folder.
"""

from __future__ import annotations

import importlib
import inspect
import io
from collections.abc import Callable
from typing import Any

import torch

try:  # the AOT route: torch 2.10+ (checked 2.11, 2.13)
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as _Bundled
    from torch._dynamo.aot_compile_types import SerializableCallable
except ImportError:  # pragma: no cover - an older torch: nothing can be saved
    _Bundled = None

    class SerializableCallable:  # type: ignore[no-redef]
        """Stand-in where torch has no AOT route (what is built cannot be saved)."""


def has_aot_route() -> bool:
    return _Bundled is not None


def aot_compile_enabled():
    """``torch.compile(...)`` gets its ``aot_compile`` method only under this switch (2.11-2.13)."""
    return torch._dynamo.config.patch(enable_aot_compile=True)


def inductor_artifact(fn: Callable) -> bytes | None:
    """Inductor's compiled code as bytes (None: not saveable). Only code compiled under the AOT
    route's settings (``bundled_autograd_cache``, set by ``aot_compile`` around the backend) carries
    the ``serialize`` it needs."""
    if _Bundled is None or getattr(fn, "serialize", None) is None:
        return None
    return _Bundled.serialize_compile_artifacts(_Bundled(fn))


def load_inductor_artifact(data: bytes, single_output: bool) -> Callable:
    """Compiled code back from :func:`inductor_artifact`'s bytes: no Inductor compile, no trace.
    It returns its outputs as a list; ``single_output``: the piece returned one value, not a tuple."""
    with torch._inductor.config.patch(enable_autograd_for_aot=True):
        fn = _Bundled.deserialize_compile_artifacts(data).compiled_fn
    if single_output:
        return lambda *args: fn(*args)[0]
    return lambda *args: tuple(fn(*args))


def single_output(fn: Callable) -> bool:
    """Whether compiled code returns one value (``inductor_compile`` marks it)."""
    return bool(getattr(fn, "piecewise_single_output", False))


def changed_sources(aot_fn: Any) -> list[str]:
    """The modules whose source Dynamo traced and that differ now (model code edited since saving):
    the artifact's guards do not see code, so this is checked on load."""
    changed = []
    for source in aot_fn._artifacts.source_info.inlined_sources:
        try:
            module = importlib.import_module(source.module)
            now = inspect.getsource(module)
        except (ImportError, OSError, TypeError):
            changed.append(f"{source.module} (cannot be read)")
            continue
        if now != source.content:
            changed.append(source.module)
    return sorted(set(changed))


def fitting(functions: list, args: tuple, kwargs: dict) -> Any | None:
    """The first saved function whose guards accept this call (its arguments bound once for all:
    they share one signature), or None."""
    f_locals = functions[0].prepare_f_locals(*args, **kwargs)
    for fn in functions:
        if fn._artifacts.guard_manager.check(f_locals):
            return fn
    return None


def guard_failure(functions: list, args: tuple, kwargs: dict) -> str:
    """Why the saved guards refuse this call: each saved function's first failing guard."""
    f_locals = functions[0].prepare_f_locals(*args, **kwargs)
    return "; ".join(str(fn._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts) for fn in functions)


def serialize_functions(functions: list) -> list[bytes]:
    """``aot_compile`` results (one per graph Dynamo made of the function) as bytes, each."""
    try:
        return [type(fn).serialize(fn).serialized_data for fn in functions]
    except RuntimeError as exc:  # torch's words (2.11, 2.13): "Failed to serialize the following objects"
        if "Failed to serialize" not in str(exc):
            raise
        raise RuntimeError(
            f"piecewise: torch's AOT route cannot save this compiled function ({str(exc).splitlines()[0]}). "
            f"The forward of one of torch's own module classes (nn.Linear, nn.Sequential, ...) is not saveable: "
            f"wrap the model in a module class of your own whose forward calls it, and save that forward."
        ) from None


#: Modules that rebuilding a saved function imports (checked on torch 2.11 and 2.13): Dynamo's
#: package and guards, AOTAutograd's bundled results, Inductor's output code and its kernels'
#: runtime. Imported ahead by ``preload``; a name a torch lacks is skipped.
LOADER_MODULES = (
    "torch._dynamo.package",
    "torch._dynamo.guards",
    "torch._functorch._aot_autograd.aot_autograd_result",
    "torch._inductor.output_code",
    "torch._inductor.codecache",
    "torch._inductor.inductor_prims",
    "torch._inductor.runtime.triton_heuristics",
    "torch._inductor.async_compile",
)


def import_loaders() -> None:
    """Import :data:`LOADER_MODULES` (a fresh process spends seconds on them: Inductor's prims and
    custom ops are built on import, and an image without bytecode caches compiles each source)."""
    for name in LOADER_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - another torch's layout: load() imports what it needs itself
            continue


def deserialize_functions(data: list[bytes]) -> list:
    """The saved functions, through torch's loader (which checks torch's version, the Python, the GPU)."""
    return [torch.compiler.load_compiled_function(io.BytesIO(one)) for one in data]


def warm_inductor(device: str) -> None:
    """Compile a tiny function with Inductor on ``device``, compiled code discarded.

    A fresh process's first Inductor compile pays for Inductor's lazy imports and the code
    generator's and toolchain's first start (on CPU, torch 2.13: 9.7 s, then 0.9 s for the next
    one); a compile worker does it while it waits for its first piece. ``compile_fx`` on a
    symbolically traced function and a fake input: checked on torch 2.13. A warm-up that fails
    leaves the cost to the first piece.
    """
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # a fake input: the warm-up allocates nothing on the device
        example = torch.empty(8, device=device)
    compile_fx(torch.fx.symbolic_trace(_tiny), [example])


def _tiny(x):
    return (x * 2).sin() + 1


def aot_compile_settings():
    """The AOTAutograd settings ``aot_compile`` compiles a backend under (2.11, 2.13): compiled code
    then carries the ``serialize`` that :func:`inductor_artifact` needs (a worker process uses them)."""
    return torch._functorch.config.patch(
        {
            "strict_autograd_cache": True,
            "bypass_autograd_cache_key": True,
            "bundled_autograd_cache": True,
            "force_non_lazy_backward_lowering": True,
            "force_autograd_cache": True,
        }
    )


def tracing(fake_mode):
    return torch._guards.tracing(torch._guards.TracingContext(fake_mode))


def fresh_fake_mode(hints: dict) -> tuple:
    """A fake mode with a ShapeEnv of its own and one dynamic symbol per symbol of ``hints`` (a sympy
    symbol of another process -> its hint); returns it, the ShapeEnv and that symbol map."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    shape_env = ShapeEnv()
    symbols = {
        sym: shape_env.create_symbol(hint, ConstantSource(f"piecewise_{sym}"), dynamic_dim=DimDynamic.DYNAMIC)
        if hint is not None
        else shape_env.create_unbacked_symint().node.expr  # a size with no hint: unbacked
        for sym, hint in hints.items()
    }
    hints = {sym: hint if hint is not None else 64 for sym, hint in hints.items()}  # a size to evaluate strides at
    return FakeTensorMode(shape_env=shape_env), shape_env, (symbols, hints)


def in_their_symbols(expr, symbols: tuple):
    """A guard of this process's ShapeEnv in the symbols of the process that sent the job."""
    mine, _ = symbols
    return expr.xreplace({ours: theirs for theirs, ours in mine.items()})


def fake_value(shape: list, strides: list, symbols: tuple, fake_mode, **like) -> torch.Tensor:
    """A fake tensor in ``fake_mode`` of a described shape, its symbols mapped (``like``: dtype, device...)."""
    size = [symint(s, symbols, fake_mode) for s in shape]
    stride = [symint(s, symbols, fake_mode) for s in strides]
    with fake_mode:
        return torch.empty_strided(size, stride, **like)


def symint(expr, symbols: tuple, fake_mode):
    """A described size (an int or an expression in the sender's symbols) in this process's ShapeEnv."""
    if isinstance(expr, int) or not getattr(expr, "free_symbols", None):
        return int(expr)
    mine, hints = symbols
    ours = expr.xreplace(mine)
    if any(s.name.startswith("u") for s in ours.free_symbols):  # unbacked: no hint
        return fake_mode.shape_env.create_symintnode(ours, hint=None)
    return fake_mode.shape_env.create_symintnode(ours, hint=int(expr.xreplace(hints)))


def propagate_fake_values(gm: torch.fx.GraphModule, fakes: list, fake_mode) -> None:
    """Give every node its fake value (``meta["val"]``), as Dynamo's graphs have them."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*fakes)
