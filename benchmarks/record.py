"""Merge a device run into benchmarks/results/h200.json, stamped with the code hash.

    python benchmarks/record.py --junit pytest.xml --decode decode.json --capture capture.json --out h200.json

The code hash follows ../shared/tools/code_hash.py's definition (sha256 over the package's .py
files in sorted path order: path, NUL, bytes, NUL), recomputed here because shared/ does not travel
to the GPU machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import xml.etree.ElementTree as ET

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def code_hash(root: pathlib.Path = ROOT) -> str:
    h = hashlib.sha256()
    for rel in sorted(p.relative_to(root).as_posix() for p in (root / "piecewise_backend").rglob("*.py")):
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()


def pytest_summary(junit_path: str) -> dict:
    suites = ET.parse(junit_path).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    tests, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return {"passed": tests - failures - errors - skipped, "failed": failures + errors, "skipped": skipped}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--junit")
    parser.add_argument("--decode")
    parser.add_argument("--capture")
    parser.add_argument("--out", required=True)
    parser.add_argument("--previous", default=str(ROOT / "benchmarks/results/h200.json"))
    args = parser.parse_args()
    prev = pathlib.Path(args.previous)
    result = json.loads(prev.read_text()) if prev.exists() else {}
    digest = code_hash()
    result.update({"torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None})
    if args.junit:
        result["tests"] = {**pytest_summary(args.junit), "code_hash": digest}
    if args.decode:
        result.update(json.loads(pathlib.Path(args.decode).read_text()))
        result["code_hash"] = digest
    if args.capture:
        capture = json.loads(pathlib.Path(args.capture).read_text())
        for key in ("capture", "memory"):
            result[key] = {**capture[key], "code_hash": digest}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "decode"}, indent=1))


if __name__ == "__main__":
    main()
