"""The small closed sets of words the backend decides between, as enums.

They are ``str`` enums: each compares equal to its text (``PieceKind.COMPUTE == "compute"``) and
prints as it (``f"{Miss.OVER_BUDGET}"`` is ``over the capture budget``), so stats tables and
messages read the same as before, while code names the member and a typo is an AttributeError.
"""

from __future__ import annotations

import dataclasses
import enum


class _Text(str, enum.Enum):
    """A str enum that prints as its value on every Python (3.12 changed what ``format`` does)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    __hash__ = str.__hash__  # a member and its text are the same dict key


class PieceKind(_Text):
    """What a piece of the split graph is (``split/splitting.py``)."""

    COMPUTE = "compute"  # compiled with Inductor, replayed from CUDA graphs
    SPLIT = "split"  # holds a splitting op (attention): runs eagerly between the replays
    EAGER = "eager"  # only nodes that must run eagerly (writes to inputs, per-step scalars)


class Miss(_Text):
    """Why a call runs un-graphed though the graph could have graphs (``stats.misses`` counts by it)."""

    ABOVE_MAX = "above the largest capture size"
    NOT_A_CAPTURE_SIZE = "not a capture size and padding=False"
    NOT_CAPTURED = "not captured and lazy_capture=False"
    OVER_BUDGET = "over the capture budget"
    WEIGHTS_MOVED = "parameters at new addresses, past max_weight_sets"
    NEVER_REPLAYED = "a new shape while the shapes captured before were never replayed"
    MODE_NONE = "cudagraph_mode('none') around the call"
    CAPTURING_BEHIND = "its size's graph is being captured behind the call"


class CaptureHow(_Text):
    """How a shape key came to be captured (``CaptureEvent.how``)."""

    LAZY = "lazy"  # the first call at that size captured it
    BEHIND = "behind"  # by the capture thread, behind the call that first needed it (capture_behind)
    UP_FRONT = "up-front"  # before a call needed it: eager_capture_sizes or capture()
    EAGER = "up-front"  # the old name, an alias ("eager" means un-graphed: PieceKind.EAGER)


class GraphMode(_Text):
    """How one call is graphed (``cudagraph_mode``, chosen per call by the caller)."""

    PIECEWISE = "piecewise"  # compute pieces replayed from graphs, splitting ops eager between them
    FULL = "full"  # the whole call, splitting ops included, one CUDA graph per size (the caller vouches)
    NONE = "none"  # compiled, un-graphed (a profiling run, a step the caller wants eager)


@dataclasses.dataclass(frozen=True)
class PieceSpec:
    """One piece of the split graph, in execution order (``split/splitting.py`` makes them; the plan
    and the reports read them)."""

    name: str  # submodule name in the split graph, e.g. "submod_3"
    index: int
    kind: PieceKind  # compute, split (holds a splitting op) or eager (only nodes that must run eagerly)
    split_ops: tuple[str, ...]  # splitting ops it holds
    eager_reasons: tuple[str, ...]  # why its non-split nodes run eagerly, one line per node
    num_ops: int
    writes_inputs: tuple[str, ...] = ()  # graph inputs (parameters/buffers) a compute piece writes


STEP_SCALARS_ENABLE = 0  # the step scalars' slot 0: 1 = write, 0 = write every element back unchanged


@dataclasses.dataclass(frozen=True)
class Slot:
    """One step scalar (``rewrite/step_scalars.py``): which graph input feeds it and what it must satisfy."""

    arg: int  # position of the SymInt graph input
    name: str
    low: int  # value must be >= low ...
    high: int  # ... and <= high
    what: str  # the reader it guards, for the error message
