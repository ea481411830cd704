"""Dispatch modes that watch the ATen ops a piece runs: torch's ``TorchDispatchMode``
(``torch.utils._python_dispatch``, the same on 2.11 through 2.14)."""

from __future__ import annotations

import torch


class RandomOpsSeen:
    """A dispatch mode that notes whether any ATen op it sees draws random numbers (``.seen``).

    The ``nondeterministic_seeded`` tag is how torch marks such ops (``randn``, ``bernoulli``,
    ``native_dropout``, ``multinomial``...); composite ops reach it decomposed. Used around a piece's
    fake run, under Dynamo's fake mode. ``TorchDispatchMode`` is torch's own way to watch ops
    (``torch.utils._python_dispatch``, same on 2.11 and 2.13).
    """

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Mode(TorchDispatchMode):
            seen = False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
                    self.seen = True
                return func(*args, **(kwargs or {}))

        return _Mode()


class OpsInFlight:
    """A dispatch mode that notes the op whose call raised (``.raised``; None once a later op
    succeeds, so an error some caller caught and survived is not blamed): a capture that fails names
    the op whose host code broke it.

    An op's handler runs with the mode off, so the ops a custom op calls inside are not seen: the op
    named is the one the compiled code called. Same ``TorchDispatchMode`` as :class:`RandomOpsSeen`.
    """

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Mode(TorchDispatchMode):
            raised = None

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                try:
                    out = func(*args, **(kwargs or {}))
                except BaseException:
                    self.raised = func
                    raise
                self.raised = None
                return out

        return _Mode()
