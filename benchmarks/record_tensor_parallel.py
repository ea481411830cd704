"""Record a two-GPU run in benchmarks/results/h200x2_tensor_parallel.json, stamped with the code hash.

    python -m benchmarks.record_tensor_parallel [--junit tp_pytest.xml] [--hf tp_bf16.json] \\
        --previous benchmarks/results/h200x2_tensor_parallel.json --out h200x2_tensor_parallel.json

``"pytest"``: tests/test_tensor_parallel.py (the two-GPU test with the gloo ones); ``"hf"``:
``hf_tensor_parallel.py``'s rows. A part replaces its key; keys of another code hash are dropped, so
the file never mixes runs of different code.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

from benchmarks.record import code_hash, pytest_summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", help="pytest's JUnit XML of tests/test_tensor_parallel.py")
    parser.add_argument("--hf", help="hf_tensor_parallel.py's JSON")
    parser.add_argument("--previous", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    digest = code_hash()
    previous = pathlib.Path(args.previous)
    result = json.loads(previous.read_text()) if previous.exists() else {}
    if result.get("code_hash") != digest:
        result = {}
    result.update(
        code_hash=digest,
        torch=torch.__version__,
        gpu=f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "cpu",
    )
    if args.junit:
        result["pytest"] = {
            **pytest_summary([args.junit]),
            "command": "python -m pytest -q tests/test_tensor_parallel.py",
        }
    if args.hf:
        hf = json.loads(pathlib.Path(args.hf).read_text())
        result["hf"] = [{**row, "code_hash": digest} for row in hf["hf"]]
        result["hf_versions"] = {k: hf[k] for k in ("torch", "transformers")}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "hf"}, indent=1))


if __name__ == "__main__":
    main()
