"""Suite ``decode``: decode step time of toy Llamas under every backend a user would pick, against
the step captured whole in one CUDA graph (``limit``: the one-graph limit).

    python -m benchmarks decode [--variants 16L,28L] [--batches 1,8,32] [--backends piecewise,limit] [--rounds 3]
    python -m benchmarks decode --smoke        # CPU: the tiny model, three backends

The suite's variants are the models, one child process each; the backends of a model are timed in
turns in its process (the machines are noisy: read ratios, each row's ``vs_limit`` is its step over
the limit's of the same process and batch). This module runs them and assembles the rows; the models
and how each backend is compiled and timed are in ``decode_variants.py``, the timing loops and the
host's speed in ``timing.py``.

Backends (``--backends``), side by side in one process:

* ``eager``: the model as written.
* ``inductor``: ``torch.compile`` default.
* ``reduce-overhead``: Inductor + cudagraph trees, ``graph_partition`` off.
* ``reduce-overhead+partition``: the same with Inductor's ``graph_partition`` on.
* ``piecewise``: this backend, default options: since the switch that followed code hash
  ``3c7e8e89…``'s run, with ``graph_attention`` (decode attention read from the cache by a
  graph-safe kernel, the whole step one graph); results measured before the switch name this
  ``piecewise-graph-attention``.
* ``piecewise-eager-attention``: ``piecewise`` with ``graph_attention=False``: decode attention runs
  eagerly (SDPA) between the captured pieces; the default before, named ``piecewise`` in results
  measured before the switch.
* ``piecewise-kv-eager``: ``piecewise-eager-attention`` with ``capture_kv_writes=False`` too (the
  KV-cache writes run eagerly between replays, as before ``rewrite/kv_writes.py``): what moving them
  into the graphs gives.
* ``piecewise-skip-guards``: ``piecewise`` decoding under
  ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: Dynamo checks only the guards that
  tell its cached graphs apart (a server's choice once warmed up; the backend cannot make it).
* ``piecewise-no-clone``: ``piecewise`` with ``clone_outputs=False``: the logits stay in the graph
  pool until the next call (the step reads them first), no copy per step.
* ``piecewise-fast-call``: ``piecewise-no-clone`` decoding under ``skip_guard_eval_unsafe``: every
  per-call saving a user can choose at once.
* ``piecewise-full-skip-guards``: ``piecewise-full`` decoding the same way: how much of full mode's
  excess over ``limit`` is Dynamo's guard evaluation.
* ``piecewise-full``: this backend, ``mode="full"`` (with ``graph_attention``), on the model
  itself: the decode step is one graph, so this is the same model and work as ``limit``.
* ``piecewise-full-static``: ``mode="full"`` on the graph-safe twin of the model
  (:class:`ToyStaticCacheLlama`, same weights: tensor positions, masked attention over the cache);
  named ``piecewise-full`` in results measured before the rename.
* ``limit``: the Inductor-compiled step at one fixed shape (batch, position) captured whole in one
  ``torch.cuda.graph`` and replayed: no host work at all; the floor for any backend.
* ``dynamo-floor``: ``torch.compile(model)`` with a backend that does nothing but replay ``limit``'s
  graph: Dynamo's entry (guards, gathering the ~150 parameters it passes as inputs) plus one replay,
  the floor for *any* ``torch.compile`` backend. Timing only: its outputs are the limit's, whatever
  the inputs. ``piecewise`` minus this is what the backend itself adds.
* ``limit-full``: the same for the graph-safe twin, the floor for ``piecewise-full-static`` (its
  masked attention over the whole static cache is a different, slower kernel than ``limit``'s).

Decode: after a warm-up (compile, a prefill and 4 steps), prefill ``--prompt`` tokens, then
``--steps`` steps with the KV length growing each step; CUDA events; median over the second half
(``first_call_s``: the warm-up's first call, compile included; ``host_ms``: the same median of the
time each step took to *enqueue*, without waiting for the GPU; ``sm_clock_mhz``: the GPU's clock
read right after). ``--rounds N`` (N > 1): per batch, every variant is
compiled and warmed up first, then timed in turn N times (``step_ms``: the median of the rounds),
so a slow spell of the machine hits all variants alike.

The host's speed. The H200 machine's CPU runs at two speeds ~3× apart, switching every few seconds
(``timing.host_probe_us``). Each timed run has a host probe just before and after it
(``host_probe_us_rounds``: the slower of the two); ``step_ms_fast_host`` is the median of the rounds
whose probe was within ``FAST_HOST`` of the fastest, and ``vs_limit_fast_host`` its ratio. ``--pause S``
puts S seconds between rounds; ``--settle S`` lets a timed run wait up to S seconds for the host
to be at full speed (after S seconds of probing first, to learn that speed).

Two views of a step. ``step_ms`` waits for each step before starting the next (a server that reads
every token on the host before the next step), so host work before a replay adds to the step.
``pipelined_ms`` lets the host run ahead (a server that samples on the GPU and reads tokens later):
CUDA events around each step and one wait at the end, so a step costs what the GPU spends on it,
host time counting only where it leaves the GPU waiting. Every variant is timed both ways in the
same process; the pipelined runs come after all the waiting ones (per batch, after the last round),
so they do not change what the waiting runs meet. Reduce-overhead's pipelined runs therefore
replay KV lengths it has already recorded; its waiting runs meet new ones in round 1. A variant that fails is a row with its
error, never a skip.

SDPA runs with torch's defaults, as a user's does (rows say ``"sdpa": "torch default"``). A variant
named with the suffix ``+pinned-sdpa`` (``piecewise+pinned-sdpa``, ``limit+pinned-sdpa``, ...) is the
same variant compiled and timed under ``sdpa_kernel([FLASH, EFFICIENT])``, as every row was before
the backend chose the eager attention's kernels itself (``eager_sdpa_backends``): the two side by side
show what a user's defaults cost.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Iterator

import torch

from benchmarks import timing
from benchmarks.decode_variants import (
    IDIOMS,
    MODELS,
    VARIANTS,
    model_name,
    models_for,
    prepared_variant,
    sdpa_label,
    size_caches,
)
from benchmarks.harness import Suite
from benchmarks.timing import fast_host_times, settled_probe, sm_clock_mhz

# a row's time field -> its ratio to the limit's (same process, same batch)
RATIOS = {"step_ms": "vs_limit", "pipelined_ms": "pipelined_vs_limit", "step_ms_fast_host": "vs_limit_fast_host"}


def _error(exc: Exception) -> str:
    traceback.print_exc()
    return f"{type(exc).__name__}: {exc}"[:500]


def _mark_process(batch_rows: list[dict], args) -> None:
    """Say on each row what shared its process, and its times over the limit's of that process.

    Why: the same variant measures differently with what else the process holds (the limit
    itself, one graph and no host work, took 0.98 and 1.08 ms in two processes of one lease): a
    ratio is only as good as the knowledge of which rows shared one.
    """
    how = "interleaved" if getattr(args, "rounds", 1) > 1 else "one at a time"
    label = f"{args.child} b{args.batches}, {how}: {args.backends}"
    limit = next((r for r in batch_rows if r["variant"] == "limit"), {})
    for row in batch_rows:
        row["process"] = label
        for field, ratio in RATIOS.items():
            if row.get(field) and limit.get(field):
                row[ratio] = round(row[field] / limit[field], 3)


def _pipelined_ms(row: dict, measure) -> float | None:
    """One pipelined run's median step ms, or None with the failure in ``row["pipelined_error"]``:
    kept apart, so that it does not take the row's waiting times with it."""
    try:
        return round(measure(pipelined=True)[0], 4)
    except Exception as exc:
        row["pipelined_error"] = _error(exc)
        return None


def decode_rows(args, device: str) -> Iterator[dict]:
    """The model's rows, a batch's as soon as its backends are timed. With ``args.rounds`` > 1,
    :func:`interleaved_rows` instead."""
    if getattr(args, "rounds", 1) > 1:
        yield from interleaved_rows(args, device)
        return
    model, twin = models_for(args.child, args, device)
    for batch in args.batches:
        size_caches(model, batch)
        batch_rows = []
        for variant in args.backends:
            row = {"model": model_name(model), "variant": variant, "batch": batch}
            batch_rows.append(row)
            try:
                torch._dynamo.reset()
                with torch.inference_mode():
                    first_s, measure, facts = prepared_variant(variant, model, twin, batch, args, device)
                    step_ms, host_ms = measure()
                    clock = sm_clock_mhz(device)
                    row.update(
                        step_ms=round(step_ms, 4),
                        host_ms=round(host_ms, 4),
                        sm_clock_mhz=clock,
                        first_call_s=round(first_s, 3),
                        sdpa=sdpa_label(variant),
                        **facts(),
                    )
                    row["pipelined_ms"] = _pipelined_ms(row, measure)
            except Exception as exc:  # a failure is a result, not a skip
                row.update(step_ms=None, first_call_s=None, error=_error(exc))
        _mark_process(batch_rows, args)
        yield from batch_rows


def interleaved_rows(args, device: str) -> Iterator[dict]:
    """Per model and batch: every variant compiled and warmed up first, then ``args.rounds`` rounds
    that time each variant in turn; a row's ``step_ms`` is the median of its rounds
    (``step_ms_rounds``).

    Why: a lent machine's host speed drifts over seconds (two variants doing the same work, one
    graph per step each, came out 1.05 and 1.25 ms when timed 30 s apart), so variants timed one
    after the other can differ by more than what separates them. Interleaved, a slow spell hits
    every variant. Dynamo is reset once per batch, not per variant, so its cache holds every
    variant's graphs at once (told apart by its backend check; the recompile limit is raised).
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    settle = getattr(args, "settle", 0)
    deadline = time.perf_counter() + settle
    while time.perf_counter() < deadline:  # learn the host's full speed before the first round waits for it
        timing.probe()
        time.sleep(0.05)
    model, twin = models_for(args.child, args, device)
    for batch in args.batches:
        size_caches(model, batch)
        torch._dynamo.reset()
        batch_rows, measures, facts = {}, {}, {}
        with torch.inference_mode():
            for variant in args.backends:
                row = batch_rows[variant] = {
                    "model": model_name(model),
                    "variant": variant,
                    "batch": batch,
                    "sdpa": sdpa_label(variant),
                }
                try:
                    first_s, measures[variant], facts[variant] = prepared_variant(
                        variant, model, twin, batch, args, device
                    )
                    row.update(
                        first_call_s=round(first_s, 3),
                        step_ms_rounds=[],
                        host_ms_rounds=[],
                        host_probe_us_rounds=[],
                        sm_clock_mhz_rounds=[],
                        pipelined_ms_rounds=[],
                    )
                except Exception as exc:  # a failure is a result, not a skip
                    row.update(step_ms=None, first_call_s=None, error=_error(exc))
            for round_ in range(args.rounds):
                if round_ and getattr(args, "pause", 0):
                    time.sleep(args.pause)  # rounds seconds apart meet the host's spells apart
                for variant, measure in list(measures.items()):
                    row = batch_rows[variant]
                    try:
                        probe = settled_probe(settle)
                        step_ms, host_ms = measure()
                        row["host_probe_us_rounds"].append(round(max(probe, timing.probe()), 2))
                        row["step_ms_rounds"].append(round(step_ms, 4))
                        row["host_ms_rounds"].append(round(host_ms, 4))
                        row["sm_clock_mhz_rounds"].append(sm_clock_mhz(device))
                    except Exception as exc:
                        row.update(error=_error(exc))
                        del measures[variant]
            for _ in range(args.rounds):  # after every waiting round: see the module's docstring
                for variant, measure in list(measures.items()):
                    row = batch_rows[variant]
                    if "pipelined_error" not in row and (ms := _pipelined_ms(row, measure)) is not None:
                        row["pipelined_ms_rounds"].append(ms)
        for variant, row in batch_rows.items():
            if variant in facts:
                row.update(facts[variant]())
            times, host = row.get("step_ms_rounds"), row.get("host_ms_rounds")
            ok = bool(times) and "error" not in row
            row["step_ms"] = round(statistics.median(times), 4) if ok else None
            row["host_ms"] = round(statistics.median(host), 4) if ok else None
            pipelined = row.get("pipelined_ms_rounds")
            row["pipelined_ms"] = (
                round(statistics.median(pipelined), 4) if ok and pipelined and "pipelined_error" not in row else None
            )
        fast_host_times(list(batch_rows.values()), timing.FASTEST_PROBE[0])
        _mark_process(list(batch_rows.values()), args)
        yield from batch_rows.values()


def rows(variant: str, args) -> Iterator[dict]:
    """In the child: the model ``variant``'s rows, every backend at every batch."""
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.backends = args.backends.split(",")
    unknown = sorted(set(args.backends) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"decode: no backend {', '.join(unknown)}; there are {', '.join(VARIANTS)}")
    yield from decode_rows(args, args.device)


def options(parser) -> None:
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--backends", default=",".join(v for v in VARIANTS if "+" not in v), help="comma-separated")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=1, help="> 1: compile every backend, then time them in turns")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between interleaved rounds")
    parser.add_argument("--settle", type=float, default=0.0, help="seconds a run may wait for the host's full speed")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


# fmt: off
SUITE = Suite("decode", "decode step time of toy Llamas per backend, against the step as one CUDA graph (the limit)",
              (*MODELS, *IDIOMS), rows, options, default=("16L", "28L"),
              smoke="--variants tiny --batches 1,3 --backends eager,piecewise --steps 6 --prompt 8 --device cpu".split())
# fmt: on
