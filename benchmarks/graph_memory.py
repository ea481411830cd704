"""Graph memory: ``estimate_graph_memory`` against what capturing every default size really takes.

    python -m benchmarks.graph_memory --out graph_memory.json [--models engine hf] [--sweep [--order ascending]]
    python -m benchmarks.graph_memory --out /tmp/g.json --models hf --tiny --sizes 1,2,4,8   # smoke test (CUDA)

Models (one child process each, with its own timeout; CUDA only: graph memory is the allocator's count):

* ``engine``: ``toys/engine.py`` on Qwen2.5-1.5B's dimensions, bf16 (``serving.py``'s engine), warmed
  up as a server does (a step at the full token budget, then a one-token decode step);
* ``hf``: transformers' ``Qwen2ForCausalLM`` at the same dimensions, bf16, random weights, its
  ``forward`` compiled with the batch of a ``(batch, 1)`` input marked dynamic, first called at the
  largest size (at 2 with ``--order ascending``: Dynamo specialises a batch of 1).

Per model, ``estimate`` row: ``estimate_graph_memory("all")`` (it captures what it needs, at most
two sizes) against ``graph_memory_bytes()`` once every default size is captured:
``{predicted_bytes, measured_bytes, error, from_sizes, pool_bytes, input_buffer_bytes}``.
``--sweep``: instead, every default size captured one at a time (``--order descending``: the
largest, the smallest, then the rest from the largest down; ``ascending``: from the smallest up, as
lazily captured traffic that grows would), and after each: the pool's reserved and allocated bytes
and the input buffers' bytes (what the estimate's model rests on, ``runtime/memory_estimate.py``).
The engine's warm-up captures its largest size first, whatever the order.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

import torch


def engine_graph(tiny: bool):
    import types

    from benchmarks import serving

    config = "tiny" if tiny else "qwen2.5-1.5b"
    args = types.SimpleNamespace(config=config, max_num_tokens=512, max_num_seqs=64)
    model = serving.build(config, "piecewise", "cuda", torch.bfloat16)
    engine = serving.engine_for(model, serving.compiled(model, "piecewise"), "cuda", torch.bfloat16, args)
    engine.warm_up()
    return engine, model


def hf_graph(tiny: bool, first: int):
    import transformers

    dims = (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        )
        if tiny
        else dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
        )
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**dims)).to("cuda", torch.bfloat16).eval()
    forward = torch.compile(model.forward, backend="piecewise")
    ids = torch.zeros(first, 1, dtype=torch.long, device="cuda")
    torch._dynamo.mark_dynamic(ids, 0)
    with torch.no_grad():
        forward(input_ids=ids, use_cache=False)
    return forward, model


def the_graph():
    import piecewise_backend

    able = [g for g in piecewise_backend.compiled_graphs() if g.can_capture_up_front]
    if not able:
        raise RuntimeError(
            "no compiled graph can capture up front: "
            + "; ".join(g.up_front.refusal() for g in piecewise_backend.compiled_graphs())
        )
    return max(able, key=lambda g: g.stats.calls)


def pool_allocated_bytes() -> int:
    """Bytes allocated (live blocks) in the segments of this package's graph pools."""
    from piecewise_backend.runtime import devices

    graphs = devices._DEVICES.get(torch.cuda.current_device())
    if graphs is None:
        return 0
    handles = {tuple(h) for h, _ in graphs._retired} | ({tuple(graphs._pool[0])} if graphs._pool else set())
    return sum(
        b["size"]
        for seg in torch.cuda.memory_snapshot()
        if tuple(seg.get("segment_pool_id", ())) in handles
        for b in seg["blocks"]
        if b["state"] == "active_allocated"
    )


def sweep(graph, sizes: list, order_name: str) -> list:
    import piecewise_backend

    ordered = sorted(sizes, reverse=True)
    order = [ordered[0], ordered[-1], *ordered[1:-1]] if order_name == "descending" else sorted(sizes)
    rows = [
        {
            "size": None,
            "pool": piecewise_backend.pool_bytes(),
            "pool_allocated": pool_allocated_bytes(),
            "inputs": graph.input_buffer_bytes(),
            "already": sorted(k[graph.pad_position] for k in graph.captured),
        }
    ]
    for size in order:
        graph.capture([size])
        torch.cuda.synchronize()
        rows.append(
            {
                "size": size,
                "pool": piecewise_backend.pool_bytes(),
                "pool_allocated": pool_allocated_bytes(),
                "inputs": graph.input_buffer_bytes(),
                "failed_captures": graph.stats.failed_captures,
            }
        )
    return rows


def estimate_row(graph) -> dict:
    import piecewise_backend

    sizes = graph.policy.sizes
    start = time.perf_counter()
    guess = piecewise_backend.estimate_graph_memory("all", graph)
    seconds = time.perf_counter() - start
    predicted = guess.for_sizes(sizes)
    graph.capture("all")
    torch.cuda.synchronize()
    measured = piecewise_backend.graph_memory_bytes()
    pool = piecewise_backend.pool_bytes()
    return {
        "predicted_bytes": predicted,
        "measured_bytes": measured,
        "error": round(predicted / measured - 1, 4),
        "sizes": f"{len(sizes)} sizes up to {max(sizes)}",
        "from_sizes": [s for s, _ in guess.measured],
        "pool_bytes": pool,
        "input_buffer_bytes": measured - pool,
        "estimate": str(guess),
        "estimate_s": round(seconds, 2),
        "failed_captures": graph.stats.failed_captures,  # a failed capture retires its pool: not an estimate
    }


def child(args) -> None:
    import warnings

    warnings.simplefilter("ignore")
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [1, 512]
    if args.model == "engine":
        engine_graph(args.tiny)
    else:
        hf_graph(args.tiny, 2 if args.order == "ascending" else max(sizes))  # Dynamo specialises a batch of 1
    graph = the_graph()
    if args.sizes:
        graph.policy.sizes = tuple(int(s) for s in args.sizes.split(","))
    row = {"model": args.model, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.sweep:
        row["sweep"] = sweep(graph, list(graph.policy.sizes), args.order)
        row["order"] = args.order
    else:
        row.update(estimate_row(graph))
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="+", default=["engine", "hf"], choices=["engine", "hf"])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--order", default="descending", choices=["descending", "ascending"])
    parser.add_argument("--tiny", action="store_true", help="tiny dimensions (a smoke test)")
    parser.add_argument("--sizes", help="capture sizes instead of the default ones, e.g. 1,2,4,8")
    parser.add_argument("--child-timeout", type=int, default=240)
    parser.add_argument("--model", help=argparse.SUPPRESS)  # set in the child processes
    args = parser.parse_args()
    if args.model:
        child(args)
        return
    from benchmarks.record import code_hash

    rows = []
    for model in args.models:
        cmd = [
            sys.executable,
            "-m",
            __spec__.name,
            "--out",
            "-",
            "--model",
            model,
            *(["--sweep"] if args.sweep else []),
            "--order",
            args.order,
            *(["--tiny"] if args.tiny else []),
            *(["--sizes", args.sizes] if args.sizes else []),
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if lines else {"model": model, "error": done.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            row = {"model": model, "error": f"timed out after {args.child_timeout} s"}
        rows.append({**row, "code_hash": code_hash()})
        print(json.dumps(rows[-1]), flush=True)
    key = "graph_memory_sweep" if args.sweep else "graph_memory_estimate"
    out = pathlib.Path(args.out)
    previous = json.loads(out.read_text()).get(key, []) if out.exists() else []  # two orders: one file
    out.write_text(json.dumps({key: previous + rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
