"""Count the Triton kernels a process compiles (not those it finds compiled in Triton's cache).

Triton calls its cache manager's ``put_group`` once per kernel it compiles, never on a cache hit;
Inductor's kernels restored from a saved graph are written into the cache folder directly. A
manager class named in ``$TRITON_CACHE_MANAGER`` is used by every process that inherits the
environment, Inductor's compile workers included, so ``counted_env`` counts theirs too.
"""

from __future__ import annotations

import collections
import os

LOG = "PIECEWISE_TRITON_COMPILE_LOG"

try:  # Triton imports this module itself, by the name in $TRITON_CACHE_MANAGER (no Triton: nothing to count)
    from triton.runtime.cache import FileCacheManager

    class CountingCacheManager(FileCacheManager):
        """Triton's file cache, that appends a line to ``$PIECEWISE_TRITON_COMPILE_LOG`` per compile."""

        def put_group(self, filename: str, group: dict) -> str:
            path = os.environ.get(LOG)
            if path:
                with open(path, "a") as log:
                    log.write(filename.rsplit(".", 1)[0] + "\n")  # the kernel's name
            return super().put_group(filename, group)

except ImportError:
    pass


def counted_env(log: str) -> dict:
    """Environment entries that make a child process (and its workers) log each Triton compile to ``log``."""
    return {"TRITON_CACHE_MANAGER": f"{__name__}:CountingCacheManager", LOG: log}


def compiled(log: str) -> dict:
    """Kernel name -> times compiled, from ``log``."""
    if not os.path.exists(log):
        return {}
    with open(log) as f:
        return dict(collections.Counter(line.strip() for line in f if line.strip()))
