"""Compiled code arriving while a graph serves (``persist/compile_behind.py``), switched in between calls.

The background compile hands over every compute piece's code at once (:meth:`CodeSwitch.post`,
one assignment: safe from any thread). The next call, before it runs anything, takes the graph's
call guard, points every runner at its new code and releases the graphs captured with the old
code (piecewise and full, for every set of weights); that call and later ones capture again,
lazily, as after a fresh build. So no call runs some pieces on the old code and some on the new,
and no graph of old code replays after the switch.
"""

from __future__ import annotations

import logging
import time

from .symbolic import spec_symbols, symbol_values

log = logging.getLogger(__name__)


def _checked(compiled, traced, specs, guards: list):
    """``compiled``, or ``traced`` for a call whose sizes break an assumption the compiler made (of
    the assumptions over this piece's symbols: checked where they can be, conservatively)."""
    mine = spec_symbols(specs)
    own = [g for g in guards if g.free_symbols <= mine]
    if not own:
        return compiled

    def run(*args):
        values = symbol_values(specs, args)
        return compiled(*args) if all(_holds(g, values) for g in own) else traced(*args)

    return run


def _holds(guard, values: dict) -> bool:
    at = guard.xreplace(values)
    return not getattr(at, "free_symbols", None) and bool(at)


class CodeSwitch:
    def __init__(self):
        self._pending: dict | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def post(self, delivery: dict) -> None:
        """``delivery``: ``{"code": {piece: callable}, "seconds": float, "compiles": int, "guards": what
        the compiler assumed of the sizes (sympy relations in this graph's symbols)}``; the code is
        loaded already (by the compile-behind thread, off the serving path: the switch only points)."""
        self._pending = delivery

    def apply(self, graph) -> None:
        """Switch ``graph`` (a CompiledGraph) to the posted code: call it before the call runs."""
        with graph.call_guard:
            delivery, self._pending = self._pending, None
            if delivery is None:  # another thread switched first
                return
            code = delivery["code"]
            for name, fn in code.items():
                runner = graph.runners[name]
                runner.fn = _checked(fn, runner.eager_fn, runner.piece.arg_specs, delivery["guards"])
            graph.compiled_code.update(code)
            released = graph.forget_graphs()
            stats = graph.stats
            stats.code_switches += 1
            stats.switched_at = time.perf_counter()
            stats.behind_timeline = {**delivery.get("timeline", {}), "switched": time.time()}
            stats.inductor_compiles += delivery["compiles"]
            stats.inductor_seconds += delivery["seconds"]
        log.info(
            "piecewise: graph %d: switched to Inductor's code (compiled behind in %.1f s); %d shape keys "
            "released, captured again as they come",
            graph.serial,
            delivery["seconds"],
            released,
        )
