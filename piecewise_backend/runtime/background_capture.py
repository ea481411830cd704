"""``eager_capture_sizes`` captured behind the first call, in a thread, not before its output.

Why: a server's first request should not wait for graphs of sizes it may never see (each capture
is tens of milliseconds; "all" sizes, seconds). So the graph's first call hands the sizes to a
thread of its own and is served at once, un-graphed (as is any call that would capture while the
thread runs: ``Miss.CAPTURING_BEHIND``). The thread captures them one at a time, largest first,
through the graph's ``capture()``: each size holds the device's call guard (``call_guard.py``) only
while it is captured, so the caller's calls go on between sizes; a call that comes during one
waits for it, as it would for a lazy capture. The thread runs
under the grad mode of the first call (graphs and their outputs are the same as in its thread).

Not for graphs with collectives (tensor parallel): every rank must capture in one order with its
collective calls, which a thread beside the caller's cannot promise; those capture on the first
call, before its output, as up-front capture always did. Nor on a process on its way out: the
thread stops between sizes, and is waited for at exit (a capture cut by the interpreter's end
would leave the device mid-capture).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable

import torch

_RUNNING: weakref.WeakSet = weakref.WeakSet()  # what exit waits for
_STOPPING = threading.Event()


class BackgroundCapture:
    """One graph's up-front sizes, captured by a thread started at its first call."""

    def __init__(
        self,
        capture: Callable[[list[int]], list],
        sizes: Iterable[int],
        warn: Callable[[str], None],
        device: torch.device,
    ):
        self._capture, self.sizes, self._warn, self._device = capture, list(sizes), warn, device
        self._inference, self._grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        self.done = threading.Event()
        self.captured: list[tuple] = []
        self._thread = threading.Thread(target=self._run, name="piecewise-up-front-capture", daemon=True)

    def start(self) -> BackgroundCapture:
        _RUNNING.add(self)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every size was captured (or refused); True if it finished in ``timeout``."""
        return self.done.wait(timeout)

    def _run(self) -> None:
        try:
            with torch.inference_mode(self._inference), torch.set_grad_enabled(self._grad), self._on_device():
                for size in self.sizes:
                    if _STOPPING.is_set():
                        return
                    self.captured += self._capture([size])
        except ReferenceError:  # the graph was dropped (Dynamo reset): nothing left to capture for
            return
        except Exception as exc:  # noqa: BLE001 - the caller's calls go on, lazily captured; say why
            self._warn(
                f"piecewise: eager_capture_sizes stopped after {len(self.captured)} sizes: "
                f"{type(exc).__name__}: {exc}. Other sizes are captured as they come."
            )
        finally:
            self._capture = self._warn = None  # no cycle back to the graph once done (it holds this object)
            self.done.set()

    def _on_device(self):
        return torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext()


@atexit.register
def _stop_all() -> None:
    _STOPPING.set()
    for job in list(_RUNNING):
        job.wait(timeout=30)
