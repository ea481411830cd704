"""``python -m piecewise_backend``: compile a small decoder, show its pieces, captures and step times.

The model is the demo's own (a Llama-style decoder with a KV cache, written the common way); it is
not part of the API. On a machine without CUDA the same pieces run compiled but un-graphed, and the
demo says so.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from . import compiled_graphs
from ._torch_internals import mark_dynamic
from .kinds import PieceKind


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, max_batch: int, max_seq: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.up, self.down = nn.Linear(hidden, 4 * hidden, bias=False), nn.Linear(2 * hidden, hidden, bias=False)
        shape = (max_batch, heads, max_seq, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        B, S, H = x.shape
        q, k, v = (
            t.view(B, S, self.heads, self.head_dim).transpose(1, 2)
            for t in self.qkv(self.attn_norm(x)).chunk(3, dim=-1)
        )
        self.k_cache[:B, :, pos : pos + S] = k  # the KV cache write at this step's position
        self.v_cache[:B, :, pos : pos + S] = v
        if S > 1:  # the prompt, from position 0: causal within it
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # a decode step: the new token attends to everything cached so far
            o = F.scaled_dot_product_attention(q, self.k_cache[:B, :, : pos + 1], self.v_cache[:B, :, : pos + 1])
        x = x + self.out(o.transpose(1, 2).reshape(B, S, H))
        gate, up = self.up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class DemoDecoder(nn.Module):
    """Embedding, ``layers`` attention + MLP blocks, a head; ``forward(ids, pos)`` -> logits."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, max_batch: int, max_seq: int):
        super().__init__()
        self.vocab = vocab
        self.embed, self.norm = nn.Embedding(vocab, hidden), nn.RMSNorm(hidden)
        self.layers = nn.ModuleList(_Layer(hidden, heads, max_batch, max_seq) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, pos)
        return self.head(self.norm(x))


def _newest() -> int:
    return max((g.serial for g in compiled_graphs()), default=0)


def _label_new(labels: dict | None, since: int, label: str) -> int:
    """Label the graphs compiled after serial ``since``; returns the newest serial now."""
    if labels is not None:
        labels.update({g.serial: label for g in compiled_graphs() if g.serial > since})
    return _newest()


def _decode_ms(step, vocab: int, batch: int, prompt: int, steps: int, device: str, labels: dict | None = None):
    """Wall times (ms) of greedy decode steps (the second half of ``steps``), the batch marked dynamic.
    ``labels``: serial -> what it serves, for each graph this call compiled (prefill or decode, batch)."""
    ids = torch.randint(0, vocab, (batch, prompt), device=device)
    before = _newest()
    logits, times = step(ids, 0), []
    before = _label_new(labels, before, f"prefill, first at batch {batch}")
    for pos in range(prompt, prompt + steps):
        ids = logits[:, -1:].argmax(-1)
        if batch > 1:
            mark_dynamic(ids, 0)  # one graph for every batch size
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        logits = step(ids, pos)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        before = _label_new(labels, before, f"decode, first at batch {batch}")
    return [t * 1e3 for t in times[steps // 2 :]]


def _spread(times: list[float]) -> str:
    """Median and the 10th-90th percentile range: one number would hide a noisy machine."""
    deciles = statistics.quantiles(times, n=10)
    return f"{statistics.median(times):6.2f} ({deciles[0]:.2f}-{deciles[-1]:.2f})"


def _show_pieces(graph) -> None:
    print("\npieces of the decode graph, in order:")
    for p in graph.pieces:
        if p.kind == PieceKind.COMPUTE:
            first = graph.plan.report.compiled_as[p.name]
            what = "compiled" if first == p.name else f"reuses {first}'s code"
        else:
            what = ", ".join(p.split_ops) or "eager: " + "; ".join(p.eager_reasons[:2])
        print(f"  {p.name:>10}  {p.kind:8} {p.num_ops:4} ops  {what}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=40, help="decode steps per batch (the second half is timed)")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    hidden, layers, prompt = (1024, args.layers or 16, 128) if cuda else (64, args.layers or 2, 8)
    model = (
        DemoDecoder(
            vocab=512,
            hidden=hidden,
            layers=layers,
            heads=8 if cuda else 4,
            max_batch=max(args.batches),
            max_seq=prompt + args.steps + 1,
        )
        .to(device, dtype)
        .eval()
    )
    print(f"demo decoder: {layers} layers, hidden {hidden}, {dtype}, on {device}")
    if not cuda:
        print("No CUDA here: pieces run compiled with Inductor but un-graphed (same API, same results).")

    compiled = torch.compile(model, backend="piecewise")
    rows, labels = [], {}
    with torch.inference_mode():
        _decode_ms(model, model.vocab, 1, prompt, 2, device)  # eager's own first calls (cuBLAS, kernels) untimed
        start = time.perf_counter()
        _decode_ms(compiled, model.vocab, 1, prompt, 2, device, labels)
        print(f"first calls (compile + prefill + first decodes): {time.perf_counter() - start:.1f} s")
        for batch in args.batches:
            rows.append(
                (
                    batch,
                    _decode_ms(model, model.vocab, batch, prompt, args.steps, device),
                    _decode_ms(compiled, model.vocab, batch, prompt, args.steps, device, labels),
                )
            )

    _show_pieces(max(compiled_graphs(), key=lambda g: g.stats.calls))  # the decode graph
    graphs = compiled_graphs()
    print(
        f"\n{len(graphs)} graphs: prefill and decode, batch 1 apart from the other batch sizes (Dynamo keeps "
        f"size 1 apart; every other size shares one graph)"
    )
    for g in graphs:
        label = f" ({labels[g.serial]})" if g.serial in labels else ""
        print(f"\ngraph {g.serial}{label}:\n  " + g.stats.summary().replace("\n", "\n  "))
        if g.stats.events:
            print("  " + g.stats.table().replace("\n", "\n  "))
    _print_times(rows, cuda, args.steps - args.steps // 2)


def _print_times(rows: list, cuda: bool, timed: int) -> None:
    print(f"\ndecode step time, ms: median (p10-p90) of {timed} steps")
    if not cuda:  # nothing is graphed here: a ratio would only measure the machine's noise
        print("  no CUDA graphs on CPU: the pieces run compiled, un-graphed; no ratio is claimed here")
        print(f"  {'batch':>5}  {'eager':>21}  {'compiled':>21}")
        for batch, eager, compiled in rows:
            print(f"  {batch:5d}  {_spread(eager):>21}  {_spread(compiled):>21}")
        return
    print(f"  {'batch':>5}  {'eager':>21}  {'piecewise':>21}  {'speed-up':>8}")
    for batch, eager, piecewise in rows:
        ratio = statistics.median(eager) / statistics.median(piecewise)
        print(f"  {batch:5d}  {_spread(eager):>21}  {_spread(piecewise):>21}  {ratio:7.2f}x")


if __name__ == "__main__":
    main()
