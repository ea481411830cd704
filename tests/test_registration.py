"""The entry point: a fresh interpreter finds backend="piecewise" without importing the package."""

import os
import pathlib
import subprocess
import sys
import textwrap

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent


class _Toy(torch.nn.Module):
    """One attention between two linears: two compute pieces around a splitting op."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.out(o.transpose(1, 2).reshape(x.shape))


def _toy() -> torch.nn.Module:
    torch.manual_seed(0)
    return _Toy().eval()


def test_fresh_interpreter_finds_backend_by_name():
    code = textwrap.dedent("""
        import sys
        import torch
        from tests.test_registration import _toy

        assert "piecewise_backend" not in sys.modules
        assert "piecewise" in torch._dynamo.list_backends()
        toy = _toy()
        x = torch.randn(2, 5, 16)
        with torch.no_grad():
            out = torch.compile(toy, backend="piecewise")(x)
            torch.testing.assert_close(out, toy(x), atol=1e-5, rtol=1e-5)
        import piecewise_backend
        (graph,) = piecewise_backend.compiled_graphs()
        assert [p.kind for p in graph.pieces] == ["compute", "split", "compute"], graph.pieces
        print("OK")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK")


def test_caching_precompile_leaves_the_backend_tracing_again(tmp_path):
    """``TORCH_CACHING_PRECOMPILE=1`` (torch's Dynamo cache) saves each frame's package, but this
    backend records no precompile artifact, so a new process traces again and builds its graph
    anew ("Backend not found"), with eager's outputs: a user's flag that cannot help here, and must
    not hurt. (Inductor's own backend failed in that second process on transformers' ``generate()``,
    torch 2.13: ``benchmarks/README.md``.)"""
    code = textwrap.dedent("""
        import torch
        import piecewise_backend
        from tests.test_registration import _toy

        assert torch._dynamo.config.caching_precompile
        toy = _toy()
        x = torch.randn(2, 5, 16)
        with torch.no_grad():
            out = torch.compile(toy, backend="piecewise")(x)
            torch.testing.assert_close(out, toy(x), atol=1e-5, rtol=1e-5)
        torch.compiler.save_cache_artifacts()
        print("graphs built:", len(piecewise_backend.compiled_graphs()))
    """)
    env = {**os.environ, "TORCH_CACHING_PRECOMPILE": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    for run in ("first", "second"):
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT
        )
        assert result.returncode == 0, f"{run} process: {result.stderr[-3000:]}"
        assert result.stdout.strip().endswith("graphs built: 1"), (run, result.stdout)
        if run == "first":  # the Dynamo cache was written: the second process has something to load
            assert any((tmp_path / "dynamo").iterdir()), sorted(p.name for p in tmp_path.iterdir())
