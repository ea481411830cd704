"""The package's own Triton kernels travel in a saved artifact: a fresh process compiles none of them.

Inductor's kernels travel inside its saved code (torch bundles their binaries with it). The kernels
this package launches itself (``ops/``: the paged decode attention and its merge, the KV-cache
write, the graph attention) are compiled by Triton at their first launch in a process, and nothing
of torch's saves them: a warm start in a fresh container (empty Triton cache) would compile each
again, a second or more each, before its first decode step.

So every launch site hands the kernel it launched to :func:`note` (a dictionary lookup; a new
kernel is a compile, rare). A saved or loaded function (``warm_start.py``) writes the binaries of
every kernel noted so far into its artifact file, and again after a call that noted more (a decode
step's kernel compiles at the first decode, after ``save`` returned). Loading puts them back into
Triton's cache folder before anything runs, where Triton finds them as if it had compiled them: its
cache key covers the Triton version, the GPU and the kernel's specialisation, so a kernel built for
another GPU or Triton is simply not found, and compiled as without the artifact.

Triton's compiled C helpers go with them (:func:`helper_modules`): the driver's utilities and a
launcher per kernel signature, each built with the host's C compiler at first use (a fraction of a
second each) and kept in the same cache folder, keyed by their source and the platform.
"""

from __future__ import annotations

import json
import os
import threading

_NOTED: dict[str, object] = {}  # Triton's cache key -> the compiled kernel
_LOCK = threading.Lock()


def note(kernel) -> None:
    """Remember a kernel the package launched (what ``JITFunction[grid](...)`` returned; None in
    Triton's interpreter, which compiles nothing)."""
    key = getattr(kernel, "hash", None)
    if key is None or key in _NOTED:
        return
    with _LOCK:
        _NOTED.setdefault(key, kernel)


def noted() -> int:
    """How many kernels have been noted in this process (an artifact written at a lower count is behind)."""
    return len(_NOTED)


def collect() -> list[dict]:
    """The files of every noted kernel: ``{"hash", "group", "files": {name: bytes}}`` each. A kernel
    whose files are gone from Triton's cache (cleaned while the process ran) is left out."""
    out = []
    for key, kernel in list(_NOTED.items()):
        paths = dict(getattr(kernel, "metadata_group", None) or {})
        group = next((name for name in paths if name.endswith(".json")), None)
        try:
            files = {name: open(path, "rb").read() for name, path in paths.items()}
        except OSError:
            continue
        if group is not None:
            out.append({"hash": key, "group": group, "files": files})
    return out


HELPER_PREFIXES = ("cuda_utils", "hip_utils", "__triton_launcher")  # Triton 3.x's names for them
MAX_HELPERS = 64  # the newest ones, where a long-lived cache holds more


def cache_folder() -> str:
    """Triton's cache folder in this process (where it would be, where Triton is older or absent)."""
    try:
        from triton import knobs  # Triton 3.3+

        return knobs.cache.dir
    except (ImportError, AttributeError):
        return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def helper_modules() -> list[dict]:
    """Triton's compiled C helpers in its cache folder (``{"dir", "name", "data"}`` each): which
    launchers this process's kernels use is not told, so all of them, the newest first, at most
    :data:`MAX_HELPERS` (tens of kilobytes each)."""
    folder = cache_folder()
    if not os.path.isdir(folder):
        return []
    found = []
    for entry in os.scandir(folder):
        if entry.is_dir():
            for file in os.scandir(entry.path):
                if file.name.startswith(HELPER_PREFIXES) and file.name.endswith(".so"):
                    found.append((file.stat().st_mtime, entry.name, file.name, file.path))
    out = []
    for _, folder_name, name, path in sorted(found, reverse=True)[:MAX_HELPERS]:
        try:
            out.append({"dir": folder_name, "name": name, "data": open(path, "rb").read()})
        except OSError:
            continue
    return out


def emit_helpers(helpers: list[dict]) -> int:
    """Put saved C helpers into this process's Triton cache folder (those there are left); how many."""
    folder = cache_folder()
    written = 0
    for helper in helpers:
        target = os.path.join(folder, helper["dir"], helper["name"])
        if os.path.exists(target):
            continue
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = f"{target}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(helper["data"])
            os.replace(tmp, target)  # a process reading it meanwhile finds it whole or not at all
        except OSError:
            continue
        written += 1
    return written


def emit(kernels: list[dict]) -> int:
    """Put saved kernels into this process's Triton cache (where its own compiles would have put them);
    returns how many were written (those already there are left). No Triton: none."""
    if not kernels:
        return 0
    try:
        from triton.runtime.cache import get_cache_manager
    except ImportError:
        return 0
    written = 0
    for kernel in kernels:
        try:
            manager = get_cache_manager(kernel["hash"])  # the same folder Triton's compile of it would use
            if manager.get_group(kernel["group"]):
                continue
            paths = {name: manager.put(data, name, binary=True) for name, data in kernel["files"].items()}
            # the group file Triton reads a cached kernel by (what its compile writes last, through put_group)
            manager.put(json.dumps({"child_paths": paths}), f"__grp__{kernel['group']}", binary=False)
        except (OSError, RuntimeError):  # a cache folder that cannot be written: Triton compiles, as without
            continue
        written += 1
    return written


def hashes() -> set[str]:
    """The cache keys of the kernels noted so far."""
    return set(_NOTED)
