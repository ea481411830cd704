"""On a GPU: our graphs keep working next to torch's own CUDA graphs in the same process.

``mode="reduce-overhead"`` frees cuBLAS's workspaces around its captures and empties the allocator's
cache; a graph of ours whose matmuls wrote into a workspace allocated outside our pool then wrote
through a freed address ("illegal memory access": the H200 benchmark, both backends in one
process). The check runs in a child process, because an illegal address poisons the CUDA context
of the process it happens in, and every later test in it would fail too.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda

# bf16 and the 16-layer benchmark model's matmul shapes (hidden 1024, SwiGLU 2816, vocab 32000) at
# batch 1: the shapes that made cuBLAS use its workspace there; two layers keep the compile short.
CHILD = r"""
import torch
from toys.models import BENCHMARK_SIZES, ToyConfig, ToyLlama, init_weights_, sdpa_backends
from tests.helpers import llama_decode

cfg = ToyConfig(**{**BENCHMARK_SIZES["16L"], "layers": 2}, max_batch=2, max_seq=64)
model = init_weights_(ToyLlama(cfg)).to("cuda", torch.bfloat16).eval()
neighbour = torch.nn.Sequential(torch.nn.Linear(1024, 2816), torch.nn.GELU(), torch.nn.Linear(2816, 1024))
neighbour = neighbour.to("cuda", torch.bfloat16).eval()
ours = torch.compile(model, backend="piecewise")
theirs = torch.compile(neighbour, mode="reduce-overhead")
x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
with torch.inference_mode(), sdpa_backends("cuda"):
    expected = llama_decode(model, model, 1, 8, 6, device="cuda")
    first = llama_decode(ours, model, 1, 8, 6, device="cuda")  # captures our graphs
    for _ in range(3):  # reduce-overhead warms up, captures, replays
        theirs(x)
    torch.cuda.empty_cache()  # what torch.cuda.graph does: memory freed under a graph is unmapped now
    again = llama_decode(ours, model, 1, 8, 6, device="cuda")  # replays only
    torch.cuda.synchronize()
for step, (a, e) in enumerate(zip(first, expected)):  # bf16: compiled and eager round differently
    torch.testing.assert_close(a, e, atol=0.1, rtol=0.05, msg=lambda m: f"first run vs eager, step {step}: {m}")
for step, (a, e) in enumerate(zip(again, first)):  # the same graphs replayed: the same logits
    torch.testing.assert_close(a, e, atol=1e-2, rtol=1e-2, msg=lambda m: f"after reduce-overhead, step {step}: {m}")
import piecewise_backend
stats = max(piecewise_backend.compiled_graphs(), key=lambda g: g.stats.calls).stats
assert stats.captures > 0 and stats.replays > 0, stats
print("OK", stats.captures, stats.replays)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graphs_survive_a_reduce_overhead_model_in_the_same_process():
    child = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0 and "OK" in child.stdout, (
        "piecewise graphs broke after a reduce-overhead model captured in the same process (does a "
        "captured matmul use a cuBLAS workspace outside the graph pool?):\n" + child.stderr[-4000:]
    )
