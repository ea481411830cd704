"""Pickled values over a pipe, one after another: each a length, then its bytes.

The compile worker (``compile_worker.py``) stays up for every graph a process builds, so its jobs
and results need a boundary; a closed pipe reads as ``EOFError``.
"""

from __future__ import annotations

import pickle
import struct

_LENGTH = struct.Struct("<Q")


def write_frame(stream, value) -> None:
    data = pickle.dumps(value)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def read_frame(stream):
    data = _read_exactly(stream, _LENGTH.size)
    return pickle.loads(_read_exactly(stream, _LENGTH.unpack(data)[0]))


def _read_exactly(stream, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError("the other end of the pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
