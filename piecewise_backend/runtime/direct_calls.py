"""Calls that skip Dynamo once their signature has been seen: ``piecewise_backend.direct(compiled)``.

Every call of a ``torch.compile``'d module runs Dynamo's guards and argument fetch before it reaches
the backend: for a 28-layer model, about a thousand guards and two hundred parameter lookups a call
(``benchmarks/README.md`` has the figures). A serving engine that captures its decode step by hand
replays its graph without any of that; so does vLLM, whose full graphs wrap the compiled model from
outside. :func:`direct` gives the backend's graphs the same path: the first call of each signature
(the shapes, dtypes, devices and strides of the tensor arguments, the other arguments' values, and
grad, inference and autocast mode) goes through Dynamo as usual, and records which compiled graph
it ran and with which arguments; later calls of that signature call that graph with the caller's
tensors put in place of the recorded ones. The backend's own per-call checks still run (weight
addresses, shape keys, capture decisions); Dynamo's do not.

What the caller vouches for, as with ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: the
module's Python state (attributes it branches on, its training flag, globals it reads) does not
change between calls; its forward has no side effect outside the graph. What is checked instead:
a parameter, buffer or submodule assigned on one of the model's modules (``load_state_dict(assign=True)``,
``module.x = ...``: torch's module registration hooks) sends every signature back through Dynamo
once (an in-place copy needs nothing: the graphs read the tensor where it is); a call
that ran more than one graph (a graph break), or whose result is not the graph's own output, or
whose tensors the graph did not take as they were, stays on Dynamo's path, and
:meth:`DirectCalls.refusals` says why.
"""

from __future__ import annotations

import contextvars
import copy
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch

_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("piecewise_direct_recording", default=None)
MAX_SIGNATURES = 256  # per wrapped callable: prefill token counts are many; the oldest recorded go


def recording() -> list | None:
    """The list a :class:`~.compiled_graph.CompiledGraph` call appends ``(graph, args, out)`` to, or None."""
    return _RECORDING.get()


class _Registrations:
    """Torch's global module registration hooks (public since torch 2.0), installed once: a parameter,
    buffer or submodule registered on a module tells each :class:`DirectCalls` whose model holds that
    module (or every one that wraps no module) that what it recorded may no longer be the model's."""

    _watchers: weakref.WeakSet = weakref.WeakSet()
    _installed = False
    _lock = threading.Lock()

    @classmethod
    def watch(cls, calls: DirectCalls) -> None:
        with cls._lock:
            cls._watchers.add(calls)
            if cls._installed:
                return
            from torch.nn.modules import module

            for register in (
                module.register_module_parameter_registration_hook,
                module.register_module_buffer_registration_hook,
                module.register_module_module_registration_hook,
            ):
                register(cls._registered)
            cls._installed = True

    @classmethod
    def _registered(cls, module, name, value):
        for calls in list(cls._watchers):
            calls.registered(module, value)
        # (None: what was registered stays as it is)


class _Route:
    """A recorded call: the graph, its arguments, where the caller's tensors go, and how to pick the
    result out of the graph's outputs."""

    __slots__ = ("graph", "template", "slots", "pick", "generation")

    def __init__(self, graph, template: list, slots: list, pick, generation: int):
        self.graph, self.template, self.slots, self.pick, self.generation = graph, template, slots, pick, generation

    def __call__(self, flat: list):
        args = self.template.copy()
        for i, j in self.slots:
            args[i] = flat[j]
        return self.pick(self.graph(*args))


class DirectCalls:
    """What :func:`direct` returns: call it as the compiled callable it wraps."""

    def __init__(self, compiled):
        self.compiled = compiled
        root = getattr(compiled, "_orig_mod", None)  # torch.compile's wrapper of a module (or of its method)
        root = getattr(root, "__self__", root)
        # the modules whose registrations matter (None: any module's, for a compiled function)
        self._modules = weakref.WeakSet(root.modules()) if isinstance(root, torch.nn.Module) else None
        self.generation = 0  # one up at each registration on one of those modules
        self._routes: OrderedDict = OrderedDict()  # signature -> _Route, or the reason it has none
        self._lock = threading.Lock()
        self.through_dynamo = 0  # calls that went through Dynamo (first sight, a refusal, a moved module)
        self.skipped_dynamo = 0  # calls that did not
        _Registrations.watch(self)

    def __getattr__(self, name: str) -> Any:  # the wrapped module's attributes, as torch.compile's wrapper gives them
        if "compiled" not in self.__dict__:  # (copy and pickle ask before __init__ ran)
            raise AttributeError(name)
        return getattr(self.__dict__["compiled"], name)

    def __copy__(self) -> DirectCalls:  # a copy records afresh (and is told of registrations)
        return DirectCalls(self.compiled)

    def __deepcopy__(self, memo) -> DirectCalls:
        return DirectCalls(copy.deepcopy(self.compiled, memo))

    def registered(self, module, value) -> None:
        """A parameter, buffer or submodule was registered on ``module``."""
        if self._modules is None or module in self._modules:
            self.generation += 1
            if self._modules is not None and isinstance(value, torch.nn.Module):
                self._modules.update(value.modules())  # a submodule set in: its own registrations count too

    def refusals(self) -> dict:
        """Per signature that stays on Dynamo's path: why."""
        return {sig: r for sig, r in list(self._routes.items()) if isinstance(r, str)}

    def __call__(self, *args, **kwargs):
        flat = [*args, *kwargs.values()]
        signature = _signature(flat, tuple(kwargs))
        route = self._routes.get(signature)
        if type(route) is _Route and route.generation == self.generation:
            self.skipped_dynamo += 1
            return route(flat)
        self.through_dynamo += 1
        if isinstance(route, str):
            return self.compiled(*args, **kwargs)
        calls: list = []
        token = _RECORDING.set(calls)
        try:
            out = self.compiled(*args, **kwargs)
        finally:
            _RECORDING.reset(token)
        route = _route_of(calls, flat, out, self.generation)  # (what the call itself registered counts as seen)
        with self._lock:
            self._routes[signature] = route
            self._routes.move_to_end(signature)
            while len(self._routes) > MAX_SIGNATURES:
                self._routes.popitem(last=False)
        return out


def direct(compiled) -> DirectCalls:
    """``compiled`` (what ``torch.compile(model, backend="piecewise")`` returned), with each later call
    of a signature it has seen skipping Dynamo's guards and going straight to the graph that served it
    (see this module's docstring for what the caller vouches for)."""
    if isinstance(compiled, DirectCalls):
        return compiled
    if not callable(compiled):
        raise TypeError(
            f"piecewise_backend.direct: expected what torch.compile returned, got {type(compiled).__name__}"
        )
    return DirectCalls(compiled)


def _signature(flat: list, kwarg_names: tuple) -> tuple:
    parts: list = [kwarg_names, torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    parts.append(torch.is_autocast_enabled("cuda"))
    parts.append(torch.is_autocast_enabled("cpu"))
    for value in flat:
        if isinstance(value, torch.Tensor):
            parts.append((value.dtype, value.device, value.shape, value.stride(), value.requires_grad))
        elif isinstance(value, (int, float, bool, str, type(None))):
            parts.append((type(value), value))
        else:
            parts.append((type(value),))  # an object: refused whichever it is (_route_of), so its type will do
    return tuple(parts)


def _route_of(calls: list, flat: list, out, generation: int) -> _Route | str:
    """The route a recorded call gives, or why it gives none."""
    if len(calls) != 1:
        return f"the call ran {len(calls)} compiled graphs (a graph break, or none): Dynamo's code runs between them"
    graph, graph_args, graph_out = calls[0]
    if any(not isinstance(v, (torch.Tensor, int, float, bool, str, type(None))) for v in flat):
        return "an argument is neither a tensor nor a plain value: Dynamo reads inside it"
    positions = {id(v): j for j, v in enumerate(flat) if isinstance(v, torch.Tensor)}
    slots = [(i, positions[id(a)]) for i, a in enumerate(graph_args) if id(a) in positions]
    if len({j for _, j in slots}) != len(positions):
        return "the graph does not take every tensor argument as it was passed (a view, or unused)"
    pick = _picker(graph_out, out)
    if pick is None:
        return "the call's result is not the graph's output: Dynamo's code builds it"
    return _Route(graph, list(graph_args), slots, pick, generation)


def _picker(graph_out, out):
    """A function from the graph's outputs to the call's result, if the result is one of them or a
    tuple of them (by identity)."""
    outputs = graph_out if isinstance(graph_out, (tuple, list)) else (graph_out,)
    index = {id(o): k for k, o in enumerate(outputs)}
    if id(out) in index and isinstance(out, torch.Tensor):
        k = index[id(out)]
        return lambda result: result if not isinstance(result, (tuple, list)) else result[k]
    if type(out) is tuple and out and all(id(o) in index and isinstance(o, torch.Tensor) for o in out):
        ks = [index[id(o)] for o in out]
        return lambda result: tuple(result[k] for k in ks)
    return None
