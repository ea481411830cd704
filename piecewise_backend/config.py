"""``options=`` of ``torch.compile(..., backend="piecewise", options={...})`` → a frozen config.

Every key is checked here, once, at compile time, so a typo fails loudly with the list of accepted
keys instead of being silently ignored on a GPU an hour later.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from .op_names import DEFAULT_SPLITTING_OPS, validate_op_names

CAPTURE_SCHEMES = ("default", "powers_of_two")
SDPA_BACKENDS = ("flash", "efficient", "math", "cudnn")  # names for eager_sdpa_backends
SPLIT_MODES = ("piecewise", "full")  # options["mode"]: where the graph is split
COMPILERS = ("inductor", "eager", "eager_then_inductor")  # options["compiler"]: what runs a compute piece


def scheme_sizes(scheme: str, max_size: int) -> tuple[int, ...]:
    """The capture sizes of a named scheme, up to ``max_size`` (always included).

    ``default`` is vLLM's list: 1, 2, 4, then every multiple of 8 (67 sizes up to 512): fine-grained
    where decode batches live, so padding wastes at most 7 rows. ``powers_of_two`` captures
    log2(max) sizes at the price of padding up to 2x.
    """
    if scheme == "default":
        sizes = {1, 2, 4, *range(8, max_size + 1, 8)}
    elif scheme == "powers_of_two":
        sizes = {1 << i for i in range(max_size.bit_length())}
    else:
        raise ValueError(
            f"piecewise: unknown capture scheme {scheme!r}; use one of "
            f"{', '.join(map(repr, CAPTURE_SCHEMES))} or a list of sizes."
        )
    return tuple(sorted(s for s in sizes | {max_size} if s <= max_size))


@dataclasses.dataclass(frozen=True)
class PiecewiseConfig:
    """What the backend does; build one with :meth:`from_options`.

    Attributes:
        splitting_ops: dispatcher names of the ops to split at (run eagerly between graph replays).
            Replaces the defaults, which cover SDPA in all its torch forms.
        extra_splitting_ops: names added to ``splitting_ops`` (the usual way to add a custom op).
        row_independent_ops: ops the padding proof cannot see into (a custom attention op) that
            the user declares row-wise: each output row reads the same rows of the inputs, and the
            op's padded rows (a batch of 5 replaying the graph of 8) neither write nor read what
            real rows use (a paged attention given slot -1 and length 0 for them). Only full graphs
            (``cudagraph_mode("full")``) run splitting ops inside a graph, at the padded size; without
            the declaration their sizes are captured exactly, and the stats name the op.
        mode: ``"piecewise"`` splits at ``splitting_ops``; ``"full"`` declares attention graph-safe
            and captures the whole graph as one CUDA graph per size (nodes that need a per-step
            Python scalar or write a caller's tensor still run eagerly, and the stats say so).
        cudagraphs: capture CUDA graphs of compute pieces. Off, or without CUDA tensors, pieces
            run compiled and un-graphed, with the same results.
        clone_outputs: copy the graph's outputs out of the CUDA-graph pool, so a returned tensor
            survives the next call. Set False only if you copy the outputs yourself before the
            next call (saves one copy per output per step).
        warmup_runs: eager runs of a piece before its first capture at a new shape when it is
            captured inline (lets lazy initialisation, e.g. cuBLAS workspaces and Triton
            autotuning, happen outside capture). Captures behind run none: the calls before them
            ran every kernel already.
        capture_sizes: the batch sizes (leading dynamic size) that get graphs: a named scheme
            (``"default"``, ``"powers_of_two"``) or a list. Other sizes pad up to the next one.
        max_capture_size: the largest size of a scheme; sizes above the largest capture size run
            compiled, un-graphed. Derived from a list when a list is given.
        padding: pad a batch between capture sizes up to the next one (and slice the outputs
            back). Off, only the listed sizes get graphs. Graphs whose pieces mix rows along the
            batch (a reduction over it) or write the caller's tensors are never padded.
        eager_capture_sizes: sizes captured up front, largest first, by a thread behind the
            graph's first call, which runs un-graphed (a list of capture sizes, or ``"all"``);
            ``capture()`` captures in the caller's thread, on demand.
        lazy_capture: capture other sizes as they come. Off, a batch pads to the smallest size
            already captured, or runs un-graphed.
        defer_captures: with lazy capture, a size that a larger captured graph can serve replays
            that graph, padded, until it has come back often enough to earn its own capture (4
            calls when that graph is more than twice its size, 64 within 2x;
            ``runtime/capture/deferral.py``), and a size whose capture a budget refuses replays
            it too instead of running un-graphed. False: every size is captured the first time
            it is seen (each capture stalls its call: tens of ms on a deep model).
        capture_behind: a new size's capture is made by a thread behind the call that first needs it,
            never inside that call: the call replays the smallest larger captured graph it may pad
            into, or runs un-graphed, and later calls of its size replay the new graph once it is in
            (``runtime/capture/behind.py``). A capture behind runs no kernel (no warm-up run, no
            replay), so it writes nothing a request reads. ``False``: the first call of a size
            captures inline and replays at once (deterministic: tests, benchmarks' references).
            Graphs with collectives (tensor parallel) always capture inline, every rank in step.
        max_graph_memory: cap, in bytes, on graph memory: the graph pool (as the CUDA allocator
            reports it) and the buffers the graph's captures copy their inputs into:
            a capture that would exceed it does not happen; that size replays a larger captured
            graph (``defer_captures``) or runs un-graphed.
        max_captured_sizes: cap on the number of sizes captured per compiled graph.
        max_unreplayed_captures: stop capturing new shapes lazily while this many shapes captured
            lazily have never been replayed (None: no limit). A size that changes at every call
            (a KV length inside a compute piece: attention that is not an SDPA call) would
            otherwise capture a graph per call, slower than eager, the pool growing. Calls at
            shapes already captured still replay; the warning names the sizes that changed.
        max_weight_sets: how many sets of parameter/buffer addresses a compiled graph keeps graphs
            for. Weights that move (``load_state_dict(assign=True)``, ``.to()``, a second model's
            weights through the same compiled function) get graphs of their own, captured anew;
            past this many, a new set's call runs un-graphed, and when the same addresses come
            again (no other set used in between) they get graphs in place of the least recently
            used set (a new static cache per ``generate()``); addresses new at every call (beam
            search's reordered static cache) stay un-graphed. The user's tensors are never written.
        capture_kv_writes: move writes like ``cache[:B, :, pos:pos + S] = k`` (a buffer written at a
            per-step Python-int position) into the captured graphs, with the position read from a
            device tensor the graph refreshes once per call (see ``rewrite/kv_writes.py``). Off,
            they run eagerly between replays, two kernel launches per layer.
        graph_attention: replace decode SDPA over a growing prefix of a cache buffer
            (``sdpa(q, k_cache[:B, :, :pos + 1], ...)``, one query position) with a graph-safe
            attention that reads the length from the device (``graph_attention.py``): no eager
            attention, so a decode step is one graph. On by default (why: ``benchmarks/README.md``,
            "Measurement history"); ``False`` keeps decode attention eager between the pieces (SDPA's own
            kernels), as for prefill and any attention it does not match.
        compiler: what a compute piece runs, as ``torch.compile(backend=...)`` names it.
            ``"inductor"``: Inductor's code (the fastest steps; compiling is most of a cold start).
            ``"eager"``: the piece's FX code as Dynamo traced it, no compiler: start-up is Dynamo's
            trace, the split and the captures; captured, padded and replayed exactly the same.
            ``"eager_then_inductor"``: serve on the FX code at once while Inductor compiles the
            pieces in worker processes; each graph switches to the compiled code between two
            calls, all its pieces at once, and captures again (``persist/compile_behind.py``).
        eager_sdpa_backends: the SDPA kernels the eager attention pieces may use while the graph
            runs (``runtime/sdpa_backends.py``). ``"auto"``: cuDNN attention off when an eager SDPA
            call's KV length changes between calls (cuDNN re-plans every new shape, ~9 ms of host
            time on the H200), torch's choice otherwise. ``"torch"``: torch's choice, untouched. A
            list of ``"flash"``, ``"efficient"``, ``"math"``, ``"cudnn"``: exactly those. Your own
            settings are restored after every call.
    """

    splitting_ops: tuple[str, ...] = DEFAULT_SPLITTING_OPS
    extra_splitting_ops: tuple[str, ...] = ()
    row_independent_ops: tuple[str, ...] = ()
    mode: str = "piecewise"
    cudagraphs: bool = True
    clone_outputs: bool = True
    warmup_runs: int = 1
    capture_sizes: Any = "default"
    max_capture_size: int | None = None
    padding: bool = True
    eager_capture_sizes: Any = ()
    lazy_capture: bool = True
    defer_captures: bool = True
    capture_behind: bool = True
    max_graph_memory: int | None = None
    max_captured_sizes: int | None = None
    max_unreplayed_captures: int | None = 8
    max_weight_sets: int = 4
    capture_kv_writes: bool = True
    graph_attention: bool = True
    eager_sdpa_backends: Any = "auto"
    compiler: str = "inductor"

    @property
    def all_splitting_ops(self) -> frozenset[str]:
        if self.mode == "full":
            return frozenset()
        return frozenset(self.splitting_ops) | frozenset(self.extra_splitting_ops)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The capture sizes, ascending."""
        if isinstance(self.capture_sizes, str):
            return scheme_sizes(self.capture_sizes, self.max_capture_size or 512)
        return tuple(sorted(set(self.capture_sizes)))

    @property
    def largest_size(self) -> int:
        return self.sizes[-1]

    @property
    def eager_sizes(self) -> tuple[int, ...]:
        """Sizes to capture up front, largest first (smaller ones then reuse its pool memory)."""
        sizes = self.sizes if self.eager_capture_sizes == "all" else self.eager_capture_sizes
        return tuple(sorted(set(sizes), reverse=True))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> PiecewiseConfig:
        """Validate a user's ``options`` mapping; raise ValueError/TypeError that say how to fix it."""
        options = dict(options or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            close = {u: difflib.get_close_matches(u, fields, n=1) for u in unknown}
            hints = "".join(f" Did you mean {m[0]!r} for {u!r}?" for u, m in close.items() if m)
            raise ValueError(
                f"piecewise: unknown option(s) {', '.join(map(repr, unknown))}.{hints} "
                f"Accepted options: {', '.join(sorted(fields))}."
            )
        for key in (
            "cudagraphs",
            "clone_outputs",
            "padding",
            "lazy_capture",
            "defer_captures",
            "capture_behind",
            "capture_kv_writes",
            "graph_attention",
        ):
            if key in options and not isinstance(options[key], bool):
                raise TypeError(f"piecewise: option {key!r} must be True or False, got {options[key]!r}.")
        if "warmup_runs" in options:
            _check_int(options["warmup_runs"], "warmup_runs", minimum=0)
        if "max_weight_sets" in options:
            _check_int(options["max_weight_sets"], "max_weight_sets", minimum=1)
        if options.get("mode", "piecewise") not in SPLIT_MODES:
            raise ValueError(
                f"piecewise: option 'mode' must be one of {', '.join(map(repr, SPLIT_MODES))}, got {options['mode']!r}."
            )
        if options.get("compiler", "inductor") not in COMPILERS:
            raise ValueError(
                f"piecewise: option 'compiler' must be one of {', '.join(map(repr, COMPILERS))}, "
                f"got {options['compiler']!r}."
            )
        for key in ("splitting_ops", "extra_splitting_ops", "row_independent_ops"):
            if key in options:
                value = options[key]
                if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
                    raise TypeError(
                        f"piecewise: option {key!r} must be a list of op names like "
                        f"['mylib::paged_attention'], got {value!r}."
                    )
                options[key] = validate_op_names(tuple(value), key)
        for key in ("max_graph_memory", "max_captured_sizes"):
            if options.get(key) is not None:
                _check_int(options[key], key, minimum=0, hint="or None for no cap")
        if options.get("max_unreplayed_captures") is not None:
            _check_int(
                options["max_unreplayed_captures"], "max_unreplayed_captures", minimum=1, hint="or None for no limit"
            )
        _check_sizes(options)
        if "eager_sdpa_backends" in options:
            options["eager_sdpa_backends"] = _sdpa_backends(options["eager_sdpa_backends"])
        return cls(**options)


def _check_int(value, key: str, minimum: int, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"piecewise: option {key!r} must be an int >= {minimum}{' ' + hint if hint else ''}, got {value!r}."
        )


def _size_list(value, key: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset, range)):
        raise TypeError(f"piecewise: option {key!r} must be a list of batch sizes like [1, 2, 4, 8], got {value!r}.")
    bad = [v for v in value if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise ValueError(f"piecewise: option {key!r} holds {bad!r}; sizes must be ints >= 1.")
    return tuple(sorted(set(value)))


def _check_sizes(options: dict) -> None:
    """Normalise capture_sizes / max_capture_size / eager_capture_sizes in place."""
    sizes = options.get("capture_sizes", "default")
    max_size = options.get("max_capture_size")
    if max_size is not None:
        _check_int(max_size, "max_capture_size", minimum=1)
    if isinstance(sizes, str):
        resolved = scheme_sizes(sizes, max_size or 512)  # raises on an unknown scheme
    else:
        resolved = _size_list(sizes, "capture_sizes")
        if not resolved:
            raise ValueError(
                "piecewise: option 'capture_sizes' is empty; give at least one size, "
                "or set cudagraphs=False for no graphs."
            )
        if max_size is not None and max_size != resolved[-1]:
            raise ValueError(
                f"piecewise: max_capture_size={max_size} contradicts capture_sizes "
                f"(largest {resolved[-1]}); with a list, leave max_capture_size out."
            )
        options["capture_sizes"] = resolved
    eager = options.get("eager_capture_sizes", ())
    if eager == "all":
        return
    eager = _size_list(eager, "eager_capture_sizes") if not isinstance(eager, str) else None
    if eager is None:
        raise ValueError(
            f"piecewise: option 'eager_capture_sizes' must be a list of capture "
            f"sizes or 'all', got {options['eager_capture_sizes']!r}."
        )
    missing = [s for s in eager if s not in resolved]
    if missing:
        raise ValueError(
            f"piecewise: eager_capture_sizes {missing} are not capture sizes; capture sizes are {_short(resolved)}."
        )
    options["eager_capture_sizes"] = eager


def _short(sizes: tuple[int, ...]) -> str:
    return str(list(sizes)) if len(sizes) <= 12 else f"[{', '.join(map(str, sizes[:6]))}, ..., {sizes[-1]}]"


def _sdpa_backends(value):
    if value in ("auto", "torch"):
        return value
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or any(n not in SDPA_BACKENDS for n in names):
        raise ValueError(
            f"piecewise: option 'eager_sdpa_backends' must be 'auto', 'torch' or a non-empty "
            f"list of {', '.join(map(repr, SDPA_BACKENDS))}; got {value!r}."
        )
    return tuple(dict.fromkeys(names))
