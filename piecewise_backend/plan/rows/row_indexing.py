"""The indexing rules of the row-independence proof: reads and writes through ``[...]``.

Indexing is where rows meet capacities: ``x[:, 1:]`` on a batched tensor keeps rows apart, but
``cache[:B]`` makes a batched view of a tensor that has no batch dim, so the padded batch reads
``cache``'s rows up to the padded size; that is a row *capacity*, not a refusal
(``row_independence.py`` explains both).
"""

from __future__ import annotations

import abc
import operator

import sympy
import torch
import torch.fx

from ..._torch_internals import sym_expr
from ...fx import graph_facts as facts
from .row_ops import Refused, base, norm_dim, op_name


class IndexingRules(abc.ABC):
    """The indexing half of the proof, a base of ``row_independence._Analysis``, which supplies the
    two facts it needs of the whole proof (abstract here, so a class that lacks one cannot be made)."""

    @abc.abstractmethod
    def capacity(self, tensor: torch.fx.Node, dim: int, why: str) -> None:
        """Record that a padded batch reads or writes ``tensor``'s rows along ``dim`` (a capacity)."""

    @abc.abstractmethod
    def is_batch_size(self, value) -> bool:
        """Whether ``value`` (an int, a SymInt, a node) is the batch size itself."""

    def indexed(self, node, first, first_value, batched, where: str) -> None:
        """``x[index]``: every entry that meets the batch dim must take all of it."""
        index = node.args[1]
        entries = index if isinstance(index, tuple) else (index,)
        if first not in batched:
            return self.rows_taken(node, where)
        if any(e in batched for e in entries if isinstance(e, torch.fx.Node)):
            raise Refused(f"{where} indexes with a batched index tensor")
        batch_dim, _ = batched[first]
        for dim, entry in self.index_dims(entries, first_value.dim(), where):
            if dim != batch_dim:
                continue
            if not (
                isinstance(entry, slice)
                and entry.start in (None, 0)
                and entry.step in (None, 1)
                and (entry.stop is None or self.same_size(entry.stop, first_value.shape[dim]))
            ):
                raise Refused(f"{where} takes part of the batch dim ({entry!r})")

    def same_size(self, stop, size) -> bool:
        value = facts.example_value(stop) if isinstance(stop, torch.fx.Node) else stop
        if isinstance(value, torch.SymInt) and isinstance(size, torch.SymInt):
            return sympy.simplify(sym_expr(value) - sym_expr(size)) == 0
        return False

    def index_dims(self, entries, ndim: int, where: str):
        """(input dim, entry) for every entry of an index that consumes a dim."""
        consuming = [e for e in entries if e is not None and e is not Ellipsis]
        widths = []
        for e in consuming:
            value = facts.example_value(e) if isinstance(e, torch.fx.Node) else None
            widths.append(value.dim() if isinstance(value, torch.Tensor) and value.dtype == torch.bool else 1)
        dim, out = 0, []
        for e in entries:
            if e is None:
                continue
            if e is Ellipsis:
                dim += ndim - sum(widths)
                continue
            value = facts.example_value(e) if isinstance(e, torch.fx.Node) else None
            width = value.dim() if isinstance(value, torch.Tensor) and value.dtype == torch.bool else 1
            for k in range(width):
                out.append((dim + k, e))
            dim += width
        return out

    def rows_taken(self, node, where: str) -> None:
        """An un-batched tensor made batched by indexing: ``cache[:B]``, ``narrow(d, 0, B)``."""
        source, value = node.args[0], facts.example_value(node.args[0])
        if node.target is operator.getitem or node.target == "__getitem__":
            entries = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            if any(isinstance(facts.example_value(e), torch.Tensor) for e in entries if isinstance(e, torch.fx.Node)):
                raise Refused(f"{where} gathers rows by an index tensor")
            for dim, entry in self.index_dims(entries, value.dim(), where):
                if isinstance(entry, slice) and self.is_batch_size(entry.stop):
                    if entry.start not in (None, 0) or entry.step not in (None, 1):
                        raise Refused(f"{where} takes batch rows at an offset ({entry!r})")
                    self.capacity(source, dim, where)
                    return
        elif base(op_name(node) or "") == "narrow":
            dim, start, length = (list(node.args[1:4]) + [None] * 3)[:3]
            if start in (0,) and self.is_batch_size(length):
                self.capacity(source, norm_dim(dim, value.dim()), where)
                return
        raise Refused(f"{where} makes a batch dim out of a tensor that has none")

    def rows_written(self, node, where: str) -> None:
        """``buf[:B] = value`` on a tensor without the batch dim: writes its rows up to the padded size."""
        target, index, _ = node.args
        entries = index if isinstance(index, tuple) else (index,)
        for dim, entry in self.index_dims(entries, facts.example_value(target).dim(), where):
            if isinstance(entry, slice) and self.is_batch_size(entry.stop):
                self.capacity(target, dim, where)

    def set_rows(self, node, batched, where: str) -> None:
        target, index, value = node.args
        target_value = facts.example_value(target)
        entries = index if isinstance(index, tuple) else (index,)
        if any(isinstance(e, torch.fx.Node) and e in batched for e in entries):
            raise Refused(f"{where} writes through a batched index tensor")
        if target not in batched:
            raise Refused(f"{where} writes batch rows into a tensor that has no batch dim")
        batch_dim = batched[target][0]
        kept_before = 0  # the view's dims before the batch dim: its batch dim from the right
        indexed = self.index_dims(entries, target_value.dim(), where)
        index_tensor = self.row_local_index_tensor(indexed, batch_dim, where)
        for dim, entry in indexed:
            if entry is index_tensor:
                continue
            if dim == batch_dim and not (isinstance(entry, slice) and entry == slice(None)):
                raise Refused(f"{where} writes part of the batch dim ({entry!r})")
            if dim < batch_dim and isinstance(entry, slice):
                kept_before += 1
        kept_before += sum(1 for e in entries if e is None)  # conservative: Nones only add leading dims
        if value in batched:
            view_ndim = (
                target_value.dim()
                - sum(1 for _, e in indexed if not isinstance(e, slice))
                + sum(1 for e in entries if e is None)
                + (facts.example_value(index_tensor).dim() if index_tensor is not None else 0)
            )
            if view_ndim - kept_before != facts.example_value(value).dim() - batched[value][0]:
                raise Refused(f"{where}: the written value's batch dim does not line up with the target's")

    @staticmethod
    def row_local_index_tensor(indexed: list, batch_dim: int, where: str):
        """The index tensor of ``x[:, :, idx] = v``, if the write keeps rows apart; else refuses.

        Why it may: an index tensor that is not batched (checked before) picks the same positions
        in every row, so row ``b`` of ``v`` lands in row ``b`` of ``x`` (transformers' sliding-window
        cache writes ``new_keys[:, :, index] = key_states`` this way). Only one integer tensor,
        on a dim after the batch dim: with one advanced index torch keeps its dims in place, so
        the batch dim stays where it was; two would broadcast together and may move to the front.
        """
        tensors = [
            (dim, e)
            for dim, e in indexed
            if isinstance(e, torch.fx.Node) and isinstance(facts.example_value(e), torch.Tensor)
        ]
        if not tensors:
            return None
        (dim, entry), *more = tensors
        value = facts.example_value(entry)
        if more or value.dtype == torch.bool or value.is_floating_point() or dim <= batch_dim:
            raise Refused(
                f"{where} writes through an index tensor (one integer index tensor after the batch "
                f"dim keeps rows apart; this one is not that)"
            )
        return entry
