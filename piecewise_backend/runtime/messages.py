"""The long warnings a compiled graph gives, each with its fix, kept out of the code that decides.

Each takes the facts of the case and returns the whole message (``piecewise: graph N: ...``).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import warnings

from ..kinds import Miss

_OURS = (
    str(pathlib.Path(__file__).resolve().parents[1]),
    *importlib.util.find_spec("torch").submodule_search_locations,
)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside this package and
    torch (the user's call of the compiled model, or the model's own line Dynamo runs), counted from
    the function that calls ``warnings.warn``."""
    frame, level = sys._getframe(2), 2
    while frame is not None and (frame.f_code.co_filename.startswith(_OURS) or "importlib" in frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


class GraphWarnings:
    """One compiled graph's warnings: each topic once, at the user's line (:func:`user_stacklevel`).

    What the capture thread finds (a capture behind that failed) is said :meth:`later`: at the
    graph's next call, in the caller's thread, where ``warnings.catch_warnings`` and the user's
    filters see it and the warning points at the caller's line."""

    def __init__(self):
        self._topics: set = set()
        self.pending: list = []  # (topic, message) to say at the next call

    def once(self, topic, message: str) -> None:
        if topic not in self._topics:
            self._topics.add(topic)
            warnings.warn(message, stacklevel=user_stacklevel())

    def later(self, topic, message: str) -> None:
        self.pending.append((topic, message))

    def flush(self) -> None:
        """Say what :meth:`later` kept (the compiled graph calls this at the start of a call)."""
        pending, self.pending = self.pending, []
        for topic, message in pending:
            self.once(topic, message)


WEIGHTS_BOUND_ELSEWHERE = (
    "another rank of this graph's process groups met parameters/buffers at a new set of "
    "addresses past its max_weight_sets"
)


def weights_bound(serial: int, detail: str, elsewhere: bool = False) -> str:
    """A new set of parameter addresses past ``max_weight_sets`` (here, or on another rank when
    ``elsewhere``): this call runs un-graphed."""
    if elsewhere:
        return (
            f"piecewise: graph {serial}: {detail}: this call runs un-graphed on every rank, so that their "
            f"collectives keep pairing up; if those addresses come again there, every rank gets graphs."
        )
    return (
        f"piecewise: graph {serial}: {detail}: this call runs un-graphed. If the same addresses come "
        f"again, they get graphs in place of the least recently used set; addresses new at every call "
        f"(beam search's reordered static cache) stay un-graphed: use the dynamic cache there. Raise "
        f"max_weight_sets to keep more sets; pass the same tensor each call where the graph writes one "
        f"you own (a cache)."
    )


def weights_moved(serial: int, moved: str, number: int, limit: int) -> str:
    """Parameters (or written inputs) at new addresses: graphs are captured for them."""
    return (
        f"piecewise: graph {serial}: its parameters/buffers (or inputs it writes in place) are at new "
        f"addresses ({moved}; load_state_dict(assign=True), .to(), another model's weights, a new cache): "
        f"capturing graphs for them (set {number}; at most {limit} kept, the least recently used "
        f"replaced); the tensors captured before are never written."
    )


def over_budget(serial: int, key: tuple, detail: str, instead: str) -> str:
    return f"piecewise: graph {serial}: not capturing shape key {key}: {detail}. {instead} (see stats.summary())."


def never_replayed(serial: int, detail: str, instead: str) -> str:
    """Shapes captured and never replayed: new shapes stop being captured, and the usual causes."""
    return (
        f"piecewise: graph {serial}: not capturing new shapes: {detail}. Each would be a graph captured "
        f"for one call. {instead}; shapes captured still replay. In a decode step, usually a KV length "
        f"inside a compute piece: attention that is not scaled_dot_product_attention (transformers: "
        f'attn_implementation="sdpa" where the model supports it, or the static cache, whose shapes are '
        f"fixed), or your own attention op not in extra_splitting_ops; in a prefill, prompts of many "
        f"lengths (pad them to a few lengths to get graphs)."
    )


def refused(serial: int, key: tuple, miss, detail: str, instead_key) -> str | None:
    """A capture the budget or the churn guard refused (None: nothing to say for this miss)."""
    instead = (
        f"Those calls replay the graph of {instead_key}, padded"
        if instead_key is not None
        else ("Those calls run un-graphed")
    )
    if miss == Miss.OVER_BUDGET:
        return over_budget(serial, key, detail, instead)
    if miss == Miss.NEVER_REPLAYED:
        return never_replayed(serial, detail, instead)
    return None


def exact_sizes(serial: int, kind: str, refusal: str) -> str:
    """Padding wanted and refused: every batch size gets a graph of its own, each a capture (the
    refusal names the op, and for a custom op the declaration that lets it pad)."""
    return (
        f"piecewise: graph {serial}: {kind} graphs are captured per exact batch size, not padded into a "
        f"few: {refusal}. Each new batch size is a capture of its own (made behind the calls that meet "
        f"it, which run un-graphed meanwhile)."
    )
