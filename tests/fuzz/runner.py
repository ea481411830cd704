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

from .grammar import ACROSS, T_MAX, WIDTH, FuzzModel, T, random_spec

BREAKS = frozenset(b for b in ACROSS if b.startswith("break_"))


def compiles_dynamic(seed: int) -> bool:
    """A third of the models are compiled with ``dynamic=True``."""
    return seed % 3 == 2


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
    dynamic_models: int = 0  # models compiled with dynamic=True (the others: the batch marked dynamic)
    breaking_models: int = 0  # models with a graph break (.item(), a branch on the data, print)
    crossing_models: int = 0  # models with a value other than one tensor crossing a piece (ACROSS)

    def merge(self, other: FuzzResult) -> None:
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


def run_model(
    seed: int,
    steps: int,
    max_batch: int,
    device: str = "cpu",
    options: dict | None = None,
    tolerance: float = 1e-3,
    swap_every: float = 0.1,
    keep_every: int = 3,
) -> FuzzResult:
    """Fuzz one random model for ``steps`` calls; batch sizes 1..min(max_batch, its cache rows)."""
    import piecewise_backend

    spec = random_spec(seed, max_batch)
    rng = random.Random(seed * 7919 + 1)
    torch._dynamo.reset()
    before = {g.serial for g in piecewise_backend.compiled_graphs()}
    model = FuzzModel(spec).to(device).eval()
    reference = copy.deepcopy(model)
    dynamic = compiles_dynamic(seed)
    compiled = torch.compile(model, backend="piecewise", options=options or {}, dynamic=True if dynamic else None)
    result = FuzzResult(
        models=1,
        dynamic_models=int(dynamic),
        breaking_models=int(bool(BREAKS & set(spec.blocks))),
        crossing_models=int(bool(set(ACROSS) & set(spec.blocks))),
    )
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


def concurrent(seeds, calls: int, max_batch: int, device: str = "cpu", threads: int = 2) -> dict:
    """Several threads calling one compiled model at once (each on a CUDA stream of its own), each
    output checked against eager in the calling thread; models that write no buffer (``STATELESS``:
    eager itself is only thread-safe on those). Returns the calls made, wrong and raised."""
    import threading

    from .grammar import stateless_spec

    counts = {"concurrent_calls": 0, "concurrent_wrong": 0, "concurrent_errors": 0, "concurrent_models": 0}
    failures: list = []
    lock = threading.Lock()
    for seed in seeds:
        spec = stateless_spec(seed, max_batch)
        torch._dynamo.reset()
        model = FuzzModel(spec).to(device).eval()
        compiled = torch.compile(model, backend="piecewise", dynamic=True if compiles_dynamic(seed) else None)
        largest = min(max_batch, spec.cache_rows)
        with torch.no_grad():  # compiled before the threads start, as the README says: torch's FX
            for n in (1, 2):  # tracing flag is process-wide, so a call made while another thread
                x = torch.randn(n, T, WIDTH, device=device)  # compiles may raise (any backend)
                if n > 1:
                    torch._dynamo.mark_dynamic(x, 0)
                compiled(x, 0)

        def caller(worker: int) -> None:
            rng = random.Random(seed * 31 + worker)
            stream = torch.cuda.Stream() if device == "cuda" else None
            # a generator of its own: on torch 2.11 the default one raises in a thread drawing from
            # it while another thread begins a capture (README, Troubleshooting: threads)
            inputs = torch.Generator(device=device).manual_seed(seed * 31 + worker)
            with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else _Nothing():
                for _ in range(calls // threads):
                    x = torch.randn(rng.randint(1, largest), T, WIDTH, device=device, generator=inputs)
                    if x.shape[0] > 1:
                        torch._dynamo.mark_dynamic(x, 0)
                    try:
                        same = all(rel_err(a, e) <= 1e-3 for a, e in zip(compiled(x, 0), model(x, 0)))
                    except Exception as exc:  # noqa: BLE001 - eager never raises here
                        with lock:
                            counts["concurrent_errors"] += 1
                            failures.append(f"{spec}: {type(exc).__name__}: {exc}")
                        continue
                    with lock:
                        counts["concurrent_calls"] += 1
                        counts["concurrent_wrong"] += not same
                        if not same:
                            failures.append(f"{spec}: batch {x.shape[0]} differs from eager")

        workers = [threading.Thread(target=caller, args=(w,)) for w in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        counts["concurrent_models"] += 1
    return {**counts, "concurrent_threads": threads, "concurrent_failures": failures[:20]}


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def fuzz(seeds, steps: int, max_batch: int, device: str = "cpu", options: dict | None = None, **kwargs) -> FuzzResult:
    total = FuzzResult()
    for seed in seeds:
        total.merge(run_model(seed, steps, max_batch, device, options, **kwargs))
    return total
