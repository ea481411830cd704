"""Split a Dynamo graph into compute pieces (compiled, CUDA-graphed) and split pieces (eager).

Every node gets one of three kinds:

* ``split``: a splitting op (attention), named in the options or tagged ``torch.Tag.cudagraph_unsafe``
  where it was defined. Each gets a piece of its own.
* ``eager``: must not be inside a captured graph: it mutates a graph input (the KV-cache write),
  or it needs a per-step scalar such as the KV position ``pos`` (cache slices, ``cos[pos:pos+S]``),
  or a size the data decides (``h[:, :n.item()]``). Graphing those would write the wrong buffer,
  recapture at every decode step, or replay the size of the capture.
* ``compute``: everything else.

Then two reorderings keep compute pieces whole (one per layer, not two or three):

* *hoist*: eager nodes that only read graph inputs and feed compute (``cos[pos:pos+S]``, ``pos+S``)
  move to the top of the graph, into one eager prologue. Only pure nodes move, and only views or
  reads of memory nothing in the graph writes, so moving them cannot change a value.
* *sink*: other eager nodes (the cache write, the cache slices) move down to sit just before the
  next split op, past compute nodes that neither use them nor touch the memory they touch. They
  join that op's piece, which is where vLLM puts them too (inside its attention op).

Finally contiguous runs of one kind become partitions and ``torch.fx.passes.split_module`` builds the
split graph, keeping original order (it matters when the graph mutates tensors).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from .. import _torch_internals
from ..fx import graph_facts as facts
from ..kinds import PieceKind, PieceSpec
from ..op_names import canonical_op_name, display_name, is_cudagraph_unsafe
from .attention_placement import beside_attention, is_fixed_shape_attention
from .graph_cleanup import drop_dead_values, drop_unused_scalar_inputs
from .in_place_writes import graph_safe_writes, only_whole_writes
from .piece_boundaries import keep_containers_in_their_piece
from .reordering import hoist, sink

COMPUTE, SPLIT, EAGER = PieceKind.COMPUTE, PieceKind.SPLIT, PieceKind.EAGER


@dataclasses.dataclass
class SplitGraph:
    graph_module: torch.fx.GraphModule
    pieces: list[PieceSpec]
    step_symbols: frozenset
    compute_nodes: tuple = ()  # nodes of the original graph that run in compute pieces
    written_inputs: frozenset = frozenset()  # names of graph inputs some node writes in place
    whole_writes: frozenset = frozenset()  # inputs written only whole, by captured writes (in_place_writes.py)
    unsafe_ops: tuple = ()  # ops split at because they are tagged cudagraph_unsafe (not named), once each

    def piece(self, name: str) -> PieceSpec:
        return next(p for p in self.pieces if p.name == name)

    @property
    def compute_names(self) -> frozenset:
        """The names of the compute pieces (compiled, graphed)."""
        return frozenset(p.name for p in self.pieces if p.kind == COMPUTE)


def _classify(
    graph: torch.fx.Graph,
    splitting_ops: frozenset[str],
    steps: frozenset,
    forced_eager: dict,
    writable: frozenset,
    fixed_attention: bool,
    safe_writes: dict,
    data_dependent: frozenset = frozenset(),
) -> tuple[dict, dict]:
    """Kind of every op node, and a reason string for each eager one (``attention_placement.py`` says
    which attention stays in a graph, ``fixed_attention``, and which nodes depend on a KV length and
    so run beside the eager attention, ``beside_attention``)."""
    roots = facts.alias_roots(graph)
    input_roots = {n for n in graph.nodes if n.op == "placeholder" and n.name not in writable}
    kinds: dict = {}
    reasons: dict = dict(forced_eager)
    attention: set = set()  # splitting ops, split or (fixed-shape attention) kept in their piece
    for node in graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.op == "call_function" and is_cudagraph_unsafe(node.target):
            kinds[node] = SPLIT  # never captured, whatever the mode: its author said so
            attention.add(node)
            continue
        if node.op == "call_function" and canonical_op_name(node.target) in splitting_ops:
            attention.add(node)
            if not (fixed_attention and is_fixed_shape_attention(node)):
                kinds[node] = SPLIT
                continue
        written = [roots[m] for m in facts.mutated_inputs(node)]
        if node not in safe_writes and any(r in input_roots for r in written):
            reasons[node] = (
                f"{display_name(node)}: writes graph input {next(r for r in written if r in input_roots).name}"
            )
        elif facts.uses_symbols(node, steps):
            syms = ", ".join(sorted(map(str, steps)))
            reasons[node] = f"{display_name(node)}: depends on per-step scalar {syms}"
        elif facts.uses_symbols(node, data_dependent):
            syms = ", ".join(sorted(map(str, data_dependent)))
            reasons[node] = (
                f"{display_name(node)}: a size the data decides ({syms}): a graph would replay its capture's"
            )
        kinds[node] = EAGER if node in reasons else COMPUTE
    # fixed-shape attention counts too: its mask may be built from an input that grows every step
    # (transformers 5.17's sliding window gathers a full window from the [B, past + 1] attention_mask)
    growth = beside_attention(graph, lambda n: kinds.get(n) == COMPUTE, attention.__contains__)
    kinds.update(dict.fromkeys(growth, EAGER))
    reasons.update(growth)
    _views_feeding_eager(graph, kinds, reasons, roots, input_roots)
    return kinds, reasons


def _views_feeding_eager(graph: torch.fx.Graph, kinds: dict, reasons: dict, roots: dict, input_roots: set) -> None:
    """Views of graph inputs and scalar ops that only feed eager nodes run eagerly too: a captured
    view of an input would alias the runner's copy of it, not the caller's tensor. So do views of
    graph inputs the graph returns: eager (and Inductor) hand back a view of the caller's tensor,
    through which writes reach it; a captured one would be a copy."""
    output = next(n for n in graph.nodes if n.op == "output")
    for node in reversed(list(graph.nodes)):
        if kinds.get(node) != COMPUTE or not node.users:
            continue
        views_input = roots[node].op == "placeholder" and roots[node] is not node
        if views_input and output in node.users:
            kinds[node] = EAGER
            reasons[node] = (
                f"{display_name(node)}: a view of graph input {roots[node].name} that is returned "
                f"(kept a view of the caller's tensor, as in eager)"
            )
            continue
        feeds_eager_only = all(kinds.get(u) in (EAGER, SPLIT) or u is output and views_input for u in node.users)
        if feeds_eager_only and (
            facts.is_sym_node(node) or views_input and (roots[node] in input_roots or output in _returned(node))
        ):
            kinds[node] = EAGER
            reasons[node] = f"{display_name(node)}: view/scalar feeding eager ops only"


def _returned(node: torch.fx.Node) -> set:
    """The users of ``node`` that are the output node, directly or through chains of its users."""
    seen, todo, out = set(), [node], set()
    while todo:
        for user in todo.pop().users:
            if user.op == "output":
                out.add(user)
            elif user not in seen:
                seen.add(user)
                todo.append(user)
    return out


def _partition(graph: torch.fx.Graph, kinds: dict) -> dict:
    """Contiguous runs of compute nodes, one partition per split op (with the eager run before it)."""
    part: dict = {}
    pid, prev = -1, None
    for node in graph.nodes:
        kind = kinds.get(node)
        if kind is None:
            continue
        if kind == COMPUTE:
            starts_new = prev != COMPUTE
        else:  # eager nodes join the split op that follows them; each split op ends its piece
            starts_new = prev in (None, COMPUTE, SPLIT)
        pid += starts_new
        part[node] = pid
        prev = kind
    return part


def _cross_partition_writes(
    graph: torch.fx.Graph, kinds: dict, part: dict, writable: frozenset, safe_writes: dict
) -> dict:
    """Compute nodes that write memory owned by another partition: they must run eagerly."""
    roots = facts.alias_roots(graph)
    bad = {}
    for node in graph.nodes:
        if kinds.get(node) != COMPUTE:
            continue
        for m in facts.mutated_inputs(node):
            owner = roots[m]
            if (
                owner.op == "placeholder"
                and (owner.name in writable or node in safe_writes)
                and (m is owner or part.get(m) == part[node])
            ):
                continue  # a fixed-address buffer, passed in place: the captured graph writes the caller's tensor
            if part.get(owner) != part[node]:
                bad[node] = f"{display_name(node)}: writes {owner.name}, which another piece owns"
    return bad


NO_DEVICE_WORK = "no device work (views of its inputs, scalars, host tensors): nothing to capture, run as it is"


def _no_device_work(group: list, roots: dict, on_device: bool) -> bool:
    """Would a capture of these nodes record no kernel? Views of what other pieces made, Python
    scalars, and (in a graph on the GPU) tensors on the host. torch warns "The CUDA Graph is empty"
    for such a capture, and its replay would save nothing."""
    for node in group:
        value = facts.example_value(node)
        values = value if isinstance(value, (tuple, list)) else (value,)
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if facts.mutated_inputs(node):
            return False
        host_only = on_device and all(t.device.type == "cpu" for t in tensors)
        if tensors and roots[node] is node and not host_only:
            return False  # owns new device memory: a kernel made it
    return True


def _partition_until_no_write_crosses(
    graph: torch.fx.Graph,
    splitting_ops: frozenset[str],
    steps: frozenset,
    writable_inputs: frozenset,
    fixed_attention: bool,
    safe_writes: dict,
) -> tuple[dict, dict, dict]:
    """Kinds, eager reasons and partition of every node, with no compute node writing what another
    piece reads: such a node is forced eager and the graph classified again. Each round forces at
    least one more node, so this ends (in practice after one or two rounds); a round that can force
    nothing new is a bug, and says so."""
    data_dependent = facts.data_dependent_symbols(graph)
    forced: dict = {}
    while True:
        kinds, reasons = _classify(
            graph, splitting_ops, steps, forced, writable_inputs, fixed_attention, safe_writes, data_dependent
        )
        for n in forced:
            kinds[n] = EAGER
        hoist(graph, kinds)
        sink(graph, kinds)
        part = _partition(graph, kinds)
        keep_containers_in_their_piece(graph, kinds, part, reasons)
        bad = _cross_partition_writes(graph, kinds, part, writable_inputs, safe_writes)
        if not bad:
            return kinds, reasons, part
        if all(n in forced for n in bad):
            raise RuntimeError(
                f"piecewise: split: {len(bad)} write(s) still cross pieces with their nodes run "
                f"eagerly ({'; '.join(map(str, bad.values()))}). Please report it with the graph "
                f"(piecewise_backend.debug_dump); cudagraphs=False in options avoids it."
            )
        forced.update(bad)


def _piece_specs(graph: torch.fx.Graph, split_gm: torch.fx.GraphModule, part: dict, kinds: dict, reasons: dict):
    """One :class:`PieceSpec` per submodule of the split graph, in order; a compute piece with no
    device work becomes eager (its nodes' kinds and reasons updated)."""
    members: dict[int, list] = {}
    for node, pid in part.items():
        members.setdefault(pid, []).append(node)
    roots = facts.alias_roots(graph)
    on_device = any(getattr(v, "is_cuda", False) for v in map(facts.example_value, facts.placeholders(graph)))
    pieces = []
    for index, node in enumerate(n for n in split_gm.graph.nodes if n.op == "call_module"):
        pid = _torch_internals.split_partition(node)
        group = members[pid]
        split_ops = tuple(display_name(n) for n in group if kinds[n] == SPLIT)
        kind = SPLIT if split_ops else (EAGER if kinds[group[0]] == EAGER else COMPUTE)
        if kind == COMPUTE and _no_device_work(group, roots, on_device):
            kind = EAGER
            kinds.update(dict.fromkeys(group, EAGER))
            reasons.update(dict.fromkeys(group, NO_DEVICE_WORK))
        written = (
            ()
            if kind != COMPUTE
            else tuple(
                dict.fromkeys(
                    roots[m].name for n in group for m in facts.mutated_inputs(n) if roots[m].op == "placeholder"
                )
            )
        )
        pieces.append(
            PieceSpec(
                name=str(node.target),
                index=index,
                kind=kind,
                split_ops=split_ops,
                eager_reasons=tuple(reasons[n] for n in group if n in reasons),
                num_ops=len(group),
                writes_inputs=written,
            )
        )
    return pieces


def split_graph(
    gm: torch.fx.GraphModule,
    splitting_ops: frozenset[str],
    writable_inputs: frozenset = frozenset(),
    fixed_attention: bool = False,
    in_place: frozenset = frozenset(),
) -> SplitGraph:
    """Split ``gm`` (modified in place: nodes are reordered) into ordered pieces.

    ``writable_inputs``: names of graph inputs that compute pieces may write in place (full mode
    passes the parameters/buffers: their addresses are fixed, so a captured write lands in the
    caller's tensor). Writes to any other input run eagerly. ``fixed_attention``: attention whose
    shapes are fixed but for the batch stays in its compute piece. ``in_place``: names of inputs used
    at their own address, which compute pieces may write where ``in_place_writes.py`` says it is safe.
    """
    graph = gm.graph
    drop_dead_values(graph)
    steps = facts.step_symbols(graph)
    safe_writes = graph_safe_writes(graph, in_place, steps)
    kinds, reasons, part = _partition_until_no_write_crosses(
        graph, splitting_ops, steps, writable_inputs, fixed_attention, safe_writes
    )
    graph.lint()

    split_gm = split_module(gm, None, lambda n: part[n], keep_original_order=True)
    compute_pids = {pid for node, pid in part.items() if kinds[node] == COMPUTE}
    drop_unused_scalar_inputs(split_gm, {f"submod_{pid}" for pid in compute_pids}, steps)
    pieces = _piece_specs(graph, split_gm, part, kinds, reasons)
    compute_nodes = tuple(n for n, k in kinds.items() if k == COMPUTE)
    unsafe = tuple(
        dict.fromkeys(
            display_name(n)
            for n, k in kinds.items()
            if k == SPLIT and is_cudagraph_unsafe(n.target) and canonical_op_name(n.target) not in splitting_ops
        )
    )
    return SplitGraph(
        split_gm,
        pieces,
        steps,
        compute_nodes,
        facts.written_inputs(graph),
        only_whole_writes(graph, safe_writes),
        unsafe,
    )
