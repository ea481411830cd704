"""Where the *host* time of one piecewise decode step goes, and what single host operations cost.

    python -m benchmarks.host_breakdown [--model 16L --batch 8 --steps 50] [--eager-attention] [--json out.json]

``--model`` takes the suite's idiom models too (``16L-whole-cache``).

A CUDA-graph backend wins only while the host launches a step faster than the GPU runs it. This
times, per decode step and without synchronising inside the step: the whole call as the user sees
it; the part inside the backend's compiled graph (so Dynamo's entry, guards and argument gathering
are the difference); the compute pieces' runners and, inside them, ``graph.replay()``; the eager
(attention) pieces; the stitching glue (the rest). Then the same for the single operations a step
is made of (one graph replay, a KV-cache slice write, SDPA, ``data_ptr``), each alone in a loop.

On a CPU the graphs are emulated and their replays stubbed out, so the numbers there are the
backend's pure Python cost (useful to compare code changes on one machine, not to compare with a
GPU host).
"""

from __future__ import annotations

import argparse
import json
import operator
import statistics
import time

import torch

import piecewise_backend
from benchmarks.suite_models import IDIOMS, MODELS, next_ids, toy_model
from benchmarks.timing import timed
from piecewise_backend import emulated_graphs
from piecewise_backend.runtime.devices import synchronize
from piecewise_backend.runtime.piece_runner import PieceRunner
from piecewise_backend.split.splitting import COMPUTE
from toys.models import ToyConfig, reset_caches, sdpa_backends


class _Clock:
    """Accumulates host seconds per label while installed around callables."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, label: str, fn):
        seconds = self.seconds
        seconds.setdefault(label, 0.0)

        def timed(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                seconds[label] += time.perf_counter() - start

        return timed


def _instrument(graph, clock: _Clock) -> None:
    graphed = graph.device.type == "cuda"  # emulated graphs (CPU): replays stubbed out
    gm = graph.split_module  # the copy whose pieces the compiled graph calls
    for spec in graph.pieces:
        if spec.kind != COMPUTE:
            gm.__dict__[spec.name] = clock.wrap("eager pieces", gm.__dict__[spec.name])
    cls = type(graph)  # Python looks __call__ up on the type
    cls.__call__ = clock.wrap("inside the compiled graph", cls.__call__)
    runner_call = PieceRunner.__call__
    PieceRunner.__call__ = clock.wrap("runners (incl. replay)", runner_call)
    for runner in graph.runners.values():
        for captured in runner.captures.values():
            replay = captured.graph.replay
            captured.graph.replay = clock.wrap("graph.replay()", replay) if graphed else (lambda: None)


def _timed_steps(step, logits, pos: int, steps: int, device: str) -> tuple[list, list]:
    """Host seconds per step to enqueue it, and to finish it (synchronised)."""
    enqueue, synced = [], []
    for _ in range(steps):
        ids = next_ids(logits)
        synchronize(device)
        start = time.perf_counter()
        logits = step(ids, pos)
        enqueue.append(time.perf_counter() - start)
        synchronize(device)
        synced.append(time.perf_counter() - start)
        pos += 1
    return enqueue, synced


def step_breakdown(args, device: str) -> dict:
    size, cls = IDIOMS.get(args.model, (args.model, None))  # a model in another idiom: its size's config
    sizes = dict(max_batch=args.batch, max_seq=args.prompt + 2 * args.steps + 16)
    model = toy_model(size, device, cls, **sizes) if cls is not None else toy_model(size, device, **sizes)
    if hasattr(model, "set_batch"):
        model.set_batch(args.batch)  # its caches hold exactly the batch
    cfg = model.cfg
    options = {"graph_attention": False} if args.eager_attention else {}
    step = torch.compile(model, backend="piecewise", options=options)
    with torch.inference_mode():  # torch's SDPA defaults, as a user's
        reset_caches(model)
        logits = step(torch.randint(0, cfg.vocab, (args.batch, args.prompt), device=device), 0)
        pos = args.prompt
        for _ in range(args.steps):  # compile the decode graph, capture
            logits = step(next_ids(logits), pos)
            pos += 1
        graph = max(piecewise_backend.compiled_graphs(), key=lambda g: g.stats.calls)
        replays_gpu_ms = _replays_gpu_ms(graph) if device == "cuda" else None
        clock = _Clock()
        _instrument(graph, clock)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=args.skip_guards):
            enqueue, synced = _timed_steps(step, logits, pos, args.steps, device)
    n = args.steps
    per_step = {"eager pieces": 0.0, **{label: round(s / n * 1e6, 1) for label, s in clock.seconds.items()}}
    per_step["whole call (enqueue, no sync)"] = round(sum(enqueue) / n * 1e6, 1)
    per_step["whole call + sync (median)"] = round(statistics.median(synced) * 1e6, 1)
    per_step["Dynamo entry (whole call - inside graph)"] = round(
        per_step["whole call (enqueue, no sync)"] - per_step["inside the compiled graph"], 1
    )
    per_step["glue (inside graph - runners - eager)"] = round(
        per_step["inside the compiled graph"] - per_step["runners (incl. replay)"] - per_step["eager pieces"], 1
    )
    return {
        "model": args.model,
        "batch": args.batch,
        "device": device,
        "skip_guards": args.skip_guards,
        "graph_attention": not args.eager_attention,
        "pieces": graph.stats.num_pieces,
        "replays_gpu_ms": replays_gpu_ms,
        "graph_inputs": len(graph.plan.inputs.specs),
        "us_per_step": per_step,
    }


def _replays_gpu_ms(graph, repeats: int = 20) -> float:
    """GPU milliseconds of one step's captured graphs replayed back to back, nothing else in between:
    with the suite's ``limit`` (the whole step as one graph, replayed alone) this splits a step's
    excess over the limit into GPU work (this) and host work (the rest)."""
    key = max((key for runner in graph.runners.values() for key in runner.captures), default=None)
    graphs = [runner.captures[key].graph for runner in graph.runners.values() if key in runner.captures]

    def replay_all() -> None:
        for cuda_graph in graphs:
            cuda_graph.replay()

    return round(statistics.median(timed(replay_all, "cuda")[1] for _ in range(repeats)), 4)


def _per_call_us(fn, repeats: int = 2000) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return round((time.perf_counter() - start) / repeats * 1e6, 2)


def op_costs(args, device: str) -> dict:
    """Host microseconds per call of the operations a step is made of (launch-rate bound loops)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = ToyConfig(**MODELS[IDIOMS.get(args.model, (args.model,))[0]], max_batch=args.batch, max_seq=args.prompt + 8)
    nh, hd, b = cfg.heads, cfg.head_dim, args.batch
    cache = torch.zeros(b, nh, cfg.max_seq, hd, device=device, dtype=dtype)
    k = torch.randn(b, nh, 1, hd, device=device, dtype=dtype)
    q = torch.randn(b, nh, 1, hd, device=device, dtype=dtype)
    pos = args.prompt
    costs = {}

    def write():
        cache[:b, :, pos : pos + 1] = k

    costs["kv slice write (setitem)"] = _per_call_us(write)
    costs["kv prefix view (getitem)"] = _per_call_us(lambda: cache[:b, :, : pos + 1])
    keys = cache[:b, :, : pos + 1]
    with sdpa_backends(device):  # pinned, as the row's name says
        costs["sdpa (flash/efficient)"] = _per_call_us(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, keys, keys)
        )
    costs["sdpa (torch default)"] = _per_call_us(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, keys, keys)
    )
    costs["data_ptr()"] = _per_call_us(lambda: k.data_ptr(), 20000)
    costs.update(weights_check_costs(device, dtype))
    costs["copy_ (small)"] = _per_call_us(lambda: q.copy_(k))
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        x = torch.zeros(8, device=device)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            x.add_(1)
        costs["graph.replay() (one kernel)"] = _per_call_us(graph.replay)
    synchronize(device)
    return costs


def weights_check_costs(device: str, dtype: torch.dtype, count: int = 151) -> dict:
    """Host µs of the per-call check that ``count`` parameters are where the graphs captured them
    (``runtime/weight_sets.py``), both ways it can be done: torch's C++ loop (CUDA builds) and a
    tuple of ``data_ptr()`` built in Python. Why: the C++ loop converts every list item to a C++
    tensor first; on a slow host that may cost as much as the Python loop it replaced."""
    from piecewise_backend._torch_internals import data_ptrs_check

    weights = [torch.zeros(4, device=device, dtype=dtype) for _ in range(count)]
    args = (torch.zeros(1, device=device), *weights)  # the weights behind a non-weight input, as in a call
    indices = list(range(1, count + 1))
    getter, data_ptr = operator.itemgetter(*indices), torch.Tensor.data_ptr
    active = tuple(map(data_ptr, getter(args)))
    costs = {
        f"weights check, Python tuple ({count})": _per_call_us(lambda: tuple(map(data_ptr, getter(args))) == active)
    }
    check = data_ptrs_check()
    if check is not None:
        ptrs = [None, *active]
        costs[f"weights check, torch C++ ({count})"] = _per_call_us(lambda: check(list(args), ptrs, indices))
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="16L", choices=sorted(MODELS) + sorted(IDIOMS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument(
        "--skip-guards",
        action="store_true",
        help="measure under torch.compiler.set_stance(skip_guard_eval_unsafe=True)",
    )
    parser.add_argument(
        "--eager-attention",
        action="store_true",
        help="compile with graph_attention=False (decode attention eager between the pieces)",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with emulated_graphs(device == "cpu"):
        result = {"step": step_breakdown(args, device), "op_costs_us": op_costs(args, device)}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
