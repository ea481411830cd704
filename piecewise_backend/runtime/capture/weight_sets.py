"""Parameters and buffers that move get graphs of their own; the user's tensors are never written.

Captured graphs read parameters and buffers in place, at the addresses they had at capture. After
``model.load_state_dict(sd, assign=True)``, a ``.to()`` round trip, or when one compiled function is
called with a second model's weights, those addresses change. Copying the new values into the
captured tensors would be cheap and wrong: those tensors belong to the user (model A would silently
take model B's weights). So each distinct *set* of addresses gets graphs of its own, captured on
first sight like a new batch size, for up to ``max_weight_sets`` sets per compiled graph (past that,
see below). Each set's graphs are only ever replayed with every parameter at the
address it was captured with, so a replay reads exactly what the caller passed.

Re-capturing costs one capture per size in use (milliseconds per size on the H200); running
un-graphed costs the launch overhead on every step, so re-capturing wins after a few steps. Past the
bound, a new set gets graphs when it comes on a second call with no other set made active in between,
replacing the least recently used set (its graphs are released). Why: transformers' ``generate()``
makes a new static cache per call, so a decode graph meets a new set of cache addresses at every
``generate()``; a fixed bound left every call after the fourth un-graphed. Addresses that are new at
every call (beam search reorders the static cache into new tensors each step) never come twice and
stay un-graphed: a capture per call would cost more than the run.

The check is one pass over the graph's parameters/buffers per call, not one per piece: torch's C++
comparison of their ``data_ptr`` values with the active set's where torch has it (CUDA builds), else
a tuple of them built in Python and compared.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from ... import _torch_internals
from .retries import CaptureRetries

_data_ptr = torch.Tensor.data_ptr


@dataclasses.dataclass
class FullGraphState:
    """A weight set's full graphs (``full_graph.py``): the whole call captured as one graph per key."""

    graphs: dict = dataclasses.field(default_factory=dict)  # shape key -> captured full graph
    failed: dict = dataclasses.field(default_factory=dict)  # shape key -> why its capture failed
    routes: dict = dataclasses.field(default_factory=dict)  # shape key -> capture_policy.Route
    unreplayed: set = dataclasses.field(default_factory=set)  # keys captured lazily, never replayed since

    def clear(self) -> int:
        released = len(self.graphs)
        self.graphs.clear()
        self.routes.clear()
        self.unreplayed.clear()
        return released


@dataclasses.dataclass
class WeightSet:
    """What a compiled graph keeps per set of parameter addresses."""

    number: int  # 1 for the first set seen, 2 for the next, ...
    captured: set = dataclasses.field(default_factory=set)  # shape keys captured
    routes: dict = dataclasses.field(default_factory=dict)  # shape key -> capture_policy.Route
    captures: dict = dataclasses.field(default_factory=dict)  # piece name -> {shape key: captured graph}
    failed: dict = dataclasses.field(default_factory=dict)  # piece name -> shape keys whose capture failed
    unreplayed: set = dataclasses.field(default_factory=set)  # keys captured lazily, never replayed since
    retries: CaptureRetries = dataclasses.field(default_factory=CaptureRetries)  # keys whose capture failed
    full: FullGraphState = dataclasses.field(default_factory=FullGraphState)
    generation: int = 0  # one up at each release: a capture behind asked for before it is dropped

    def bind(self, runners: dict) -> None:
        """Point each piece's runner at this set's graphs of it (the runners replay from them)."""
        for name, runner in runners.items():
            runner.use_graphs(self.captures.setdefault(name, {}), self.failed.setdefault(name, set()))

    def drop(self, key: tuple) -> None:
        """Forget the graphs of one shape key (its capture failed somewhere, or a busier key replaces it)."""
        for captures in self.captures.values():
            captures.pop(key, None)
        for failed in self.failed.values():
            failed.discard(key)
        self.captured.discard(key)
        self.unreplayed.discard(key)
        self.routes.clear()

    def release(self) -> int:
        """Forget this set's graphs; the number of keys released. Keys whose capture failed stay
        un-graphed."""
        released = len(self.captured)
        self.generation += 1
        for captures in self.captures.values():
            captures.clear()
        self.captured.clear()
        self.unreplayed.clear()
        self.routes.clear()  # routes to captured keys would replay graphs that are gone
        return released + self.full.clear()


class WeightSets:
    """The sets of parameter/buffer addresses a graph has seen, and which one is active."""

    def __init__(self, static_indices: tuple[int, ...], limit: int):
        self.limit = limit
        self._indices = list(static_indices)
        self._ptrs_equal = _torch_internals.data_ptrs_check() if static_indices else None
        self._active_ptrs: list = []  # the active addresses, indexed like the args (for the C++ check)
        if not static_indices:
            self.addresses = lambda args: ()
        elif len(static_indices) == 1:
            (only,) = static_indices
            self.addresses = lambda args: (args[only].data_ptr(),)
        else:
            getter = operator.itemgetter(*static_indices)
            self.addresses = lambda args: tuple(map(_data_ptr, getter(args)))
        self._sets: dict[tuple, WeightSet] = {}  # least recently activated first
        self._created = 0  # sets made so far (the next one's number - 1)
        self.replaced = 0  # sets dropped past the bound for a newer one
        self._refused: tuple | None = None  # the new addresses of the last refused call, since a switch
        self.active_addresses: tuple | None = None
        self.active: WeightSet | None = None

    def __len__(self) -> int:
        return len(self._sets)

    def all(self) -> list[WeightSet]:
        return list(self._sets.values())

    def unchanged(self, args: tuple) -> bool:
        """Is every parameter/buffer where the active set has it? (The per-call check.)"""
        if self._ptrs_equal is not None and self.active_addresses is not None:
            return self._ptrs_equal(list(args), self._active_ptrs, self._indices)
        return self.addresses(args) == self.active_addresses

    def find(self, addresses: tuple) -> WeightSet | None:
        """The set of these addresses: known; new while under the bound; new past it when a call
        with the same addresses was refused before and no other set was made active since (then the
        least recently used set is dropped, with its graphs). None otherwise: the call runs
        un-graphed."""
        found = self._sets.get(addresses)
        if found is not None:
            return found
        if len(self._sets) >= self.limit:
            if addresses != self._refused:
                self._refused = addresses
                return None
            del self._sets[next(iter(self._sets))]  # least recently activated first (activate() reorders)
            self.replaced += 1
        self._created += 1
        found = self._sets[addresses] = WeightSet(self._created)
        return found

    def first_moved(self, addresses: tuple, names: tuple) -> str:
        """Which input's address differs from the active set's, for the warnings ("first seen": none active)."""
        if self.active_addresses is None:
            return "first seen"
        moved = [names[i] for i, new, old in zip(self._indices, addresses, self.active_addresses) if new != old]
        return f"{moved[0]}" + (f" and {len(moved) - 1} more" if len(moved) > 1 else "") if moved else "none"

    def activate(self, addresses: tuple, weight_set: WeightSet) -> None:
        self._sets[addresses] = self._sets.pop(addresses)  # now the most recently used
        self._refused = None
        self.active_addresses, self.active = addresses, weight_set
        if self._indices:
            self._active_ptrs = [None] * (max(self._indices) + 1)
            for i, address in zip(self._indices, addresses):
                self._active_ptrs[i] = address
