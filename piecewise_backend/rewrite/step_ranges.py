"""Ranges that start at the step's position (``torch.arange(t, t + S)``), built inside the graph.

Positions for RoPE are often a tensor made from the step's Python int, then used to gather table
rows (``cos[torch.arange(t, t + S)]``). As written the range runs eagerly at every step and its
result is copied into the graph that reads it; rewritten as ``arange(S) + t`` with ``t`` read from
the step scalars, it is computed in the graph, and a decode step in this idiom stays one graph.
Only ``arange(t, t + c)`` with ``t`` a per-step graph input, ``c`` a constant and the default
(int64) dtype is rewritten.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from ..fx import graph_facts as facts
from .graph_edit import Builder, Idiom

UNBOUNDED = (-(2**62), 2**62)  # a range indexes nothing by itself: any position is valid for it


@dataclasses.dataclass(frozen=True)
class RangeSite:
    node: torch.fx.Node  # the arange call
    start: torch.fx.Node  # the per-step graph input it starts at
    length: int


def _length(start: torch.fx.Node, end) -> int | None:
    """``c`` when ``end`` is ``start + c``."""
    if (
        isinstance(end, torch.fx.Node)
        and end.op == "call_function"
        and end.target is operator.add
        and len(end.args) == 2
    ):
        a, b = end.args
        if a is start and isinstance(b, int):
            return b
        if b is start and isinstance(a, int):
            return a
    return None


def find_step_ranges(graph: torch.fx.Graph, steps: frozenset) -> list[RangeSite]:
    placeholders = set(facts.placeholders(graph))
    sites = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.arange or len(node.args) != 2:
            continue
        if set(node.kwargs) - {"device", "dtype"} or node.kwargs.get("dtype") not in (None, torch.int64):
            continue
        start, end = node.args
        if start in placeholders and facts.is_per_step(start, steps):
            length = _length(start, end)
            if length is not None and length >= 0:
                sites.append(RangeSite(node, start, length))
    return sites


def rewrite_step_range(site: RangeSite, scalars: torch.fx.Node, slot_of: dict, fake_mode) -> None:
    add = Builder(site.node.graph, site.node, fake_mode)
    offsets = add("call_function", torch.arange, site.length, **site.node.kwargs)
    start = add("call_function", operator.getitem, scalars, slot_of[site.start])
    site.node.replace_all_uses_with(add("call_function", operator.add, offsets, start))
    site.node.graph.erase_node(site.node)


def _rewrite(site: RangeSite, context) -> dict:
    rewrite_step_range(site, context.scalars, context.slot_of, context.fake_mode)
    return {}


STEP_RANGES = Idiom(
    "step ranges",
    lambda writes, attention: writes or attention,
    lambda graph, static_names, steps: find_step_ranges(graph, steps),
    lambda site, slots: slots.need(site.start, 0, *UNBOUNDED, f"the range from {site.start.name}"),
    _rewrite,
)
