"""A compiled graph saved and loaded in a second process (``persist/``), on CPU with emulated graphs:
the loaded function gives the first process's outputs with no Dynamo trace and no Inductor compile,
through either compiler; an artifact that does not fit (another torch, edited model code, another
dtype) is refused with its reason and the function is compiled instead, still right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import torch

import piecewise_backend
from piecewise_backend import emulated_graphs

MODEL = textwrap.dedent('''
    import torch

    class Block(torch.nn.Module):
        """Two linears around attention: a compute piece, an eager one, a compute piece."""

        def __init__(self, width=16):
            super().__init__()
            self.inner, self.outer = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

        def forward(self, x):
            h = torch.relu(self.inner(x))
            q = h.view(x.shape[0], 2, 4, 2).transpose(1, 2)
            a = torch.nn.functional.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(x.shape)
            return self.outer(a + h)
''')

LOADER = textwrap.dedent("""
    import json, sys, warnings
    import torch
    sys.path.insert(0, sys.argv[1])
    import piecewise_backend, warm_model
    from torch._dynamo.utils import counters
    import torch._inductor.compile_fx as compile_fx

    def no_compile(*args, **kwargs):
        raise AssertionError("Inductor compiled in the loading process")

    compile_fx.compile_fx = no_compile
    torch.manual_seed(0)
    device = sys.argv[3]
    if sys.argv[4:] == ["preload"]:  # before the model exists
        piecewise_backend.preload(sys.argv[2])
    model = warm_model.Block().eval().to(device)
    with torch.no_grad(), piecewise_backend.emulated_graphs(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = piecewise_backend.load(sys.argv[2], model.forward)
        outputs = []
        for n in (4, 3, 7, 4):  # each size met captured behind the call, in before the next call
            outputs.append(fn(torch.full((n, 16), 0.1 * n, device=device)).tolist())
            piecewise_backend.wait_for_captures()
    graphs = piecewise_backend.compiled_graphs()
    print(json.dumps({"outputs": outputs, "frames": sum(counters["frames"].values()),
                      "preloaded": fn.load_seconds.get("preloaded", False),
                      "loaded": [g.stats.loaded for g in graphs], "replays": sum(g.stats.replays for g in graphs),
                      "warnings": [str(w.message) for w in caught if "piecewise" in str(w.message)]}))
""")


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    (tmp_path / "warm_model.py").write_text(MODEL)
    (tmp_path / "loader.py").write_text(LOADER)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("warm_model", None)
    return tmp_path


def _block(device="cpu"):
    import warm_model

    torch.manual_seed(0)
    return warm_model.Block().eval().to(device)


def _save(model_dir, compiler: str, device="cpu"):
    model = _block(device)
    example = torch.randn(4, 16, device=device)
    torch._dynamo.mark_dynamic(example, 0)
    path = str(model_dir / f"block-{compiler}.bin")
    with torch.no_grad(), emulated_graphs():
        fn = piecewise_backend.save(model.forward, (example,), path, options={"compiler": compiler})
        outputs = []
        for n in (4, 3, 7, 4):  # each size met captured behind the call, in before the next call
            outputs.append(fn(torch.full((n, 16), 0.1 * n, device=device)).tolist())
            piecewise_backend.wait_for_captures()
        for got, n in zip(outputs, (4, 3, 7, 4)):
            torch.testing.assert_close(
                torch.tensor(got, device=device), model(torch.full((n, 16), 0.1 * n, device=device))
            )
    return model, path, outputs


def _load_in_a_new_process(model_dir, path, device="cpu", preload=False) -> dict:
    """The loader in a fresh process with empty Inductor and Triton caches (a fresh container)."""
    caches = model_dir / "fresh-caches"
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "TRITON_CACHE_DIR": str(caches / "triton"),
    }
    done = subprocess.run(
        [sys.executable, str(model_dir / "loader.py"), str(model_dir), path, device, *(["preload"] if preload else [])],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "compiler,device,preload",
    [
        ("inductor", "cpu", False),
        ("eager", "cpu", True),
        pytest.param("inductor", "cuda", True, marks=pytest.mark.cuda),
    ],
)
def test_a_saved_graph_loaded_in_a_second_process_gives_the_first_process_outputs(model_dir, compiler, device, preload):
    _, path, outputs = _save(model_dir, compiler, device)
    loaded = _load_in_a_new_process(model_dir, path, device, preload)
    assert loaded["warnings"] == []
    assert loaded["preloaded"] == preload  # preload(): read while the model was built, taken by load()
    assert loaded["outputs"] == outputs  # the same code on the same inputs: the same numbers
    assert loaded["frames"] == 0  # no Dynamo trace (and compile_fx was made to raise: no Inductor compile)
    assert loaded["loaded"] == [True] and loaded["replays"] > 0  # captured lazily, replayed, as a fresh build


def test_an_artifact_of_another_torch_is_refused_naming_it_and_the_function_compiled(model_dir, monkeypatch):
    model, path, outputs = _save(model_dir, "eager")
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    monkeypatch.setattr(torch.version, "__version__", "2.99.0")
    with torch.no_grad(), emulated_graphs(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = piecewise_backend.load(path, model.forward, options={"compiler": "eager"})
        got = fn(torch.full((3, 16), 0.3))
    (message,) = [str(w.message) for w in caught if "not loading" in str(w.message)]
    assert "2.99.0" in message and "Compiling instead" in message
    torch.testing.assert_close(got, torch.tensor(outputs[1]))


def test_preload_reads_in_a_thread_while_modules_run_here_and_load_takes_what_it_read(model_dir):
    model, path, outputs = _save(model_dir, "eager")
    piecewise_backend.preload(path)
    x = torch.full((3, 16), 0.3)
    for _ in range(20):  # modules called here meanwhile: the preload traces nothing (FX patches Module)
        torch.testing.assert_close(model(x), torch.tensor(outputs[1]))
    with torch.no_grad(), emulated_graphs(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = piecewise_backend.load(path, model.forward, options={"compiler": "eager"})
        got = fn(x)
    assert fn.load_seconds["preloaded"] is True and fn.load_seconds["code_s"] > 0  # the code rebuilt in load
    assert [str(w.message) for w in caught if "piecewise" in str(w.message)] == []
    torch.testing.assert_close(got, torch.tensor(outputs[1]))


def test_edited_model_code_is_refused_naming_the_module(model_dir):
    model, path, _ = _save(model_dir, "eager")
    (model_dir / "warm_model.py").write_text(MODEL.replace("torch.relu(", "torch.tanh("))
    with torch.no_grad(), emulated_graphs(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = piecewise_backend.load(path, model.forward, options={"compiler": "eager"})
    (message,) = [str(w.message) for w in caught if "not loading" in str(w.message)]
    assert "the model's code changed since it was saved (warm_model)" in message
    assert not isinstance(fn, piecewise_backend.persist.warm_start.WarmFunction)


def test_a_call_in_another_dtype_is_not_run_on_the_artifact_but_compiled_and_right(model_dir):
    model, path, _ = _save(model_dir, "eager")
    model = model.double()
    x = torch.full((3, 16), 0.3, dtype=torch.float64)
    with torch.no_grad(), emulated_graphs(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = piecewise_backend.load(path, model.forward, options={"compiler": "eager"})
        got = fn(x)
    assert [w for w in caught if "does not fit the saved compiled function" in str(w.message)]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, model(x))


def test_saving_a_forward_of_torchs_own_module_class_is_refused_naming_the_fix(tmp_path):
    with torch.inference_mode(), pytest.raises(RuntimeError, match="wrap the model in a module class of your own"):
        piecewise_backend.save(
            torch.nn.Linear(8, 8).forward,
            (torch.randn(2, 8),),
            str(tmp_path / "linear.bin"),
            options={"compiler": "eager"},
        )
    assert not (tmp_path / "linear.bin").exists()


# -- the package's own Triton kernels travel in the artifact (ops/kernel_bundle.py) -----------------


@pytest.fixture
def fake_kernel(tmp_path, monkeypatch):
    """A compiled kernel as Triton hands it back (its cache key and its files), noted in a fresh registry."""
    from piecewise_backend.ops import kernel_bundle

    monkeypatch.setattr(kernel_bundle, "_NOTED", {})
    files = {"decode_kernel.json": b'{"name": "decode_kernel"}', "decode_kernel.cubin": bytes(range(256))}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    kernel = types.SimpleNamespace(hash="f" * 64, metadata_group={name: str(tmp_path / name) for name in files})
    return kernel, files


def test_a_kernel_launched_after_save_is_written_into_the_artifact_by_the_next_call(model_dir, fake_kernel):
    from piecewise_backend.ops import kernel_bundle
    from piecewise_backend.persist.artifact_file import ArtifactFile

    model, path, outputs = _save(model_dir, "eager")  # its calls launched none of the package's kernels
    assert ArtifactFile.read(path).kernels == {}
    kernel, files = fake_kernel
    kernel_bundle.note(kernel)  # as a decode step's first launch does
    kernel_bundle.note(kernel)  # a second launch of it: nothing new
    assert kernel_bundle.noted() == 1
    fn = piecewise_backend.load(path, model.forward, options={"compiler": "eager"})
    with torch.no_grad(), emulated_graphs():
        torch.testing.assert_close(fn(torch.full((3, 16), 0.3)), torch.tensor(outputs[1]))
    saved = ArtifactFile.read(path).kernels
    assert list(saved) == [kernel.hash] and saved[kernel.hash]["files"] == files
    assert saved[kernel.hash]["group"] == "decode_kernel.json"


def test_saved_kernels_are_put_into_an_empty_triton_cache_when_loaded_in_a_new_process(model_dir, fake_kernel):
    pytest.importorskip("triton")
    from piecewise_backend.ops import kernel_bundle

    kernel, files = fake_kernel
    kernel_bundle.note(kernel)
    _, path, _ = _save(model_dir, "eager")
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(model_dir)!r})
        import piecewise_backend, warm_model
        from triton.runtime.cache import get_cache_manager
        assert get_cache_manager({kernel.hash!r}).get_group("decode_kernel.json") is None  # an empty cache
        piecewise_backend.load({path!r}, warm_model.Block().forward, options={{"compiler": "eager"}})
        group = get_cache_manager({kernel.hash!r}).get_group("decode_kernel.json")
        print(json.dumps({{name: list(open(p, "rb").read()) for name, p in group.items()}}))
    """)
    caches = model_dir / "fresh-caches"
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "TRITON_CACHE_DIR": str(caches / "triton"),
    }
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert {name: bytes(data) for name, data in found.items()} == files  # where Triton's own compile puts them


def test_an_artifact_that_cannot_take_new_kernels_warns_once_and_serves(model_dir, fake_kernel, monkeypatch):
    from piecewise_backend.ops import kernel_bundle

    model, path, outputs = _save(model_dir, "eager")
    fn = piecewise_backend.load(path, model.forward, options={"compiler": "eager"})
    kernel_bundle.note(fake_kernel[0])

    def read_only(*args):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(os, "replace", read_only)
    with torch.no_grad(), emulated_graphs(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [fn(torch.full((n, 16), 0.1 * n)) for n in (3, 7)]
    (message,) = [str(w.message) for w in caught if "kernels compiled since" in str(w.message)]
    assert "read-only file system" in message and path in message
    torch.testing.assert_close(got[0], torch.tensor(outputs[1]))
    torch.testing.assert_close(got[1], torch.tensor(outputs[2]))
