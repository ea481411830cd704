"""``python -m benchmarks``: the suites a user of the backend would run, and the results they leave.

python -m benchmarks --list                  # the suites, one line each
python -m benchmarks SUITE [--smoke] [--out rows.jsonl] [--variants a,b] [suite options]
python -m benchmarks SUITE --help            # the suite's variants and options
python -m benchmarks record rows.jsonl...    # merge a run's rows into results/<gpu>.json
python -m benchmarks report [--check]        # the README tables and figures from the results files
"""

from __future__ import annotations

import importlib
import sys

#: suite name -> the module holding its ``SUITE``, in the order ``--list`` shows them.
SUITES = {
    "decode": "benchmarks.decode",
    "serving": "benchmarks.serving",
    "hf": "benchmarks.hf",
    "startup": "benchmarks.start_up",
    "kernels": "benchmarks.kernels",
    "reliability": "benchmarks.reliability",
    "tensor-parallel": "benchmarks.tensor_parallel",
}


def suite(name: str):
    if name not in SUITES:
        raise SystemExit(f"no suite {name!r}; python -m benchmarks --list names them ({', '.join(SUITES)})")
    return importlib.import_module(SUITES[name]).SUITE


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    command, rest = argv[0], argv[1:]
    if command == "--list":
        width = max(map(len, SUITES))
        for name in SUITES:
            s = suite(name)
            print(f"{name:{width}}  {s.about} (variants: {', '.join(s.variants)})")
    elif command == "record":
        from benchmarks.harness import read_rows, record

        for path in record(read_rows(rest)):
            print(f"recorded -> {path}")
    elif command == "report":
        from benchmarks import report

        report.main(rest)
    else:
        from benchmarks.harness import run_suite

        run_suite(suite(command), rest)


if __name__ == "__main__":
    main(sys.argv[1:])
