"""The step protocol: what a compiled graph tells its piece runners about the call in progress.

One :class:`StepState` per compiled graph is shared by its runners (``piece_runner.py``): the graph
sets it once per call, through its methods only, and the runners read it. A capture behind the
call (``capture/behind_record.py``) makes a state of its own, so that it never changes what the
caller's call reads.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepState:
    """What the compiled graph tells every runner about the current call (see "The step protocol")."""

    graphing: bool = False
    whole: bool = False  # inside a full graph's run or capture: pieces run their compiled code as it is
    key: tuple = ()  # the shape key of the graphs to replay or capture
    size: int | None = None  # the caller's batch size when it is padded up to the key's
    key_size: int | None = None  # the key's batch size (what the graphs are captured at)
    padded: bool = False
    sym_values: dict = dataclasses.field(default_factory=dict)  # symbol -> value at the key (capture only)
    pool_ptrs: set = dataclasses.field(default_factory=set)  # outputs captured during this call
    staged: dict = dataclasses.field(default_factory=dict)  # stage key -> buffer (capturing calls)
    refreshed: dict = dataclasses.field(default_factory=dict)  # stage key -> source address copied this call

    def ungraphed(self) -> None:
        """This call runs every piece compiled but un-graphed."""
        self.graphing = self.whole = False

    def inside_full_graph(self) -> None:
        """This call is run, or captured, whole (``full_graph.py``): each piece runs its compiled code
        as it is, counted nowhere (the full graph's own stats count the call)."""
        self.graphing, self.whole = False, True

    def replay(self, key: tuple, size: int | None, padded: bool) -> None:
        """This call replays (or, for pieces without a graph of ``key``, captures) the graphs of ``key``."""
        self.graphing, self.whole, self.key, self.size, self.padded = True, False, key, size, padded
        self.refreshed.clear()

    def capturing(self, key_size: int | None, sym_values: dict) -> None:
        """This call captures: no output of an earlier capture is in the pool for it yet."""
        self.pool_ptrs.clear()
        self.staged.clear()
        self.key_size, self.sym_values = key_size, sym_values
