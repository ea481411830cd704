"""A tensor-parallel ToyLlama rank, and a decode check that compares it with the whole model.

Megatron-style: each rank holds ``heads / world`` attention heads (q/k/v column-parallel, o_proj
row-parallel) and ``intermediate / world`` MLP columns (gate/up column-parallel, down
row-parallel), with one all-reduce after o_proj and one after down. Embedding, norms and lm_head
are replicated. The all-reduces are torch's *functional* collectives, which Dynamo traces into the
graph, so they land inside compute pieces and are captured in the CUDA graphs with them (NCCL
supports capture); the attention between stays eager per rank, on its own heads.

Run it on two GPUs with ``torchrun --nproc-per-node 2 -m toys.parallel`` (NCCL), or
on a CPU with gloo (the tests do, with emulated graphs).
"""

from __future__ import annotations

import functools
import json
import os

import torch
from torch import nn

from .models import (
    LlamaAttention,
    LlamaLayer,
    LlamaMLP,
    ToyConfig,
    ToyLlama,
    init_weights_,
    reset_caches,
    sdpa_backends,
)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(x, "sum", group)


class _RowParallelAttention(LlamaAttention):
    def __init__(self, cfg: ToyConfig, attention, world: int, group):
        super().__init__(cfg, attention, heads=cfg.heads // world)
        self.group = group

    def forward(self, x, cos, sin, pos: int):
        return _all_reduce(super().forward(x, cos, sin, pos), self.group)


class _RowParallelMLP(LlamaMLP):
    def __init__(self, cfg: ToyConfig, world: int, group):
        super().__init__(cfg, intermediate=cfg.intermediate // world)
        self.group = group

    def forward(self, x):
        return _all_reduce(super().forward(x), self.group)


class ToyTPLlama(ToyLlama):
    """One rank of a ``world``-way tensor-parallel :class:`ToyLlama` (``forward(input_ids, pos)``)."""

    def __init__(self, cfg: ToyConfig, world: int, group):
        if cfg.heads % world or cfg.intermediate % world:
            raise ValueError(
                f"heads ({cfg.heads}) and intermediate ({cfg.intermediate}) must divide by the "
                f"number of ranks ({world})"
            )
        super().__init__(cfg)
        self.layers = nn.ModuleList(
            LlamaLayer(
                cfg,
                attn_cls=functools.partial(_RowParallelAttention, world=world, group=group),
                mlp_cls=functools.partial(_RowParallelMLP, world=world, group=group),
            )
            for _ in range(cfg.layers)
        )

    @classmethod
    def shard(cls, full: ToyLlama, rank: int, world: int, group) -> ToyTPLlama:
        """This rank's share of ``full``'s weights."""
        cfg = full.cfg
        part = cls(cfg, world, group)
        heads, width = cfg.heads // world * cfg.head_dim, cfg.intermediate // world
        rows = {"q_proj": heads, "k_proj": heads, "v_proj": heads, "gate": width, "up": width}
        cols = {"o_proj": heads, "down": width}
        state = {}
        for name, value in full.state_dict().items():
            module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
            if module in rows:
                value = value.narrow(0, rank * rows[module], rows[module])
            elif module in cols:
                value = value.narrow(1, rank * cols[module], cols[module])
            state[name] = value
        part.load_state_dict(state)
        return part


def toy_and_shard(cfg: ToyConfig, rank: int, world: int, device: str, dtype: torch.dtype):
    """The whole toy, on the CPU, and this rank's shard of it on ``device`` in ``dtype``.

    The weights come from ``init_weights_``'s fixed seed, the same on every rank, so the ranks'
    shards fit together without sending weights around. Needs ``torch.distributed`` initialised.
    """
    import torch.distributed as dist

    full = init_weights_(ToyLlama(cfg))
    return full, ToyTPLlama.shard(full, rank, world, dist.group.WORLD).to(device=device, dtype=dtype).eval()


def decode_check(
    rank: int,
    world: int,
    device: str,
    sizes=(3, 3, 2, 5, 8, 7, 4),
    options: dict | None = None,
    cfg: ToyConfig | None = None,
    move_weight_before: int | None = None,
) -> dict:
    """Compile this rank's shard with the piecewise backend, decode at changing batch sizes next to
    the whole model run eagerly, and report the largest logit difference and the capture decisions.

    ``move_weight_before``: the call before which this rank moves one weight to new memory (same
    values), as a rank whose allocator gave a new tensor another address would.
    Needs ``torch.distributed`` initialised (the default group is the tensor-parallel group).
    """
    import piecewise_backend

    cfg = cfg or ToyConfig(layers=2, max_batch=8, max_seq=64)
    dtype = torch.float32
    full, shard = toy_and_shard(cfg, rank, world, device, dtype)
    full = full.to(device=device, dtype=dtype).eval()
    compiled = torch.compile(shard, backend="piecewise", options=options or {})
    g = torch.Generator().manual_seed(1)
    worst, pos = 0.0, 0
    with torch.no_grad(), sdpa_backends(device):
        reset_caches(full)
        reset_caches(shard)
        for call, size in enumerate(sizes):
            if call == move_weight_before:
                weight = shard.layers[0].mlp.up.weight
                weight.data = weight.data.clone()
            ids = torch.randint(0, cfg.vocab, (size, 1), generator=g).to(device)
            if size > 1:
                torch._dynamo.mark_dynamic(ids, 0)
            got, want = compiled(ids, pos), full(ids, pos)
            worst = max(worst, float((got - want).abs().max()))
            pos += 1
    graphs = [g for g in piecewise_backend.compiled_graphs() if g.pad_position is not None]
    main = max(graphs, key=lambda g: g.stats.calls)
    return {
        "rank": rank,
        "max_abs_diff": worst,
        "captured": sorted(main.captured),
        "misses": dict(main.stats.misses),
        "miss_details": dict(main.stats.miss_details),
        "replays": main.stats.replays,
        "captures": sum(p.captures for p in main.stats.pieces.values()),
        "weight_sets": main.stats.weight_sets,
        "agreement": main.policy.agreement is not None,
        "capture_events": [[list(e.key), e.call, e.pieces] for e in main.stats.events],
    }


# NVLink multicast stays off: on shared multi-GPU hosts a program using it can take the host's GPUs
# out of service (the lent H200 machines' rule). Set unless the caller chose otherwise.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def as_rank(work) -> None:
    """Under ``torchrun``: join the process group (NCCL on CUDA, gloo on CPU; multicast off), call
    ``work(rank, world, device)``, then release the graphs and leave the group (NCCL's destroy waits
    for every graph that captured its collectives to be destroyed)."""
    import torch.distributed as dist

    import piecewise_backend

    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    try:
        work(rank, world, device)
    finally:
        piecewise_backend.release_graphs()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """``torchrun --nproc-per-node N -m toys.parallel``: one JSON line per rank (the decode check;
    ``python -m benchmarks tensor-parallel`` times a Hugging Face model so)."""
    import argparse

    argparse.ArgumentParser(prog="python -m toys.parallel").parse_args(argv)
    as_rank(lambda rank, world, device: print(json.dumps(decode_check(rank, world, device)), flush=True))


if __name__ == "__main__":
    main()
