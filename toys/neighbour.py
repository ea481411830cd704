"""A server's other CUDA work, on a thread of its own: what a lazily capturing model lives beside.

A serving process copies results to the host (a sync), allocates, and samples (random numbers) on
other threads while the model captures graphs at new sizes. :class:`Neighbour` loops exactly that,
``(y * 2).sum().item()`` and ``torch.empty(1 << 16).normal_()``, and counts what raises there.
``own_generator=True`` draws the random numbers from a ``torch.Generator`` of its own instead of the
device's default one (on torch 2.11 the default one can fail while a capture begins: README).
"""

from __future__ import annotations

import threading

import torch


class Neighbour(threading.Thread):
    """Start it, do your work, then :meth:`finish`; ``errors`` counts by message, ``iterations`` loops."""

    def __init__(self, device: str = "cuda", own_generator: bool = False):
        super().__init__(daemon=True)
        self.device, self.own_generator = device, own_generator
        self.stop = threading.Event()
        self.iterations, self.errors = 0, {}

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def run(self) -> None:
        generator = torch.Generator(device=self.device) if self.own_generator else None
        with torch.no_grad():
            y = torch.randn(4096, device=self.device)
            while not self.stop.is_set():
                try:
                    (y * 2).sum().item()
                    torch.empty(1 << 16, device=self.device).normal_(generator=generator)
                except Exception as exc:  # noqa: BLE001 - every error the other thread sees counts
                    text = str(exc).splitlines()[0][:120]
                    self.errors[text] = self.errors.get(text, 0) + 1
                self.iterations += 1

    def finish(self) -> Neighbour:
        self.stop.set()
        self.join()
        return self
