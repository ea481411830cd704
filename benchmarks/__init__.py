"""The benchmarks of piecewise_backend, as suites: ``python -m benchmarks --list`` from the repository's
root (which puts ``toys/`` and this package on ``sys.path``); ``benchmarks/README.md`` holds what they
measured.

One module per suite (``decode``, ``serving``, ``hf``, ``start_up``, ``kernels``, ``reliability``,
``tensor_parallel``), each with a ``SUITE``; what they share: ``harness`` (a child process per
variant, rows of one schema, the results files), ``report`` (the READMEs' numbers from the results),
``timing`` (clocks, the decode loop, the host's speed), ``decode_variants`` (the decode suite's
models and backends), ``triton_compiles`` (counting Triton's compiles in a process).
"""
