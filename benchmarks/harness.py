"""The one harness every suite runs under: a child process per variant, rows of one schema written as
they come, recorded per GPU kind.

Why a child per variant: a cold start needs a fresh process (and, for some suites, empty Inductor and
Triton caches), and a variant that hangs or crashes must leave the others' rows: each child has its
own timeout, and its failure is a row with an ``error`` figure, never a silent gap. A suite whose
figures are ratios of variants timed in turns in one process (``decode``: every backend on one
model, interleaved, so a slow spell of the machine hits all alike) runs one child per model, and
each row names its backend.

A row: ``{suite, variant, gpu, torch, code_hash, figures}``. The code hash follows
``../shared/tools/code_hash.py``'s definition (sha256 over the package's ``.py`` files in sorted path
order: path, NUL, bytes, NUL), recomputed here because ``shared/`` does not travel to the GPU machine.
Results go to ``results/<gpu>.json`` by the GPU that measured them (``h100.json``, ``h200.json``):
the device lends either from call to call, and a ratio must never mix rows of two cards.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PREFIX = "ROW "  # the line a child prints a row's figures on (its other output is free)
SCHEMA = ("suite", "variant", "gpu", "torch", "code_hash", "figures")


@dataclasses.dataclass(frozen=True)
class Suite:
    """What a suite is to the harness. ``run(variant, args)`` runs in the child and yields each row's
    figures as it has them (a figure ``variant`` renames the row: a backend timed in a model's child).
    ``options`` adds the suite's own command-line options, their defaults the full run's; ``smoke``
    is what ``--smoke`` adds to the command line: tiny sizes that run on CPU in seconds."""

    name: str
    about: str
    variants: tuple[str, ...]
    run: Callable[[str, argparse.Namespace], Iterator[dict]]
    options: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    smoke: list[str] | tuple[str, ...] = ()
    default: tuple[str, ...] = ()  # the variants a plain run runs (all if empty)
    fresh_caches: bool = False  # each child starts with empty Inductor and Triton caches (a cold start)
    env: Callable[[str, argparse.Namespace], dict] = lambda variant, args: {}  # a child's more environment
    timeout: int = 600  # seconds per child


def code_hash(root: pathlib.Path = ROOT) -> str:
    h = hashlib.sha256()
    for rel in sorted(p.relative_to(root).as_posix() for p in (root / "piecewise_backend").rglob("*.py")):
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def gpu_slug(name: str) -> str:
    """The results file's name for a GPU: ``h200`` for "NVIDIA H200", ``h100`` for "NVIDIA H100 80GB HBM3"."""
    model = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", name)
    return model.group(1).lower() if model else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def row(suite: str, variant: str, figures: dict, *, gpu: str, torch_version: str, digest: str) -> dict:
    figures = dict(figures)
    variant = figures.pop("variant", variant)
    return {
        "suite": suite,
        "variant": variant,
        "gpu": gpu,
        "torch": torch_version,
        "code_hash": digest,
        "figures": figures,
    }


def parser_for(suite: Suite) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks {suite.name}", description=suite.about)
    parser.add_argument("--variants", default=",".join(suite.default or suite.variants), help="comma-separated")
    parser.add_argument("--out", help="append the rows here as JSON lines, each as it comes")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, on CPU if there is no GPU")
    parser.add_argument("--timeout", type=int, default=suite.timeout, help="seconds per child process")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # set in the child: the variant it runs
    parser.add_argument("--work", help=argparse.SUPPRESS)  # a folder the run's children share (an artifact)
    suite.options(parser)
    return parser


def parse(suite: Suite, argv: list[str]) -> argparse.Namespace:
    args = parser_for(suite).parse_args(argv)
    if args.smoke:  # the smoke sizes, then what the command line said (which wins)
        args = parser_for(suite).parse_args([*suite.smoke, *argv])
    unknown = sorted(set(args.variants.split(",")) - set(suite.variants))
    if unknown and not args.child:
        raise SystemExit(f"{suite.name}: no variant {', '.join(unknown)}; the suite has {', '.join(suite.variants)}")
    return args


def run_child(suite: Suite, args: argparse.Namespace) -> None:
    """In the child: the variant's figures, one ``ROW`` line each, as they come."""
    for figures in suite.run(args.child, args):
        print(PREFIX + json.dumps(figures, default=str), flush=True)


def run_suite(suite: Suite, argv: list[str]) -> list[dict]:
    """In the parent: each variant in a child process of its own, its rows printed and appended to
    ``--out`` as they come; a child that fails or runs out of time leaves a row saying so."""
    args = parse(suite, argv)
    if args.child:
        run_child(suite, args)
        return []
    import torch

    stamp = {"gpu": gpu_name(), "torch_version": torch.__version__, "digest": code_hash()}
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"bench-{suite.name}-") as work:  # what the children share
        args.work = work
        for variant in args.variants.split(","):
            env = {**os.environ, **suite.env(variant, args)}
            for got in _child_rows(suite, variant, [*argv, "--work", work], args.timeout, env):
                rows.append(row(suite.name, variant, got, **stamp))
                print(json.dumps(rows[-1]), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")
    return rows


def _child_rows(suite: Suite, variant: str, argv: list[str], timeout: int, env: dict) -> Iterator[dict]:
    cmd = [sys.executable, "-m", "benchmarks", suite.name, *argv, "--child", variant]
    with tempfile.TemporaryDirectory(prefix=f"bench-{suite.name}-") as caches:
        if suite.fresh_caches:
            env.update(TORCHINDUCTOR_CACHE_DIR=f"{caches}/inductor", TRITON_CACHE_DIR=f"{caches}/triton")
        with tempfile.TemporaryFile("w+") as err:
            # a session of its own: a timeout kills what the child started too (Inductor's compile
            # workers, torchrun's ranks), not only the child
            child = subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, start_new_session=True
            )
            deadline, seen = time.monotonic() + timeout, 0
            try:
                for line in _lines_until(child, deadline):
                    if line.startswith(PREFIX):
                        seen += 1
                        yield json.loads(line[len(PREFIX) :])
            except TimeoutError:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                yield {"error": f"timed out after {timeout} s ({seen} rows before)"}
                return
            if child.wait() != 0:
                err.seek(0)
                yield {"error": f"exit {child.returncode}: " + err.read()[-600:]}


def _lines_until(child: subprocess.Popen, deadline: float) -> Iterator[str]:
    """The child's stdout, line by line; TimeoutError past ``deadline`` (checked by a reader thread)."""
    import queue
    import threading

    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in child.stdout] + [lines.put(None)], daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError from None
        if line is None:
            return
        yield line


# -- the results files: rows of one GPU kind each ------------------------------------------------------


def results_path(gpu: str) -> pathlib.Path:
    return RESULTS / f"{gpu_slug(gpu)}.json"


def read_results(path: pathlib.Path) -> dict:
    """``{"rows": [...], "recorded": {suite: when it was last recorded}}`` (and older runs' ``"history"``)."""
    return json.loads(path.read_text()) if path.exists() else {"rows": []}


def record(rows: list[dict]) -> list[pathlib.Path]:
    """Merge rows into ``results/<gpu>.json``: a (suite, variant, code hash) recorded again replaces
    its rows; rows are kept in the order they were recorded (the report's newest is the last)."""
    written = []
    for gpu in sorted({r["gpu"] for r in rows}):
        if gpu == "cpu":
            raise SystemExit("record: rows measured on CPU (a smoke run?) are not results; run the suite on a GPU")
        new = [r for r in rows if r["gpu"] == gpu]
        missing = [k for r in new for k in SCHEMA if k not in r]
        if missing:
            raise SystemExit(f"record: rows lack {sorted(set(missing))}: not written by the harness")
        path = results_path(gpu)
        result = read_results(path)
        replaced = {(r["suite"], r["variant"], r["code_hash"]) for r in new}
        result["rows"] = [r for r in result["rows"] if (r["suite"], r["variant"], r["code_hash"]) not in replaced] + new
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        result.setdefault("recorded", {}).update({r["suite"]: now for r in new})  # which GPU measured a suite last
        path.write_text(json.dumps(result, indent=1) + "\n")
        written.append(path)
    return written


def read_rows(paths: list[str]) -> list[dict]:
    return [json.loads(line) for p in paths for line in pathlib.Path(p).read_text().splitlines() if line.strip()]
