"""A benchmark variant in a child process of its own: the row it printed, or how it failed.

Why a child per variant: a cold start needs a fresh process and fresh Inductor/Triton caches, and a
variant that hangs or crashes must leave the others' rows (each child has its own timeout).
"""

from __future__ import annotations

import json
import os
import subprocess

PREFIX = "ROW "  # the line a child prints its row on (its other output is free)


def report(row: dict) -> None:
    """In the child: hand ``row`` to the parent."""
    print(PREFIX + json.dumps(row), flush=True)


def child_row(cmd: list, timeout: int, caches: str | None = None, env: dict | None = None) -> dict:
    """Run ``cmd``; its last reported row, or ``{"error": ...}`` (its stderr's end, or the timeout).
    ``caches``: a folder for the child's Inductor and Triton caches (a cold start: an empty one);
    ``env``: more environment entries."""
    env = {**os.environ, **(env or {})}
    if caches is not None:
        env.update(TORCHINDUCTOR_CACHE_DIR=f"{caches}/inductor", TRITON_CACHE_DIR=f"{caches}/triton")
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [line[len(PREFIX) :] for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    return json.loads(lines[-1]) if lines else {"error": done.stderr[-600:]}
