"""Captures behind the callers: one thread records the graphs that calls asked for, while calls go on.

Why: a call whose size has no graph yet used to capture it inline, so a serving engine's request
waited for every capture (a second at the first 128-row step of a 28-layer model). With
``capture_behind`` (the default) such a call is served at once, by the smallest larger graph it may
pad into or un-graphed (``decisions.py`` decides), and hands the capture to this thread as a
:class:`BehindJob`; the calls of its size after the thread is done replay the new graph.

What makes a capture behind harmless (checked by construction, ``behind_record.py``):

* **it runs no kernel.** No warm-up run, no replay: the calls that asked for it ran every kernel it
  records already (a CUDA capture records launches, it does not execute them), so a KV cache or any
  buffer a request reads is never written by it. Inputs that are not used in place are buffers the
  graph owns, left as they are (``buffers.owned_copy(fill=False)``);
* **it changes no state a call reads.** It records with a step state of its own, under the calls'
  own context (``contextvars``: a forward context an op reads metadata from), grad and inference
  mode, and on the caller's stream for what it allocates outside the capture;
* **it hands over atomically.** Graphs are recorded holding only the device's capture lock (one
  capture at a time per device), then published under the call guard in one short step, for the
  weight set they were asked for, unless that set's graphs were released meanwhile;
* **other threads stay untouched**: captures run in ``"thread_local"`` capture mode, without the
  default CUDA generator (``devices.py``); graphs that draw random numbers, read host tensors or
  have collectives are never captured behind (``decisions.py`` keeps them inline: collectives need
  every rank capturing in step).

A capture that fails behind is warned about at the next call of its graph, in the caller's thread
(the warning points at the caller's line), and its size runs un-graphed until it is retried
(``retries.py``). ``piecewise_backend.wait_for_captures()`` waits for the thread to be idle: before
a capture of the caller's own in torch's default ``"global"`` capture mode, which forbids the
thread's allocations meanwhile (``torch.cuda.graph(..., capture_error_mode="thread_local")`` does
not), a caller that wants no retry waits for it.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ...kinds import CaptureHow, GraphMode

log = logging.getLogger(__name__)  # under the "piecewise_backend" logger


@dataclasses.dataclass(eq=False)
class BehindJob:
    """One shape key to capture behind the calls, with what its recording needs from the call that
    asked for it (its args are not kept: only the tensors used in place, which later calls must pass
    at the same addresses anyway)."""

    graph: weakref.ref  # the CompiledGraph
    mode: GraphMode  # piecewise (every compute piece) or full (the whole call)
    key: tuple
    weight_set: Any  # the WeightSet its graphs belong to
    generation: int  # the set's generation when asked (released since: the graphs are dropped)
    template: list  # the asking call's args: tensors used in place and Python scalars; None elsewhere
    values: dict  # symbol -> value at the key
    how: CaptureHow = CaptureHow.BEHIND
    context: contextvars.Context = dataclasses.field(default_factory=contextvars.copy_context)
    grad: bool = dataclasses.field(default_factory=torch.is_grad_enabled)
    inference: bool = dataclasses.field(default_factory=torch.is_inference_mode_enabled)
    stream: Any = None  # the asking call's CUDA stream (what the recording allocates outside a capture)
    ident: tuple = dataclasses.field(init=False)  # (the graph's id, mode, key): one job per key at a time

    def __post_init__(self) -> None:
        self.ident = (id(self.graph()), self.mode, self.key)


class CaptureThread:
    """The one thread of the process that captures behind the calls, and its queue (first in, first
    out; a key already queued is not queued again)."""

    def __init__(self, capture: Callable[[BehindJob], None]):
        self._capture = capture
        self._jobs: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._queued: dict = {}  # ident -> job, queued or being captured
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._calls = threading.local()  # .held: the jobs a call of this thread submitted (hold)

    def submit(self, job: BehindJob) -> bool:
        """Queue ``job``; False if its key is queued or being captured already. Inside a call
        (:meth:`hold`), the job waits for the end of that call (:meth:`release`)."""
        held = getattr(self._calls, "held", None)
        with self._cond:
            if self._stopping or job.ident in self._queued:
                return False
            self._queued[job.ident] = job
            if held is not None:
                held.append(job)
                return True
            self._start([job])
        return True

    def hold(self) -> list | None:
        """Hold the jobs this thread submits until :meth:`release`; None inside a call that holds already.

        Why: a capture behind runs no kernel, so it must meet none that has never run. Inductor tunes
        a kernel of several configurations at its first launch (``torch.cuda.synchronize`` between
        timed runs: illegal inside a capture), Triton compiles and loads a kernel at its first launch
        (a module load: illegal too). The call that asks for a key runs the graph's kernels itself,
        so its jobs go to the thread once it has run, never while it runs."""
        if getattr(self._calls, "held", None) is not None:
            return None
        self._calls.held = held = []
        return held

    def release(self, held: list | None, ran: bool) -> None:
        """End :meth:`hold`: queue the held jobs if the call ran, else drop them (a call that raised
        may not have run every kernel; a later call asks again)."""
        if held is None:
            return
        self._calls.held = None
        if not held:
            return
        with self._cond:
            if ran and not self._stopping:
                self._start(held)
                return
            for job in held:
                self._queued.pop(job.ident, None)
            self._cond.notify_all()

    def _start(self, jobs: list) -> None:
        """Queue ``jobs`` (the caller holds the condition), the thread started if it is not running."""
        self._jobs.extend(jobs)
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="piecewise-capture-behind", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def jobs(self) -> list:
        """The jobs queued or being captured."""
        return list(self._queued.values())

    def wait(self, graph=None, timeout: float | None = None) -> bool:
        """Wait until no job of ``graph`` (any graph: None) is queued or being captured; True if none is
        left within ``timeout`` seconds. From the capture thread itself: False at once."""
        if threading.current_thread() is self._thread:
            return False

        def idle() -> bool:
            return not any(graph is None or j.graph() is graph for j in self._queued.values())

        with self._cond:
            return self._cond.wait_for(idle, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._stopping)
                if self._stopping:
                    return
                job = self._jobs.popleft()
            try:
                job.context.run(self._capture, job)
            except Exception:  # noqa: BLE001 - the thread serves every graph: one failure stops none
                log.exception("piecewise: capture behind of shape key %s failed", job.key)
            finally:
                with self._cond:
                    self._queued.pop(job.ident, None)
                    self._cond.notify_all()

    def stop(self, timeout: float = 30.0) -> None:
        """No more jobs; wait for the one being captured (a capture cut by the interpreter's exit
        would leave the device mid-capture)."""
        with self._cond:
            self._stopping = True
            self._jobs.clear()
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
