"""A/B of two versions of the package on one machine: each version's own suite, in alternating processes.

    python -m benchmarks.ab_versions --export REV DIR      # here: REV's package and benchmarks into DIR
    python -m benchmarks.ab_versions A_DIR B_DIR [--models 16L --batches 1 8 32
        --variants limit piecewise --rounds 3 --json out.json]

Why: the lent machines differ by more than the changes being measured (the same piecewise step took
1.36 ms at batch 1 on one H200 machine and 1.80 ms on another; eager 8 ms on one, 16 ms on the
next), so a version's numbers set against numbers from an earlier lease say little. Here, on one
machine, each round runs A's ``benchmarks/suite.py`` in a fresh process with A's package first on
``PYTHONPATH``, then B's, then A's again ..., with Inductor's cache shared (after the first round
the compiles are cache hits). Per version, model, variant and batch: the median over rounds of the
step time and of its ratio to the same process's ``limit`` (when ``limit`` is among the variants),
and B's median over A's.

A version directory is a checkout or an export (``--export``: ``git archive`` of the package and
``benchmarks/``, what travels to the device in an ignored folder named in ``carry``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from benchmarks.plot import limit_times, vs_limit
from benchmarks.record import code_hash


def export(rev: str, target: str) -> None:
    """``rev``'s ``piecewise_backend/``, ``benchmarks/`` and ``toys/`` into ``target`` (from this repo's git)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    pathlib.Path(target).mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", rev, "piecewise_backend", "benchmarks", "toys"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", target], input=archive, check=True)
    print(f"{rev} -> {target} (code hash {code_hash(pathlib.Path(target))[:8]})")


def _env(version: pathlib.Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(version), os.environ.get("PYTHONPATH", "")])}


def _check_import(version: pathlib.Path) -> None:
    """The child must import *this* version's package, not an installed one."""
    where = subprocess.run(
        [sys.executable, "-c", "import piecewise_backend; print(piecewise_backend.__file__)"],
        env=_env(version),
        cwd=version / "benchmarks",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not pathlib.Path(where).resolve().is_relative_to(version.resolve()):
        raise SystemExit(f"{version}: piecewise_backend imports from {where}, not from the version directory")


def _one_run(version: pathlib.Path, args, out: pathlib.Path) -> list[dict]:
    package = (version / "benchmarks" / "__init__.py").exists()  # since the benchmarks became a package
    runs = ["-m", "benchmarks.suite"] if package else [str(version / "benchmarks" / "suite.py")]
    command = [
        sys.executable,
        *runs,
        "--out",
        str(out),
        "--models",
        *args.models,
        "--batches",
        *map(str, args.batches),
        "--variants",
        *args.variants,
        "--steps",
        str(args.steps),
        "--prompt",
        str(args.prompt),
    ]
    done = subprocess.run(
        command, env=_env(version), cwd=version if package else version / "benchmarks", capture_output=True, text=True
    )
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"{version}: suite failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())["decode"]


def _with_ratios(rows: list[dict]) -> list[dict]:
    limits = limit_times(rows)
    for r in rows:
        r["vs_limit"] = vs_limit(r, limits)
    return rows


def _summary(runs: dict[str, list[list[dict]]]) -> list[dict]:
    """One row per (model, variant, batch): each version's medians over rounds, and B / A."""
    table: dict[tuple, dict] = {}
    for label, rounds in runs.items():
        for rows in rounds:
            for r in rows:
                entry = table.setdefault((r["model"], r["variant"], r["batch"]), {})
                entry.setdefault(label, {"step_ms": [], "vs_limit": []})
                for field in ("step_ms", "vs_limit"):
                    if r.get(field) is not None:
                        entry[label][field].append(r[field])
    summary = []
    for (model, variant, batch), entry in sorted(table.items()):
        row = {"model": model, "variant": variant, "batch": batch}
        for label, values in entry.items():
            for field, xs in values.items():
                row[f"{label}_{field}"] = round(statistics.median(xs), 4) if xs else None
        a, b = row.get("A_step_ms"), row.get("B_step_ms")
        row["B_over_A"] = round(b / a, 3) if a and b else None
        summary.append(row)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="*", help="A_DIR B_DIR")
    parser.add_argument("--export", nargs=2, metavar=("REV", "DIR"))
    parser.add_argument("--models", nargs="+", default=["16L"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--variants", nargs="+", default=["limit", "piecewise"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.export:
        return export(*args.export)
    if len(args.versions) != 2:
        parser.error("give two version directories (A_DIR B_DIR), or --export REV DIR")
    versions = {"A": pathlib.Path(args.versions[0]).resolve(), "B": pathlib.Path(args.versions[1]).resolve()}
    for version in versions.values():
        _check_import(version)
    runs: dict[str, list[list[dict]]] = {label: [] for label in versions}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for label, version in versions.items():
                rows = _with_ratios(_one_run(version, args, pathlib.Path(tmp) / f"{label}{i}.json"))
                runs[label].append(rows)
                print(
                    json.dumps(
                        {
                            "round": i,
                            "version": label,
                            "rows": [
                                {k: r.get(k) for k in ("model", "variant", "batch", "step_ms", "vs_limit", "error")}
                                for r in rows
                            ],
                        }
                    ),
                    flush=True,
                )
    result = {
        "versions": {label: {"dir": str(v), "code_hash": code_hash(v)} for label, v in versions.items()},
        "rounds": args.rounds,
        "summary": _summary(runs),
        "runs": runs,
    }
    for row in result["summary"]:
        print(json.dumps(row))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
