"""Merge a device run into benchmarks/results/<gpu>.json, stamped with the code hash.

    python -m benchmarks.record [--junit pytest.xml] [--suite suite.json] [--capture capture.json]
                                [--host host.json] [--ab ab.json] [--fuzz fuzz.json]
                                [--moved-weights moved_weights.json] [--hf hf.json] [--threads threads.json]
                                --previous results/h200.json --out h200.json

Each part replaces only the keys it produces, so a run split over several device calls accumulates
in one file. One file per kind of GPU (``gpu_slug``): the device lends an H100 or an H200 from call
to call, and a row measured on one must never be divided by a row measured on the other.

The code hash follows ../shared/tools/code_hash.py's definition (sha256 over the package's .py
files in sorted path order: path, NUL, bytes, NUL), recomputed here because shared/ does not travel
to the GPU machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import re
import xml.etree.ElementTree as ET

import torch

from benchmarks.plot import ratios_to_limit

ROOT = pathlib.Path(__file__).resolve().parents[1]


def code_hash(root: pathlib.Path = ROOT) -> str:
    h = hashlib.sha256()
    for rel in sorted(p.relative_to(root).as_posix() for p in (root / "piecewise_backend").rglob("*.py")):
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()


def gpu_slug(name: str | None = None) -> str:
    """The results file's name for a GPU: ``h200`` for "NVIDIA H200", ``h100`` for "NVIDIA H100 80GB HBM3"."""
    name = torch.cuda.get_device_name() if name is None else name
    model = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", name)
    return model.group(1).lower() if model else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def merge_rows(old: list[dict], new: list[dict], key: tuple, digest: str, old_default_hash=None) -> list[dict]:
    """``new`` rows (stamped with ``digest``) plus the old rows of the same code hash they do not
    replace: a suite split over several device calls accumulates, a stale row never survives.
    Old rows without a stamp carry ``old_default_hash`` (the file's code hash when they were written)."""
    new = [{**r, "code_hash": digest} for r in new]
    fresh = {tuple(r[k] for k in key) for r in new}
    kept = [
        r for r in old if r.get("code_hash", old_default_hash) == digest and tuple(r.get(k) for k in key) not in fresh
    ]
    return kept + new


# Rows kept by hand beside a part's own key (a run's extra measurements), per part: filtered to
# the code hash a new run of that part is recorded at.
_KEPT_ROWS = {"suite": "peer_process_rows", "host": "host_breakdown_more"}


def drop_stale_notes(result: dict, digest: str, parts: set) -> None:
    """Remove what a person wrote about an earlier run once that run's rows are replaced.

    Why: notes (``tests_note``, ``decode_note``) and the rows kept beside a part's own key
    (``peer_process_rows``, ``host_breakdown_more``) describe one run; merged into a file whose rows
    now come from another code hash, they would describe numbers no longer there.
    """
    if "tests" in parts:
        result.pop("tests_note", None)
    if "suite" in parts and result.get("code_hash") != digest:
        result.pop("decode_note", None)
    for part, key in _KEPT_ROWS.items():
        if part not in parts:
            continue
        kept = [r for r in result.get(key, []) if r.get("code_hash") == digest]
        if kept:
            result[key] = kept
        else:
            result.pop(key, None)


def pytest_summary(junit_paths: list[str]) -> dict:
    """Passed, failed and skipped, summed over the JUnit files (one per shard of a parallel run)."""
    tests = failures = errors = skipped = 0
    for path in junit_paths:
        suites = ET.parse(path).getroot()
        suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
        counts = [int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")]
        tests, failures, errors, skipped = (a + b for a, b in zip((tests, failures, errors, skipped), counts))
    return {"passed": tests - failures - errors - skipped, "failed": failures + errors, "skipped": skipped}


def _stamped(key: str):
    """The part's JSON, one object, under ``key``, stamped with the code hash."""

    def merge(result: dict, data: dict, digest: str, file_hash) -> None:
        result[key] = {**data, "code_hash": digest}

    return merge


def _suite(result: dict, suite: dict, digest: str, file_hash) -> None:
    for stale in ("piecewise_decode_graph", "process"):  # decode_step.py's keys: the suite's rows replace them
        result.pop(stale, None)
    result["decode"] = merge_rows(
        result.get("decode", []), suite["decode"], ("model", "variant", "batch"), digest, file_hash
    )
    if "startup" in suite:
        result["startup"] = merge_rows(
            result.get("startup", []), suite["startup"], ("model", "variant", "start"), digest, file_hash
        )
    result["vs_limit"] = ratios_to_limit(result["decode"])
    result["code_hash"] = digest


def _hf(result: dict, hf: dict, digest: str, file_hash) -> None:
    key = ("model", "layers", "cache", "batch", "variant")
    second = [r for r in hf["hf"] if r["variant"].endswith("second-call")]  # hf_generate.SECOND_CALL
    others = [r for r in hf["hf"] if not r["variant"].endswith("second-call")]
    result["hf"] = merge_rows(result.get("hf", []), others, key, digest)
    if second:
        result["hf_second_call"] = merge_rows(result.get("hf_second_call", []), second, key, digest)
    result["hf_versions"] = {k: hf[k] for k in ("torch", "transformers")}


def _serving(result: dict, data: dict, digest: str, file_hash) -> None:
    rows = [{k: v for k, v in r.items() if k != "itl_over_time"} for r in data["serving"]]
    if rows:
        result["serving"] = merge_rows(result.get("serving", []), rows, ("variant", "start"), digest)


def _replace_keys(result: dict, data: dict, digest: str, file_hash) -> None:
    """Each key's rows, from one run, replace the key's (graph_memory.py: estimate or sweep;
    paged_kernel.py)."""
    for key, rows in data.items():
        result[key] = [{**r, "code_hash": digest} for r in rows]


def _hf_startup(result: dict, data: dict, digest: str, file_hash) -> None:
    unset = {"specialize_float": False}  # rows from before the option: torch's default
    result["hf_startup"] = merge_rows(
        [{**unset, **r} for r in result.get("hf_startup", [])],
        [{**unset, **r} for r in data["hf_startup"]],
        ("model", "layers", "cache", "specialize_float"),
        digest,
    )


def _seed_workload(result: dict, seed: dict, digest: str, file_hash) -> None:
    result["seed_workload"] = merge_rows(
        result.get("seed_workload", []), seed.get("seed_workload", []), ("variant",), digest
    )
    result["concurrency"] = merge_rows(
        result.get("concurrency", []), seed.get("concurrency", []), ("variant", "in_flight"), digest
    )
    result["seed_vllm"] = seed["seed_vllm"]


def _start_up(result: dict, data: dict, digest: str, file_hash) -> None:
    rows = [{"model": "engine, Qwen2.5-1.5B dims", "start": "process", **r} for r in data["startup"]]
    result["startup"] = merge_rows(result.get("startup", []), rows, ("model", "variant", "start"), digest)


def _graph_kernels(result: dict, rows: list, digest: str, file_hash) -> None:
    result["graph_kernels"] = [{**row, "code_hash": digest} for row in rows]


def _capture(result: dict, capture: dict, digest: str, file_hash) -> None:
    for key in ("capture", "memory"):
        result[key] = {**capture[key], "code_hash": digest}


#: option -> (what it takes, how its JSON joins the results). One row per benchmark; ``--junit``
#: (several files, summed) is the one part read otherwise.
PARTS = {
    "capture": ("capture_cost.py's JSON (capture and memory)", _capture),
    "suite": ("suite.py's JSON (decode rows, start-up rows)", _suite),
    "host": ("host_breakdown.py's JSON", _stamped("host_breakdown")),
    "ab": ("ab_kv_writes.py's JSON", _stamped("ab_kv_writes")),
    "fuzz": ("the GPU fuzz run's JSON (python -m tests.fuzz)", _stamped("fuzz")),
    "moved-weights": ("moved_weights.py's JSON", _stamped("moved_weights")),
    "hf": ("hf_generate.py's JSON", _hf),
    "kernel": ("attention_kernel.py's JSON", _stamped("attention_kernel")),
    "graph-kernels": ("graph_kernels.py's JSON (replaces the key's rows)", _graph_kernels),
    "threads": ("threads.py's JSON", _stamped("threads")),
    "serving": ("serving.py's JSON (rows without their ITL series)", _serving),
    "graph-memory": ("graph_memory.py's JSON (graph_memory_estimate or graph_memory_sweep)", _replace_keys),
    "entry": ("dynamo_entry.py's JSON", _stamped("dynamo_entry")),
    "hf-startup": ("hf_startup.py's JSON", _hf_startup),
    "seed-workload": ("seed_workload.py's JSON (seed_workload and concurrency rows)", _seed_workload),
    "paged-kernel": ("paged_kernel.py's JSON (its rows replace the key's)", _replace_keys),
    "start-up": ("start_up.py's JSON (the engine's start-up routes, into \"startup\")", _start_up),
}


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--junit", nargs="+", help="pytest JUnit XML files (summed)")
    parser.add_argument("--tests-selection", help="with --junit: which tests ran, when not all (pytest's -m/-k)")
    parser.add_argument(
        "--tests-collected",
        type=int,
        help="with --junit: how many tests were meant to run; those without a result (a shard "
        "cut by its timeout) are recorded as not_run, and the part fails",
    )
    for option, (what, _) in PARTS.items():
        parser.add_argument(f"--{option}", help=what)
    parser.add_argument("--out", required=True)
    parser.add_argument("--previous", default=str(ROOT / "benchmarks/results/h200.json"))
    return parser.parse_args()


def _tests(result: dict, args, digest: str) -> None:
    selection = {"selection": args.tests_selection} if args.tests_selection else {}
    result["tests"] = {**pytest_summary(args.junit), **selection, "code_hash": digest}
    if args.tests_collected is not None:
        ran = sum(result["tests"][k] for k in ("passed", "failed", "skipped"))
        result["tests"]["not_run"] = max(0, args.tests_collected - ran)


def main() -> None:
    args = _arguments()
    prev = pathlib.Path(args.previous)
    result = json.loads(prev.read_text()) if prev.exists() else {}
    digest = code_hash()
    file_hash = result.get("code_hash")
    if torch.cuda.is_available():  # merging elsewhere must not relabel the device's results
        gpu = torch.cuda.get_device_name()
        if result.get("gpu", gpu) != gpu:
            raise SystemExit(
                f"record.py: {prev} holds results of {result['gpu']}, this run is on {gpu}; "
                f"pass --previous benchmarks/results/{gpu_slug(gpu)}.json"
            )
        result.update({"torch": torch.__version__, "gpu": gpu})
    given = (("tests", args.junit), ("suite", args.suite), ("host", args.host))
    drop_stale_notes(result, digest, {part for part, path in given if path})
    if args.junit:
        _tests(result, args, digest)
    for option, (_, merge) in PARTS.items():
        path = getattr(args, option.replace("-", "_"))
        if path:
            merge(result, json.loads(pathlib.Path(path).read_text()), digest, file_hash)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "decode"}, indent=1))


if __name__ == "__main__":
    main()
