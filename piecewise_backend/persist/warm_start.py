"""Save a compiled model, and start the next process from it: no Dynamo trace, no Inductor compile.

:func:`save` compiles a function whole (``fullgraph=True``, as serving engines compile their models)
through torch's own AOT route (``torch.compile(...).aot_compile``) and writes what it made: Dynamo's
bytecode and guards, and this backend's compiled graph (``artifact.py``). :func:`load` reads it back
in a new process; the loaded function checks the saved guards on every call, as Dynamo would.

Nothing that does not fit runs: an artifact from another torch or package version, for another
device, or for model code edited since (the sources Dynamo traced are compared), is refused when
loading, and a call the saved guards refuse (another dtype, another input rank) is not run on it.
Either way the function is compiled as it would have been without the artifact, and a warning says
why, once. The package's own Triton kernels travel in the file too (``artifact_file.py``), so a
fresh container compiles no kernel; :func:`preload` reads it while the model is being built.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping

import torch

from .._torch_internals import aot as _torch_internals
from .artifact_file import ArtifactFile


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
    method's ``self`` passed as the saved code expects), or its fallback compile where none fits.
    After a call that launched a kernel of the package's that the file lacks, the file gets it."""

    def __init__(
        self, functions: list, fn: Callable, options: Mapping | None, dynamic: bool | None, file: ArtifactFile
    ):
        self.functions, self.fn, self.file = functions, fn, file
        self._bound = (fn.__self__,) if hasattr(fn, "__self__") and not isinstance(fn, torch.nn.Module) else ()
        self._options, self._dynamic = options, dynamic
        self._fallback: Callable | None = None
        self.load_seconds: dict = {}  # load(): reading the file, the kernels into Triton's cache, the code

    @property
    def fallback(self) -> Callable:
        if self._fallback is None:
            self._fallback = _compile(self.fn, self._options, self._dynamic)
        return self._fallback

    def __call__(self, *args, **kwargs):
        args = self._bound + args
        saved = _torch_internals.fitting(self.functions, args, kwargs)
        if saved is not None:
            out = saved.fn(*args, **kwargs)
            self.file.keep_current()
            return out
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
    file = ArtifactFile(path, _torch_internals.serialize_functions(functions))
    file.write()
    return WarmFunction(functions, fn, options, dynamic, file)


_PRELOADS: dict[str, concurrent.futures.Future] = {}
_PRELOADS_LOCK = threading.Lock()


def preload(path: str) -> None:
    """Start reading ``path`` in a thread, before the model exists; :func:`load` takes what it read.

    The thread reads the file, puts its kernels into Triton's cache and imports the parts of torch's
    compiler that rebuilding the code needs (seconds on a fresh process, none of it needing the
    model), so that all of it overlaps building the model. The code itself is rebuilt by
    :func:`load`, in its caller's thread: rebuilding FX modules traces them, and FX's tracing patches
    ``torch.nn.Module`` for every thread while it runs (a module called meanwhile elsewhere would be
    traced too). Calling it is optional: :func:`load` does the same work itself when it was not.
    """
    key = os.path.abspath(path)
    with _PRELOADS_LOCK:
        if key in _PRELOADS:
            return
        future: concurrent.futures.Future = concurrent.futures.Future()
        _PRELOADS[key] = future

    def work() -> None:
        try:
            future.set_result(_read_file(path, imports=True))
        except BaseException as exc:  # noqa: BLE001 - load() reads it again, and says why if it fails
            future.set_exception(exc)

    threading.Thread(target=work, name="piecewise-preload", daemon=True).start()


def _read_file(path: str, imports: bool = False) -> tuple:
    """The artifact's file, its kernels put into Triton's cache (and torch's loaders imported), timed."""
    began = time.perf_counter()
    file = ArtifactFile.read(path)
    read = time.perf_counter()
    emitted = file.emit_kernels()  # before anything launches them
    emit = time.perf_counter()
    if imports:
        _torch_internals.import_loaders()
    seconds = {"read_s": read - began, "kernels_s": emit - read, "imports_s": time.perf_counter() - emit}
    return file, {**seconds, "kernels_written": emitted}


def _read(path: str) -> tuple:
    """The file as :func:`preload` read it (waited for), else read now; then its code rebuilt here."""
    with _PRELOADS_LOCK:
        future = _PRELOADS.pop(os.path.abspath(path), None)
    file = None
    if future is not None:
        began = time.perf_counter()
        try:
            file, seconds = future.result()
            seconds = {**seconds, "preloaded": True, "waited_s": time.perf_counter() - began}
        except Exception:  # noqa: BLE001 - read again here: an error then is the artifact's, said by load()
            pass
    if file is None:
        file, seconds = _read_file(path)
    began = time.perf_counter()
    functions = _torch_internals.deserialize_functions(file.functions)
    return file, functions, {**seconds, "code_s": time.perf_counter() - began}


def load(path: str, fn: Callable, *, options: Mapping | None = None, dynamic: bool | None = None) -> Callable:
    """``fn`` compiled as :func:`save` saved it to ``path``, with no trace and no compile, and the
    package's kernels the saving process launched put into Triton's cache (no Triton compile either;
    :func:`preload` earlier does this reading in a thread while the model is built);
    where the artifact does not fit (missing, another torch or package, another device, model code
    changed), a warning says why and ``fn`` is compiled with ``options`` instead."""
    try:
        file, functions, seconds = _read(path)
        changed = sorted({m for f in functions for m in _torch_internals.changed_sources(f)})
        if changed:
            raise RuntimeError(f"the model's code changed since it was saved ({', '.join(changed)})")
    except Exception as exc:  # noqa: BLE001 - whatever stops the artifact: compile as without it
        warnings.warn(f"piecewise: not loading {path}: {type(exc).__name__}: {exc}. Compiling instead.", stacklevel=2)
        return _compile(fn, options, dynamic)
    warm = WarmFunction(functions, fn, options, dynamic, file)
    warm.load_seconds = seconds  # where a warm start's load went (the startup suite reports it)
    return warm
