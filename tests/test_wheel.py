"""The wheel a user installs: ``pip wheel --no-deps .`` holds the package and nothing of the repository
around it (toys, benchmarks, tests), and in a fresh virtual environment (torch 2.13's CPU build, then
the wheel) ``backend="piecewise"`` resolves through the entry point and the demo runs, from a folder
where the checkout cannot be imported by accident."""

import pathlib
import subprocess
import sys
import zipfile

import pytest

import piecewise_backend

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    return next(out.glob("piecewise_backend-*.whl"))


def test_the_wheel_holds_the_package_only_and_its_entry_point(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    info = f"piecewise_backend-{piecewise_backend.__version__}.dist-info/"
    assert wheel.name.startswith(f"piecewise_backend-{piecewise_backend.__version__}-")
    assert [n for n in names if not n.startswith(("piecewise_backend/", info))] == []
    assert "piecewise_backend/_torch_internals/aot.py" in names and "piecewise_backend/ops/paged_kernel.py" in names
    entry_points = zipfile.ZipFile(wheel).read(info + "entry_points.txt").decode()
    assert "[torch_dynamo_backends]" in entry_points
    assert "piecewise = piecewise_backend.backend:piecewise" in entry_points


def test_the_demo_runs_from_the_wheel_in_a_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "-q", "torch==2.13.0", str(wheel)],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
    check = (
        "import torch, piecewise_backend; from torch._dynamo import list_backends; "
        "print(piecewise_backend.__file__); print('piecewise' in list_backends())"
    )
    found = subprocess.run([str(python), "-c", check], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert found.returncode == 0, found.stderr[-3000:]
    where, registered = found.stdout.split()
    assert where.startswith(str(venv)) and registered == "True", found.stdout
    demo = subprocess.run(
        [str(python), "-m", "piecewise_backend"], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "demo decoder" in demo.stdout and "compiled" in demo.stdout, demo.stdout[-2000:]
