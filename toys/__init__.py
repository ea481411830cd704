"""Toy models for the tests and benchmarks of piecewise_backend (not part of the installed package).

``toys.models``: small Llama/GPT-style decoders written in the project's own idiom, with KV
caches, a custom attention op and a static-cache variant. ``toys.parallel``: a tensor-parallel
shard of the toy Llama (``torchrun --nproc-per-node 2 -m toys.parallel``). Import them from the
repository's root (pytest does; the benchmarks put the root on ``sys.path``).
"""
