"""The file ``save`` writes: the compiled functions torch's AOT route serialised, and the binaries of
the package's own Triton kernels (``ops/kernel_bundle.py``), kept current as the process compiles more.

Why the file changes after ``save`` returned: ``save`` compiles, but the package's kernels compile at
their first launch, the decode step's at the first decode. The function ``save`` or ``load`` returned
checks after each call whether a kernel the file lacks was launched (an int compare when none was)
and rewrites the file with it, atomically (a process reading it meanwhile reads the old one whole).
A file that cannot be written (read-only storage) is warned about once and left as it is.
"""

from __future__ import annotations

import os
import pickle
import threading
import warnings

from ..ops import kernel_bundle

FORMAT = "piecewise-warm-start-1"  # the "kernels" entry is optional: files without one still load


class ArtifactFile:
    """One saved file: its functions' bytes (as serialised), its kernels, and whether it is behind."""

    def __init__(
        self, path: str, functions: list[bytes], kernels: list[dict] | None = None, helpers: list[dict] | None = None
    ):
        self.path, self.functions = path, functions
        self.kernels = {k["hash"]: k for k in kernels or ()}
        self.helpers = {(h["dir"], h["name"]): h for h in helpers or ()}
        self._checked = -1  # kernel_bundle.noted() when the file was last compared with the process's kernels
        self._writable = True
        self._lock = threading.Lock()

    @classmethod
    def read(cls, path: str) -> ArtifactFile:
        with open(path, "rb") as f:
            saved = pickle.load(f)
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise ValueError(f"{path} is not a file piecewise_backend.save wrote (format {FORMAT})")
        return cls(path, saved["functions"], saved.get("kernels"), saved.get("helpers"))

    def write(self) -> None:
        """Write the file whole, with every kernel launched in this process so far."""
        self._checked = kernel_bundle.noted()
        for kernel in kernel_bundle.collect():
            self.kernels.setdefault(kernel["hash"], kernel)
        if self.kernels:  # the C helpers their launches need (none without kernels: no Triton use of ours)
            for helper in kernel_bundle.helper_modules():
                self.helpers.setdefault((helper["dir"], helper["name"]), helper)
        tmp = f"{self.path}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            saved = {"kernels": list(self.kernels.values()), "helpers": list(self.helpers.values())}
            pickle.dump({"format": FORMAT, "functions": self.functions, **saved}, f)
        os.replace(tmp, self.path)

    def emit_kernels(self) -> int:
        """Put the file's kernels (and Triton's C helpers) into this process's Triton cache; how many
        kernels were not there yet."""
        kernel_bundle.emit_helpers(list(self.helpers.values()))
        return kernel_bundle.emit(list(self.kernels.values()))

    def keep_current(self) -> None:
        """After a call: rewrite the file if the process launched a kernel it lacks."""
        if self._checked == kernel_bundle.noted() or not self._writable:
            return
        with self._lock:
            count = kernel_bundle.noted()
            if self._checked == count:
                return
            if not kernel_bundle.hashes() - self.kernels.keys():
                self._checked = count
                return
            try:
                self.write()
            except OSError as exc:
                self._writable = False
                warnings.warn(
                    f"piecewise: cannot add the kernels compiled since to {self.path} ({exc}); a process "
                    f"loading it will compile them itself",
                    stacklevel=3,
                )
