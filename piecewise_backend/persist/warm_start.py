"""Save a compiled model, and start the next process from it: no Dynamo trace, no Inductor compile.

:func:`save` compiles a function whole (``fullgraph=True``, as serving engines compile their models)
through torch's own AOT route (``torch.compile(...).aot_compile``) and writes what it made: Dynamo's
bytecode and guards, and this backend's compiled graph (``artifact.py``). :func:`load` reads it back
in a new process; the loaded function checks the saved guards on every call, as Dynamo would.

Nothing that does not fit runs: an artifact from another torch or package version, for another
device, or for model code edited since (the sources Dynamo traced are compared), is refused when
loading, and a call the saved guards refuse (another dtype, another input rank) is not run on it.
Either way the function is compiled as it would have been without the artifact, and a warning says
why, once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

import torch

from . import _torch_internals


def _compile(fn: Callable, options: Mapping | None, dynamic: bool | None) -> Callable:
    return torch.compile(fn, backend="piecewise", fullgraph=True, options=dict(options or {}), dynamic=dynamic)


def _examples(example_inputs) -> list[tuple[tuple, dict]]:
    """Each example call as ``(args, kwargs)``: one call (a tuple of arguments, or ``(args, kwargs)``)
    or a list of calls."""
    calls = example_inputs if isinstance(example_inputs, list) else [example_inputs]
    out = []
    for call in calls:
        if isinstance(call, tuple) and len(call) == 2 and isinstance(call[0], tuple) and isinstance(call[1], dict):
            out.append(call)
        elif isinstance(call, tuple):
            out.append((call, {}))
        else:
            raise TypeError(
                f"piecewise.save: an example call is a tuple of arguments or (args, kwargs); got {type(call).__name__}"
            )
    return out


class WarmFunction:
    """Saved compiled functions (one per graph), called as the function they were made from (a bound
    method's ``self`` passed as the saved code expects), or its fallback compile where none fits."""

    def __init__(self, functions: list, fn: Callable, options: Mapping | None, dynamic: bool | None):
        self.functions, self.fn = functions, fn
        self._bound = (fn.__self__,) if hasattr(fn, "__self__") and not isinstance(fn, torch.nn.Module) else ()
        self._options, self._dynamic = options, dynamic
        self._fallback: Callable | None = None

    @property
    def fallback(self) -> Callable:
        if self._fallback is None:
            self._fallback = _compile(self.fn, self._options, self._dynamic)
        return self._fallback

    def __call__(self, *args, **kwargs):
        args = self._bound + args
        saved = _torch_internals.fitting(self.functions, args, kwargs)
        if saved is not None:
            return saved.fn(*args, **kwargs)
        if self._fallback is None:
            reason = _torch_internals.guard_failure(self.functions, args, kwargs)
            warnings.warn(
                f"piecewise: a call does not fit the saved compiled function (its guards: {reason}); "
                f"such calls are compiled and run as without it",
                stacklevel=2,
            )
        return self.fallback(*args[len(self._bound) :], **kwargs)


def save(
    fn: Callable, example_inputs, path: str, *, options: Mapping | None = None, dynamic: bool | None = None
) -> WarmFunction:
    """Compile ``fn`` (a function, or a bound method such as ``model.forward``) for ``example_inputs``,
    write it to ``path`` and return it, ready to call as ``fn``.

    ``example_inputs``: a call's arguments as a tuple (or ``(args, kwargs)``); sizes marked with
    ``torch._dynamo.mark_dynamic`` stay dynamic. Or a list of calls, one per graph Dynamo makes of
    ``fn`` (a serving step of many tokens and one of a single token: Dynamo specialises a size of 1).
    """
    examples = _examples(example_inputs)
    with _torch_internals.aot_compile_enabled():
        compiled = _compile(fn, options, dynamic)
        functions = [compiled.aot_compile(example) for example in examples]
    _torch_internals.write_functions(path, functions)
    return WarmFunction(functions, fn, options, dynamic)


def load(path: str, fn: Callable, *, options: Mapping | None = None, dynamic: bool | None = None) -> Callable:
    """``fn`` compiled as :func:`save` saved it to ``path``, with no trace and no compile; where the
    artifact does not fit (missing, another torch or package, another device, model code changed),
    a warning says why and ``fn`` is compiled with ``options`` instead."""
    try:
        functions = _torch_internals.read_functions(path)
        changed = sorted({m for f in functions for m in _torch_internals.changed_sources(f)})
        if changed:
            raise RuntimeError(f"the model's code changed since it was saved ({', '.join(changed)})")
    except Exception as exc:  # noqa: BLE001 - whatever stops the artifact: compile as without it
        warnings.warn(f"piecewise: not loading {path}: {type(exc).__name__}: {exc}. Compiling instead.", stacklevel=2)
        return _compile(fn, options, dynamic)
    return WarmFunction(functions, fn, options, dynamic)
