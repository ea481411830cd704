"""Ranks that run in lockstep must capture in lockstep: per-call decisions agreed across the group.

A graph with a collective in it (a tensor-parallel all-reduce) runs on every rank of that
collective's group with the same shapes at the same step. Decisions that depend only on the shape
key (capture sizes, padding, lazy vs eager, deferral and retry counts) are therefore the same on
every rank. Two kinds are not:

* **The budget's**: each rank measures its own graph pool. So whenever the budget is asked, the
  ranks agree, by an all-reduce of "allowed", and capture only if all allow. Likewise after each
  piece's capture attempt: a capture that failed on one rank is given up on all (``PieceRunner``),
  before any replay, so every rank runs that piece the same way.
* **The weights'** (``weight_sets.py``): each rank checks its own parameters' addresses, and an
  allocator may give one rank's new static cache the old address and the other's a new one. A rank
  that switched to a new set of weights alone would capture (warm-up runs, then the replay: each
  piece's collectives more often than the other ranks run them) while the others replay, and a rank
  that ran un-graphed alone would all-reduce its real rows where the others all-reduce a padded
  graph's. Either way the collectives stop pairing up: NCCL hangs, gloo aborts. So every call of
  such a graph all-reduces "my parameters are where my graphs have them"; when any rank says no,
  every rank switches together and starts the set it switches to without graphs, so that all ranks
  hold graphs of the same shape keys and capture the next ones at the same calls.

Why every call: a rank whose addresses did not move cannot know that another's did without asking.
The question goes to a CPU (gloo) group of the same ranks, so that it never waits for the GPU: one
small all-reduce per call, on graphs with collectives only.

Which groups: read from the graph at compile time (``plan/collectives.py``), handed over in the
plan as group names. A graph without collectives never talks to other ranks: data-parallel
replicas that see different batch sizes keep deciding alone.
"""

from __future__ import annotations

import torch

from .. import _torch_internals

# A gloo group per tuple of ranks, for the questions of groups whose backend takes no CPU tensors
# (NCCL): made once, by the first call that asks, which every rank of the group makes together.
_HOST_GROUPS: dict[tuple[int, ...], object] = {}


def host_group(group):
    """``group`` itself if it takes CPU tensors (gloo, or gloo beside NCCL), else a gloo group of the
    same ranks (``new_group(use_local_synchronization=True)``: only those ranks take part)."""
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend(group)):
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _HOST_GROUPS:
        _HOST_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _HOST_GROUPS[ranks]


class RankAgreement:
    """``all_allow(ok)``: True only if every rank of every group passes True (one CPU all-reduce
    per group, see :func:`host_group`).

    Asked on every call of its graph: the groups are resolved once, at the first question (every
    rank asks it at the same call), and each keeps one flag tensor (calls of a graph never overlap:
    they hold the device's call guard)."""

    def __init__(self, group_names: list[str]):
        self.group_names = group_names
        self._flags: list | None = None  # (host group, flag tensor) per group, from the first question

    def all_allow(self, ok: bool) -> bool:
        import torch.distributed as dist

        if self._flags is None:
            self._flags = [
                (host_group(_torch_internals.resolve_process_group(name)), torch.zeros(1, dtype=torch.int64))
                for name in self.group_names
            ]
        for group, flag in self._flags:
            flag[0] = int(ok)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            ok = bool(flag.item())
        return ok

    def __repr__(self) -> str:
        return f"RankAgreement(groups={self.group_names})"


def agreed_refusal(agreement: RankAgreement | None, refusal: str | None, elsewhere: str) -> str | None:
    """This rank's reason not to capture (None: capture), made the same on every rank.

    Every rank of ``agreement`` must call this at the same point (it is a collective); a rank
    with no reason of its own gets ``elsewhere`` when another rank has one. No agreement (a graph
    without collectives): ``refusal`` as it is.
    """
    if agreement is None or agreement.all_allow(refusal is None) or refusal is not None:
        return refusal
    return elsewhere
