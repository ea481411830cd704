"""What the backend did to a model, for people: pieces as a table, a picture, code, a depyf dump.

    report = piecewise_backend.inspect_split(model, input_ids, 0)[-1]   # compile, run once, look
    report                       # a table in Jupyter (_repr_html_), print(report) in a terminal
    report.piece(3).code         # the FX code of piece 3; .inductor_code: what Inductor made of it
    report.save_png("split.png") # pieces as boxes in order, attention between
    with piecewise_backend.debug_dump("dump/"):  # depyf: Dynamo's bytecode, graphs, Inductor code
        compiled(input_ids, 0)

Everything works without a GPU: on CPU the pieces are compiled and run, just not graphed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import warnings

import torch

from ..kinds import PieceKind
from ..registry import compiled_graphs
from ..runtime.stats import format_table


@dataclasses.dataclass
class PieceInfo:
    """One piece of a split graph, in execution order."""

    index: int
    name: str
    kind: PieceKind  # compute (compiled, graphed), split (holds an attention op) or eager
    num_ops: int
    split_ops: tuple
    why_eager: tuple  # why its nodes run eagerly, one line per node
    inputs: tuple  # described input values, e.g. "bf16[s72, 1, 1024]"
    output: str
    graphed: bool  # a compute piece that gets CUDA graphs (False on CPU, with cudagraphs=False, ...)
    compiled_as: str | None  # compute pieces: the piece whose Inductor compile it shares (itself if first)
    captured: tuple  # shape keys captured for it
    code: str  # the FX code of the piece
    inductor_code: str | None  # the module Inductor generated (compute pieces)

    @property
    def label(self) -> str:
        if self.kind == PieceKind.SPLIT:
            return ", ".join(op.split("::")[-1] for op in self.split_ops)
        return f"{self.kind} ({self.num_ops} ops)"


class SplitReport:
    """The split of one compiled Dynamo graph: a table, a picture, the pieces' code."""

    def __init__(self, graph):
        self.graph = graph
        self.serial = graph.serial
        plan = graph.plan
        self.pieces: list[PieceInfo] = []
        for spec in graph.pieces:
            runner = graph.runners.get(spec.name)
            inputs, output = plan.report.signatures.get(spec.name, ((), ""))
            self.pieces.append(
                PieceInfo(
                    index=spec.index,
                    name=spec.name,
                    kind=spec.kind,
                    num_ops=spec.num_ops,
                    split_ops=spec.split_ops,
                    why_eager=spec.eager_reasons,
                    inputs=inputs,
                    output=output,
                    graphed=runner is not None and graph.graphs_disabled_reason is None,
                    compiled_as=plan.report.compiled_as.get(spec.name),
                    captured=tuple(runner.captures) if runner else (),
                    code=plan.report.code[spec.name],
                    inductor_code=plan.report.inductor_code.get(spec.name),
                )
            )

    # -- access -----------------------------------------------------------------------------------

    def piece(self, key: int | str) -> PieceInfo:
        """A piece by position or by name (``"submod_3"``)."""
        if isinstance(key, int):
            if not -len(self.pieces) <= key < len(self.pieces):
                raise IndexError(
                    f"no piece {key}: graph {self.serial} has {len(self.pieces)} pieces, "
                    f"0 to {len(self.pieces) - 1} (or a name: {self.pieces[0].name!r}, ...)"
                )
            return self.pieces[key]
        for p in self.pieces:
            if p.name == key:
                return p
        raise KeyError(f"no piece {key!r}; pieces are {[p.name for p in self.pieces]}")

    @property
    def inductor_compiles(self) -> dict[str, list[str]]:
        """Each distinct Inductor compile and the pieces that share it."""
        groups: dict[str, list[str]] = {}
        for p in self.pieces:
            if p.compiled_as:
                groups.setdefault(p.compiled_as, []).append(p.name)
        return groups

    def rows(self) -> list[dict]:
        return [
            {
                "#": p.index,
                "piece": p.name,
                "kind": p.kind,
                "ops": p.num_ops,
                "what": p.label if p.kind == PieceKind.SPLIT else (p.why_eager[0] if p.why_eager else ""),
                "inputs": "; ".join(p.inputs),
                "output": p.output,
                "graphed": "yes" if p.graphed else "no" if p.kind == PieceKind.COMPUTE else "",
                "compiled as": p.compiled_as or "",
                "captured": ", ".join(map(str, p.captured)),
            }
            for p in self.pieces
        ]

    @property
    def attention(self) -> list[dict]:
        """Each attention call, in order: its node and how it runs (``graph: ...`` or ``eager: why``)."""
        return [{"node": name, "runs": how} for name, how in self.graph.plan.report.attention]

    def headline(self) -> str:
        s = self.graph.stats
        why = self.graph.graphs_disabled_reason
        graphs = f"CUDA graphs off: {why}" if why else f"CUDA graphs on; padding: {s.padding}"
        return (
            f"graph {self.serial}: {s.num_pieces} pieces ({s.num_compute_pieces} compute, "
            f"{s.num_split_pieces} split/eager), {s.inductor_compiles} Inductor compiles; {graphs}"
        )

    # -- rendering --------------------------------------------------------------------------------

    def __str__(self) -> str:
        # shapes are cut to fit a line; a reason ("what") never is: cut mid-sentence it would mislead
        short = [
            {k: (v if k == "what" or len(str(v)) <= 48 else str(v)[:45] + "...") for k, v in r.items()}
            for r in self.rows()
        ]
        return "\n".join([self.headline(), format_table(short), *self._attention_lines()])

    def _attention_lines(self) -> list[str]:
        """One line per way attention runs here, with how many calls run that way."""
        stats = self.graph.stats
        unsafe = [f"split at ops tagged cudagraph_unsafe: {', '.join(stats.unsafe_ops)}"] if stats.unsafe_ops else []
        return unsafe + [f"attention: {way}" for way in stats.attention_ways()]  # the headline says why graphs are off

    __repr__ = __str__

    def _repr_html_(self) -> str:
        colours = {PieceKind.COMPUTE: "#dbe9ff", PieceKind.SPLIT: "#ffe2c2", PieceKind.EAGER: "#eeeeee"}
        rows = self.rows()
        head = "".join(f"<th style='text-align:left'>{html.escape(k)}</th>" for k in rows[0]) if rows else ""
        body = "".join(
            f"<tr style='background:{colours.get(r['kind'], '#fff')}'>"
            + "".join(f"<td style='text-align:left'>{html.escape(str(v))}</td>" for v in r.values())
            + "</tr>"
            for r in rows
        )
        notes = "".join(f"<br>{html.escape(line)}" for line in self._attention_lines())
        return (
            f"<p><b>{html.escape(self.headline())}</b>{notes}</p>"
            f"<table style='font-size:12px'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        )

    def figure(self, per_row: int = 12):
        """Pieces as boxes in execution order (blue: compiled and graphed, orange: attention, grey:
        eager), wrapped every ``per_row`` pieces. Returns a matplotlib Figure (needs matplotlib)."""
        try:
            import matplotlib
        except ImportError as exc:
            raise ImportError(
                "piecewise: report.figure() and save_png() need matplotlib: pip install matplotlib "
                '(or pip install -e ".[notebooks]"); print(report) needs nothing'
            ) from exc

        if matplotlib.get_backend().lower() == "agg" or not _in_notebook():
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyBboxPatch

        colours = {PieceKind.COMPUTE: "#5b8def", PieceKind.SPLIT: "#f0a045", PieceKind.EAGER: "#b5b5b5"}
        rows = (len(self.pieces) + per_row - 1) // per_row or 1
        fig, ax = plt.subplots(figsize=(min(len(self.pieces), per_row) * 1.25 + 0.5, rows * 1.3 + 0.6))
        for p in self.pieces:
            r, c = divmod(p.index, per_row)
            y = (rows - 1 - r) * 1.3
            ax.add_patch(
                FancyBboxPatch(
                    (c * 1.25, y),
                    1.05,
                    0.9,
                    boxstyle="round,pad=0.02",
                    facecolor=colours.get(p.kind, "white"),
                    edgecolor="black",
                    linewidth=0.6,
                )
            )
            if p.kind == PieceKind.SPLIT:
                ops = ", ".join("SDPA" if "scaled_dot_product" in op else op.split("::")[-1][:14] for op in p.split_ops)
                text = f"{ops}\n{p.num_ops} ops"
            else:
                text = f"{p.name}\n{p.num_ops} ops"
            if p.kind == PieceKind.COMPUTE and p.compiled_as and p.compiled_as != p.name:
                text += f"\n= {p.compiled_as}"
            ax.text(c * 1.25 + 0.525, y + 0.45, text, ha="center", va="center", fontsize=7)
        ax.set_xlim(-0.1, min(len(self.pieces), per_row) * 1.25)
        ax.set_ylim(-0.2, rows * 1.3)
        ax.axis("off")
        ax.set_title(f"graph {self.serial}: blue compiled + graphed, orange attention (eager), grey eager", fontsize=9)
        fig.tight_layout()
        plt.close(fig)  # shown once, as the return value (Jupyter's inline backend would show it again)
        return fig

    def save_png(self, path, per_row: int = 12) -> str:
        self.figure(per_row).savefig(path, dpi=110)
        return str(path)


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None
    except ImportError:
        return False


def report(graph=None) -> SplitReport:
    """The report of ``graph`` (a CompiledGraph; default: the most recently compiled one)."""
    if graph is None:
        graphs = compiled_graphs()
        if not graphs:
            raise RuntimeError(
                "piecewise: nothing compiled yet; call a model compiled with "
                "torch.compile(model, backend='piecewise') first, or use inspect_split()."
            )
        graph = graphs[-1]
    return SplitReport(graph)


def reports() -> list[SplitReport]:
    """Reports of every live compiled graph, oldest first."""
    return [SplitReport(g) for g in compiled_graphs()]


def inspect_split(model: torch.nn.Module, *args, options: dict | None = None, **compile_kwargs) -> list[SplitReport]:
    """Compile ``model`` with the piecewise backend, run it once on ``args`` (no grad), and return
    the report of every graph that call compiled (usually one), once the captures it handed to the
    capture thread are in (the report shows them). Works on CPU."""
    before = {g.serial for g in compiled_graphs()}
    compiled = torch.compile(model, backend="piecewise", options=options, **compile_kwargs)
    with torch.no_grad():
        compiled(*args)
    graphs = [g for g in compiled_graphs() if g.serial not in before]
    for graph in graphs:
        graph.wait_for_captures()
    return [SplitReport(g) for g in graphs]


@contextlib.contextmanager
def debug_dump(folder: str):
    """depyf's dump of what compiles inside the block: Dynamo's transformed bytecode, the graph before
    and after the split, every piece's graph and Inductor's code, as files in ``folder``.

    Only what *compiles* inside the block is dumped: a model Dynamo compiled before (by an earlier
    call or ``inspect_split``) runs its cached code and writes nothing, and the block warns so.
    Needs ``depyf`` (``pip install depyf``); imported here only.
    """
    try:
        import depyf
    except ImportError as exc:
        raise ImportError("piecewise: debug_dump needs depyf: pip install depyf") from exc
    before = _newest_serial()
    with depyf.prepare_debug(folder):
        yield folder
    if _newest_serial() == before:
        warnings.warn(
            f"piecewise: debug_dump({folder!r}): nothing was compiled inside the block, so there is "
            f"nothing of this backend's in the dump (Dynamo reused an earlier compile of this code). "
            f"Call torch._dynamo.reset() before the block, or make the block hold the model's first "
            f"call.",
            stacklevel=3,
        )


def _newest_serial() -> int:
    return max((g.serial for g in compiled_graphs()), default=0)
