"""The memory a captured graph reads and writes: buffers it owns, and weak aliases of pool memory.

Shared by the two kinds of graph (a compute piece's, ``piece_runner.py``; a whole call's,
``full_graph.py``). A graph's inputs that are not used in place are copied into buffers it owns,
laid out as the compiled code expects; its outputs live in the shared graph pool and are kept only
as non-owning aliases, so that once the call that captured them ends, the next capture can reuse
that memory.
"""

from __future__ import annotations

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


def owned_copy(arg: torch.Tensor, spec, sym_values: dict, size: list, dim: int | None) -> torch.Tensor:
    """A buffer holding ``arg`` (in its first rows along ``dim`` when padded to ``size``).

    Strides are the ones the compiled code expects (``spec``'s, at the key's symbol values); the
    storage offset is dropped: compiled code reads through the data pointer. Padded rows start as
    zeros: an index tensor's padded rows must hold valid indices.
    """
    strides = strides_at(spec, sym_values)
    if dim is None:
        buf = torch.empty_strided(arg.shape, strides or arg.stride(), dtype=arg.dtype, device=arg.device)
        buf.copy_(arg)
        return buf
    if strides is None:
        raise ValueError(f"no strides for a padded input at {sym_values}")
    buf = torch.empty_strided(size, strides, dtype=arg.dtype, device=arg.device)
    buf.zero_()
    buf.narrow(dim, 0, arg.shape[dim]).copy_(arg)
    return buf


def narrowed(outputs, dims: tuple, size: int):
    """Outputs (a tuple, or one) cut to the caller's ``size`` rows along each one's padded dim (None: whole)."""
    flat = outputs if isinstance(outputs, tuple) else (outputs,)
    cut = tuple(o.narrow(dims[j], 0, size) if dims[j] is not None else o for j, o in enumerate(flat))
    return cut if isinstance(outputs, tuple) else cut[0]
