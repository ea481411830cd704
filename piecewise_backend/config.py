"""``options=`` of ``torch.compile(..., backend="piecewise", options={...})`` → a frozen config.

Every key is checked here, once, at compile time, so a typo fails loudly with the list of accepted
keys instead of being silently ignored on a GPU an hour later.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .op_names import DEFAULT_SPLITTING_OPS, validate_op_names


@dataclasses.dataclass(frozen=True)
class PiecewiseConfig:
    """What the backend does; build one with :meth:`from_options`.

    Attributes:
        splitting_ops: dispatcher names of the ops to split at (run eagerly between graph replays).
            Replaces the defaults, which cover SDPA in all its torch forms.
        extra_splitting_ops: names added to ``splitting_ops`` (the usual way to add a custom op).
        cudagraphs: capture CUDA graphs of compute pieces. Off, or without CUDA tensors, pieces
            run compiled and un-graphed, with the same results.
        clone_outputs: copy the graph's outputs out of the CUDA-graph pool, so a returned tensor
            survives the next call. Set False only if you copy the outputs yourself before the
            next call (saves one copy per output per step).
        warmup_runs: eager runs of a piece before its first capture at a new shape (lets lazy
            initialisation, e.g. cuBLAS workspaces and Triton autotuning, happen outside capture).
    """

    splitting_ops: tuple[str, ...] = DEFAULT_SPLITTING_OPS
    extra_splitting_ops: tuple[str, ...] = ()
    cudagraphs: bool = True
    clone_outputs: bool = True
    warmup_runs: int = 1

    @property
    def all_splitting_ops(self) -> frozenset[str]:
        return frozenset(self.splitting_ops) | frozenset(self.extra_splitting_ops)

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> "PiecewiseConfig":
        """Validate a user's ``options`` mapping; raise ValueError/TypeError that say how to fix it."""
        options = dict(options or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise ValueError(
                f"piecewise backend: unknown option(s) {', '.join(map(repr, unknown))}. "
                f"Accepted options: {', '.join(sorted(fields))}."
            )
        for key in ("cudagraphs", "clone_outputs"):
            if key in options and not isinstance(options[key], bool):
                raise TypeError(f"piecewise backend: option {key!r} must be True or False, got {options[key]!r}.")
        if "warmup_runs" in options:
            w = options["warmup_runs"]
            if isinstance(w, bool) or not isinstance(w, int) or w < 0:
                raise ValueError(f"piecewise backend: option 'warmup_runs' must be an int >= 0, got {w!r}.")
        for key in ("splitting_ops", "extra_splitting_ops"):
            if key in options:
                value = options[key]
                if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
                    raise TypeError(
                        f"piecewise backend: option {key!r} must be a list of op names like "
                        f"['mylib::paged_attention'], got {value!r}."
                    )
                options[key] = validate_op_names(tuple(value), key)
        return cls(**options)
