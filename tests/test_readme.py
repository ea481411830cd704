"""Every code block of the README runs as written (CPU): each Python block in a fresh interpreter
(its own Dynamo), the demo command's ``python -m piecewise_backend``, and the test command is
``.ci/run``'s. A block that stops running fails here, not in a newcomer's first hour."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def _run(args: list[str], cwd: pathlib.Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_readme_has_the_blocks_this_file_runs():
    assert len(_blocks("python")) == 5 and len(_blocks("bash")) == 2


def test_the_readme_stays_under_fifteen_thousand_characters():
    assert len(README) <= 15_000, len(README)


@pytest.mark.parametrize("index", range(5))
def test_each_python_block_runs_as_written(index, tmp_path):
    code = _blocks("python")[index]
    done = _run(["-c", code], tmp_path)
    assert done.returncode == 0, f"README python block {index}:\n{code}\n--- stderr:\n{done.stderr[-3000:]}"
    # a block as written draws no warning of ours (they start "piecewise:"; a path that holds the word,
    # a virtual environment's, say, is not one)
    leaked = [line for line in done.stderr.splitlines() if re.search(r"Warning: piecewise:|piecewise_backend/", line)]
    assert not leaked, leaked


def test_the_demo_command_runs_and_claims_no_speed_up_on_cpu(tmp_path):
    demo, tests = _blocks("bash")
    assert demo.strip().endswith(".venv/bin/python -m piecewise_backend")
    assert tests.strip() == (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    done = _run(["-m", "piecewise_backend"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    if not __import__("torch").cuda.is_available():
        assert "speed-up" not in out and "captures: 0" not in out, out
        assert "no CUDA graphs on CPU" in out, out
    assert "p10" in out and "p90" in out, out  # the spread beside the median


def _support_line() -> str:
    """The README's paragraph of versions tested ("Tested. ..."), on one line."""
    return " ".join(README.split("Tested. ", 1)[1].split("\n\n", 1)[0].split())


def test_the_support_line_quotes_the_newest_versions_scripts_last_result():
    """``.ci/newest`` writes its last result to ``.ci/newest.last``; the README's support line says the
    same date, versions and counts (a rerun that is not quoted, or a quote edited by hand, fails)."""
    last = (ROOT / ".ci" / "newest.last").read_text().splitlines()[0]
    date, torch_version, transformers_version = re.match(
        r"(\S+): torch (\d+\.\d+\.\d+)\S*, transformers (\S+),", last
    ).groups()
    passed = re.search(r"(\d+) passed", last).group(1)
    failed = found.group(1) if (found := re.search(r"(\d+) failed", last)) else "0"
    support = _support_line()
    assert f"torch {torch_version} + transformers {transformers_version}" in support, support
    assert f"(`.ci/newest`, {date}: {passed} passed, {failed} failed)" in support, support


def test_the_support_line_quotes_the_hf_cuda_tests_on_the_newest_transformers():
    """The Hugging Face CUDA tests run on the device with the newest transformers (``reliability``'s
    ``cuda-tests-newest-transformers`` row): the support line says its transformers, GPU and counts."""
    import json

    rows = [(path.stem.upper(), r) for path in sorted((ROOT / "benchmarks" / "results").glob("*.json"))
            for r in json.loads(path.read_text()).get("rows", []) if r["variant"] == "cuda-tests-newest-transformers"]  # fmt: skip
    assert rows, "no cuda-tests-newest-transformers row in benchmarks/results"
    gpu, row = rows[-1]
    f = row["figures"]
    support = _support_line()
    assert f"with {f['transformers']} ({gpu}," in support, support
    assert f"{f['passed']} passed, {f['failed']} failed." in support, support
