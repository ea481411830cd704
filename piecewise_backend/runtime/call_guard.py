"""One graphed call at a time per device, in the callers' stream order: what makes concurrent callers safe.

A compiled graph keeps state between calls that a second caller must not see half-written: the step
protocol (``StepState``: the key being replayed, the buffers of a capture), each runner's input
buffers (copied into, then read by the replay), the active weight set, the step scalars written
ahead. And every graph of every model on a device shares one graph pool (``devices.py``): the
memory one graph's replay writes is memory another graph's replay writes too. Two threads replaying
at once, or one thread on two streams, would interleave on the GPU and read each other's values
(what that came to without this guard: ``benchmarks/README.md``, "Measurement history").

So a graphed call (copy-in, replay or capture, copy-out, the scalars written ahead) holds its
device's guard, a re-entrant lock, for the whole call, and is ordered after everything the previous
guarded call enqueued: when the caller's CUDA stream is not the previous caller's, it first waits
for that stream (an event, on the GPU; the host does not wait). Calls on one stream pay a lock and a
stream-id compare (``_torch_internals.current_raw_stream``); the first call on a new stream pays one
``wait_stream``. Graphs that never capture (graphs off, grad mode) take no guard: they share nothing.

Captures have a lock of their own per device (:attr:`CallGuard.capture_lock`): one capture at a time
records into the device's pool and on its capture stream, whether a caller makes it inline (holding
the call guard first) or the capture thread makes it behind the callers (holding only this lock, so
calls go on meanwhile; it takes the call guard afterwards, for the moment it hands its graphs over).

Why a lock and not state per thread (cudagraph trees keep a tree per thread): graphs per thread
would capture every size once per thread and double the pool; one GPU runs one call's kernels after
another anyway, and the host work a guard serialises is Python that the GIL serialises already.
"""

from __future__ import annotations

import threading

import torch

from .. import _torch_internals


class CallGuard:
    """The lock and the last caller's stream of one device (CPU graphs, emulated: the lock only)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.lock = threading.RLock()
        self.capture_lock = threading.RLock()  # one capture at a time on this device (module docstring)
        self._cuda = device.type == "cuda"
        self._index = device.index if device.index is not None else (torch.cuda.current_device() if self._cuda else 0)
        self._last_raw: int | None = None  # the previous guarded call's stream, as CUDA's handle
        self._last_stream = None

    def __enter__(self) -> CallGuard:
        self.lock.acquire()
        if self._cuda:
            try:
                raw = _torch_internals.current_raw_stream(self._index)
                if raw != self._last_raw:
                    self._follow(raw)
            except BaseException:
                self.lock.release()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()

    def _follow(self, raw: int) -> None:
        """The caller's stream changed: order it after the previous caller's (GPU-side wait)."""
        stream = torch.cuda.current_stream(self._index)
        if self._last_stream is not None:
            stream.wait_stream(self._last_stream)
        self._last_raw, self._last_stream = raw, stream


_GUARDS: dict[tuple, CallGuard] = {}
_GUARDS_LOCK = threading.Lock()


def call_guard(device: torch.device) -> CallGuard:
    """The guard of ``device`` (one per device for the process, made on first use)."""
    index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    key = (device.type, index)
    guard = _GUARDS.get(key)
    if guard is None:
        with _GUARDS_LOCK:
            guard = _GUARDS.setdefault(
                key, CallGuard(torch.device(device.type, index) if index is not None else torch.device(device.type))
            )
    return guard


def guarded_devices(device_type: str) -> list[int]:
    """The indices of the devices of ``device_type`` that have a guard (a graph of theirs was made)."""
    with _GUARDS_LOCK:
        return [index for kind, index in _GUARDS if kind == device_type and index is not None]
