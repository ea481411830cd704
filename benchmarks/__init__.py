"""The benchmarks of piecewise_backend: each module runs as ``python -m benchmarks.<name>`` from the
repository's root (which puts ``toys/`` and this package on ``sys.path``); ``benchmarks/README.md``
holds what they measured.

The small library they share: ``timing`` (clocks and the decode loop), ``child_rows`` (a child process
per heavy variant, its row or its error), ``suite_models``/``suite_variants`` (the toy models and how
each is compiled), ``record`` (results stamped with the package's code hash), ``plot``.
"""
