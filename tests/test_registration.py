"""The entry point: a fresh interpreter finds backend="piecewise" without importing the package."""

import subprocess
import sys
import textwrap


def test_fresh_interpreter_finds_backend_by_name():
    code = textwrap.dedent("""
        import sys
        import torch
        import torch.nn.functional as F

        class Toy(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = torch.nn.Linear(16, 48)
                self.out = torch.nn.Linear(16, 16)

            def forward(self, x):
                q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).unbind(2)
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
                return self.out(o.transpose(1, 2).reshape(x.shape))

        assert "piecewise_backend" not in sys.modules
        assert "piecewise" in torch._dynamo.list_backends()
        toy = Toy().eval()
        x = torch.randn(2, 5, 16)
        with torch.no_grad():
            out = torch.compile(toy, backend="piecewise")(x)
            torch.testing.assert_close(out, toy(x), atol=1e-5, rtol=1e-5)
        import piecewise_backend
        (graph,) = piecewise_backend.compiled_graphs()
        assert [p.kind for p in graph.pieces] == ["compute", "split", "compute"], graph.pieces
        print("OK")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK")
