"""The memory a captured graph reads and writes: buffers it owns, and weak aliases of pool memory.

Shared by the two kinds of graph (a compute piece's, ``piece_runner.py``; a whole call's,
``full_graph.py``). A graph's inputs that are not used in place are copied into buffers it owns,
laid out as the compiled code expects; its outputs live in the shared graph pool and are kept only
as non-owning aliases, so that once the call that captured them ends, the next capture can reuse
that memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import _torch_internals
from .symbolic import strides_at


def weak_alias(t: torch.Tensor, size=None) -> torch.Tensor:
    """A weak alias of pool memory on CUDA; a plain view when emulating on CPU. ``size``: the shape of
    the padded tensor ``t`` is the first rows of (same strides and offset)."""
    if t.is_cuda:
        return _torch_internals.non_owning_alias(t, size)
    return t.as_strided(size if size is not None else t.shape, t.stride(), t.storage_offset())


def fits_in_storage(t: torch.Tensor, size) -> bool:
    """Would ``t`` with shape ``size`` (same strides and offset) stay inside its storage?"""
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(size, t.stride()) if n > 0)
    return last < t.untyped_storage().nbytes() // t.element_size()


class InputArenas:
    """One buffer per copied input of a graph, shared by all its shape keys: a key reads its input
    from the start of it, laid out as the compiled code expects for that key.

    Why: copied inputs (user inputs, attention outputs) used to get a buffer per input per key, so
    their memory grew with the sum of the captured sizes, outside the graph pool and uncounted.
    One call of a graph runs at a time (its call
    guard), and every replay first copies its inputs into these buffers, so keys can share them:
    the memory is that of the largest key captured (largest first, as ``capture()`` goes) plus,
    when captures come in growing sizes, the smaller buffers that earlier keys' graphs still read.

    The buffers are made outside inference mode whatever mode the call is in: a server warms up
    under ``torch.inference_mode()`` and then captures up front (``capture()``) or serves under
    ``no_grad``, and an inference tensor refuses those in-place copies (every capture then failed
    and retired its pool).
    """

    def __init__(self):
        self._current: dict = {}  # input index -> the 1-D buffer new keys read from
        self._all: list = []  # every buffer handed out while graphs may read it

    def take(self, index: int, shape, strides, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(n > 0 for n in shape) else 1
        base = self._current.get(index)
        if base is None or base.dtype != dtype or base.device != device or base.numel() < extent:
            with torch.inference_mode(False):  # a normal tensor: any later call may copy into it
                # zeros: a capture behind copies nothing in, and a padded row must hold valid indices
                base = self._current[index] = torch.zeros(extent, dtype=dtype, device=device)
            self._all.append(base)
        return base.as_strided(tuple(shape), tuple(strides))

    def nbytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self._all)

    def clear(self) -> None:
        """Forget every buffer (call only once no captured graph reads them)."""
        self._current.clear()
        self._all.clear()


def owned_copy(
    arg: torch.Tensor,
    spec,
    sym_values: dict,
    size: list,
    dim: int | None,
    arenas: InputArenas,
    index: int,
    fill: bool = True,
) -> torch.Tensor:
    """A buffer holding ``arg`` (in its first rows along ``dim`` when padded to ``size``), from
    ``arenas`` (input ``index``).

    Strides are the ones the compiled code expects (``spec``'s, at the key's symbol values); the
    storage offset is dropped: compiled code reads through the data pointer. Padded rows start as
    zeros: an index tensor's padded rows must hold valid indices. ``fill=False`` (a capture behind:
    ``arg`` is a made-up stand-in) writes nothing: the buffer may be the one a replay of another key
    is reading, and what it holds (zeros, or a real call's rows) is valid either way.
    """
    strides = strides_at(spec, sym_values)
    if dim is None:
        buf = arenas.take(index, arg.shape, strides or arg.stride(), arg.dtype, arg.device)
        if fill:
            buf.copy_(arg)
        return buf
    if strides is None:
        raise ValueError(f"no strides for a padded input at {sym_values}")
    buf = arenas.take(index, size, strides, arg.dtype, arg.device)
    if not fill:
        return buf
    buf.zero_()
    buf.narrow(dim, 0, arg.shape[dim]).copy_(arg)
    return buf


def narrowed(outputs, dims: tuple, size: int):
    """Outputs (a tuple, or one) cut to the caller's ``size`` rows along each one's padded dim (None: whole)."""
    flat = outputs if isinstance(outputs, tuple) else (outputs,)
    cut = tuple(o.narrow(dims[j], 0, size) if dims[j] is not None else o for j, o in enumerate(flat))
    return cut if isinstance(outputs, tuple) else cut[0]


def written_snapshot(args, indices) -> Callable[[], None] | None:
    """What puts the args at ``indices`` back as they are now (None: no index). For written args
    whose writes are not idempotent (full mode's ``buf.mul_(...)``, an accumulator): a run that
    must not count (a warm-up; compiled code that raised halfway, before the traced code runs
    instead) is undone, so the call changes them once."""
    if not indices:
        return None
    saved = [(args[i], args[i].clone()) for i in sorted(indices)]

    def restore() -> None:
        for tensor, copy in saved:
            tensor.copy_(copy)

    return restore
