"""Differential runs: a random model compiled with the backend next to its eager twin, step by step.

Per step: a random batch size and KV position, a fresh input, sometimes new weights (parameters loaded
with ``assign=True`` into both, so the tensors the compiled model captured are replaced, not written).
Checked against eager: every output, whether an output that views the input still does, every
buffer (caches, running statistics, counters), that the parameters the user held before a swap
were not written, and, at the end, every earlier output kept from the start (a later replay must
not have overwritten it).
"""

from __future__ import annotations

import copy
import dataclasses
import random

import torch

from .grammar import T, T_MAX, WIDTH, FuzzModel, random_spec


@dataclasses.dataclass
class FuzzResult:
    steps: int = 0
    wrong: int = 0
    max_rel_err: float = 0.0
    models: int = 0
    failures: list = dataclasses.field(default_factory=list)  # one line per wrong step, with its spec
    padded_graphs: int = 0  # graphs the backend padded, and ones it refused to pad (coverage)
    unpadded_graphs: int = 0
    weight_swaps: int = 0

    def merge(self, other: "FuzzResult") -> None:
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            setattr(self, field.name, max(mine, theirs) if field.name == "max_rel_err" else mine + theirs)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference relative to the largest expected value (at least 0.01: a running mean
    of centred data is ~1e-8, where float rounding alone is a large relative error)."""
    if actual.shape != expected.shape:
        return float("inf")
    if not expected.numel():
        return 0.0
    scale = expected.abs().max().item()
    return (actual.double() - expected.double()).abs().max().item() / max(scale, 1e-2)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def run_model(seed: int, steps: int, max_batch: int, device: str = "cpu", options: dict | None = None,
              tolerance: float = 1e-3, swap_every: float = 0.1, keep_every: int = 3) -> FuzzResult:
    """Fuzz one random model for ``steps`` calls; batch sizes 1..min(max_batch, its cache rows)."""
    import piecewise_backend

    spec = random_spec(seed, max_batch)
    rng = random.Random(seed * 7919 + 1)
    torch._dynamo.reset()
    before = {g.serial for g in piecewise_backend.compiled_graphs()}
    model = FuzzModel(spec).to(device).eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="piecewise", options=options or {})
    result = FuzzResult(models=1)
    kept = []  # (compiled output, eager output) of some steps, re-checked at the end
    held: list = []  # (parameter the user held before a swap, its values then)
    largest = min(max_batch, spec.cache_rows)

    def wrong(step: int, what: str) -> None:
        result.wrong += 1
        result.failures.append(f"{spec} | step {step}: {what}")

    for step in range(steps):
        if step and rng.random() < swap_every:
            result.weight_swaps += 1
            held = [(p, p.detach().clone()) for p in model.parameters()]
            new = {k: torch.randn_like(v) * 0.3 for k, v in model.named_parameters()}
            model.load_state_dict(new, assign=True, strict=False)
            reference.load_state_dict({k: v.clone() for k, v in new.items()}, assign=True, strict=False)
        batch = rng.randint(1, largest)
        pos = rng.randint(0, T_MAX - 1)
        # a live allocation of random size first, so inputs land at fresh addresses
        spacer = torch.empty(rng.randint(1, 4096), device=device)
        x = torch.randn(batch, T, WIDTH, device=device)
        del spacer
        if batch > 1:
            torch._dynamo.mark_dynamic(x, 0)
        x_ref = x.clone()
        try:
            actual = compiled(x, pos)
        except Exception as exc:  # eager never raises on these inputs
            wrong(step, f"batch {batch}, pos {pos}: the compiled model raised {type(exc).__name__}: {exc}")
            result.steps += 1
            break
        expected = reference(x_ref, pos)
        result.steps += 1
        for i, (a, e) in enumerate(zip(actual, expected)):
            err = rel_err(a, e)
            if err != float("inf"):  # a shape mismatch is counted wrong below, not as an error size
                result.max_rel_err = max(result.max_rel_err, err)
            if not err <= tolerance:
                wrong(step, f"batch {batch}, pos {pos}: output {i} differs from eager (relative error {err:.3g})")
            if _shares_storage(e, x_ref) != _shares_storage(a, x):
                wrong(step, f"batch {batch}: output {i} views the input in eager but not here, or the reverse")
        for (name, mine), theirs in zip(model.named_buffers(), reference.buffers()):
            err = rel_err(mine.float(), theirs.float())
            if not err <= tolerance:
                wrong(step, f"batch {batch}, pos {pos}: buffer {name} differs from eager (relative error {err:.3g})")
        for p, saved in held:
            if not torch.equal(p, saved):
                wrong(step, "a parameter the user held before new weights were loaded was written")
        held = []
        if step % keep_every == 0:
            kept.append((step, actual[0], expected[0].clone()))
    for step, a, e in kept:
        if not rel_err(a, e) <= tolerance:
            wrong(step, "an output kept from this step was overwritten by a later call")
    for graph in piecewise_backend.compiled_graphs():
        if graph.serial not in before and graph.pad_position is not None:
            if "padded up to" in graph.stats.padding:
                result.padded_graphs += 1
            else:
                result.unpadded_graphs += 1
    return result


def fuzz(seeds, steps: int, max_batch: int, device: str = "cpu", options: dict | None = None,
         **kwargs) -> FuzzResult:
    total = FuzzResult()
    for seed in seeds:
        total.merge(run_model(seed, steps, max_batch, device, options, **kwargs))
    return total
