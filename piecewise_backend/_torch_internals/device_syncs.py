"""Device-wide synchronizes wait for a capture in progress on the device instead of failing beside it.

A ``cudaDeviceSynchronize`` waits for every stream of the device; while one of them is capturing, it
fails with ``cudaErrorStreamCaptureUnsupported`` and breaks that capture, whatever the capture's
mode (``"thread_local"`` spares other threads' unsafe calls, not this one: NVIDIA/TensorRT#2888).
The capture thread records while the callers' threads go on, so a caller's ``torch.cuda.synchronize()``,
Inductor's autotuning (it synchronizes between timed runs of a kernel's configurations) or
``torch.cuda.empty_cache()`` (``cudaFree`` synchronizes the device) would fail at a moment they
cannot know. Once a capture is handed to the thread, these two torch functions take the device's
capture lock first (:func:`guard_device_syncs`): they wait for the recording (milliseconds).

Replaced by attribute, so callers that look them up at call time (``torch.cuda.synchronize()``,
Inductor's benchmarker, Triton's ``do_bench`` through its device interface) get the wrapper; a
reference taken before, and C++ callers, do not. Checked on torch 2.11, 2.13 and 2.14
(``torch.cuda._utils._get_device_index`` is private).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch
from torch.cuda._utils import _get_device_index

_ORIGINALS: dict = {}  # name -> the torch function replaced (empty: not replaced)
_LOCK = threading.Lock()


def guard_device_syncs(capture_lock_of: Callable[[int], threading.RLock], known_devices: Callable[[], list]) -> None:
    """Make ``torch.cuda.synchronize`` and ``torch.cuda.empty_cache`` hold ``capture_lock_of(index)``
    (every device of ``known_devices()`` for ``empty_cache``, which frees on all); once per process."""
    with _LOCK:
        if _ORIGINALS:
            return
        _ORIGINALS.update(synchronize=torch.cuda.synchronize, empty_cache=torch.cuda.empty_cache)
    synchronize, empty_cache = _ORIGINALS["synchronize"], _ORIGINALS["empty_cache"]

    @functools.wraps(synchronize)
    def synchronize_after_captures(device=None):
        with capture_lock_of(_get_device_index(device, optional=True)):
            return synchronize(device)

    @functools.wraps(empty_cache)
    def empty_cache_after_captures():
        locks = [capture_lock_of(index) for index in sorted(known_devices())]
        for lock in locks:  # (in index order: two callers never wait for each other's)
            lock.acquire()
        try:
            return empty_cache()
        finally:
            for lock in reversed(locks):
                lock.release()

    torch.cuda.synchronize = synchronize_after_captures
    torch.cuda.empty_cache = empty_cache_after_captures
