"""Ranks that run in lockstep must capture in lockstep: capture decisions agreed across the group.

A graph with a collective in it (a tensor-parallel all-reduce) runs on every rank of that
collective's group with the same shapes at the same step. Decisions that depend only on the shape
key (capture sizes, padding, lazy vs eager) are therefore the same on every rank. The budget's are
not: each rank measures its own graph pool. And a rank that captures runs each piece more often
than one that does not (warm-up, then the replay that produces the call's outputs), so its
collectives would no longer pair up with the other ranks': NCCL hangs. So whenever the budget is
asked, the ranks of every group the graph's collectives use agree, by an all-reduce of "allowed",
and capture only if all allow. Likewise after each piece's capture attempt: a capture that
failed on one rank is given up on all (``PieceRunner``), before any replay, so every rank runs that
piece the same way.

Which groups: read from the graph at compile time (``plan/collectives.py``), handed over in the
plan as group names. A graph without collectives never talks to other ranks: data-parallel
replicas that see different batch sizes keep deciding alone.
"""

from __future__ import annotations

import torch

from .. import _torch_internals


class RankAgreement:
    """``all_allow(ok)``: True only if every rank of every group passes True (one all-reduce each)."""

    def __init__(self, group_names: list[str]):
        self.group_names = group_names

    def all_allow(self, ok: bool) -> bool:
        import torch.distributed as dist

        for name in self.group_names:
            group = _torch_internals.resolve_process_group(name)
            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
            flag = torch.tensor([int(ok)], device=device)
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
