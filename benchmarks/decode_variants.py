"""The decode suite's models and variants: the toy Llamas at the benchmark sizes (and the same sizes in
another idiom), and how each backend a user would pick is compiled, warmed up and timed.

``MODELS`` and ``IDIOMS`` name the models (the suite's variants: one child process each);
:func:`toy_model` builds one with the weights every benchmark compares on, :func:`models_for` a model
with its graph-safe twin. ``VARIANTS`` names the backends (what each is: ``decode.py``'s docstring);
:func:`prepared_variant` compiles one at a batch and returns how to time it. ``limit`` is the step
captured whole in one CUDA graph (:func:`limit_graph`), ``dynamo-floor`` Dynamo's entry around it
(:func:`floor_backend`).
"""

from __future__ import annotations

import contextlib
import time

import torch

import piecewise_backend
from benchmarks.timing import HostTimed, pipelined_decode_ms, replay_ms, time_decode
from toys.idioms import WholeCacheLlama
from toys.models import (
    BENCHMARK_SIZES,
    ToyConfig,
    ToyLlama,
    ToyStaticCacheLlama,
    init_weights_,
    next_tokens,
    reset_caches,
    sdpa_backends,
)

PINNED = "+pinned-sdpa"  # suffix: the variant under sdpa_kernel([FLASH, EFFICIENT])


def base_variant(variant: str) -> str:
    """The variant a ``+pinned-sdpa`` twin is of (a variant itself otherwise)."""
    return variant[: -len(PINNED)] if variant.endswith(PINNED) else variant


# -- the models -------------------------------------------------------------------------------------

MODELS = {
    **BENCHMARK_SIZES,
    "tiny": dict(vocab=256, hidden=64, layers=2, heads=4, intermediate=128),  # CPU smoke runs
}


# the same sizes, written in an idiom other than the toys' own (``toys/idioms.py``): key -> (size, class)
IDIOMS = {f"{size}-whole-cache": (size, WholeCacheLlama) for size in ("16L", "28L", "tiny")}


def toy_model(key: str, device: str, model_cls=ToyLlama, **sizes):
    """``model_cls`` at ``MODELS[key]`` (``sizes`` override or add config fields), with the
    deterministic weights every benchmark compares on: bf16 on a GPU, fp32 on a CPU."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return init_weights_(model_cls(ToyConfig(**{**MODELS[key], **sizes}))).to(device=device, dtype=dtype).eval()


def next_ids(logits: torch.Tensor) -> torch.Tensor:
    """Greedy next tokens, their batch dim marked dynamic (one decode graph for every batch size)."""
    return next_tokens(logits, mark_batch_dynamic=True)


def model_name(model) -> str:
    idiom = getattr(model, "idiom", None)
    return f"llama-{model.cfg.layers}L-{model.cfg.hidden}" + (f"-{idiom}" if idiom else "")


def models_for(key: str, args, device: str):
    """The model sized for the run, and its graph-safe twin with the same weights."""
    if key in IDIOMS:  # no graph-safe twin: the full-static variants are the toys' own
        size, cls = IDIOMS[key]
        return toy_model(size, device, cls, max_batch=max(args.batches), max_seq=args.prompt + args.steps + 8), None
    model = toy_model(key, device, max_batch=max(args.batches), max_seq=args.prompt + args.steps + 8)
    twin = toy_model(key, device, ToyStaticCacheLlama, max_batch=model.cfg.max_batch, max_seq=model.cfg.max_seq)
    twin.load_state_dict(model.state_dict())
    return model, twin


def size_caches(model, batch: int) -> None:
    """A model whose caches hold exactly the batch (``toys/idioms.py``) gets new ones per batch."""
    if hasattr(model, "set_batch"):
        model.set_batch(batch)


# -- the backends -----------------------------------------------------------------------------------

BASE_VARIANTS = (
    "eager",
    "inductor",
    "reduce-overhead",
    "reduce-overhead+partition",
    "piecewise",
    "piecewise-kv-eager",
    "piecewise-eager-attention",
    "piecewise-skip-guards",
    "piecewise-no-clone",
    "piecewise-fast-call",
    "piecewise-full",
    "piecewise-full-skip-guards",
    "piecewise-full-static",
    "limit",
    "limit-full",
    "dynamo-floor",
)


VARIANTS = BASE_VARIANTS + tuple(v + PINNED for v in BASE_VARIANTS)


def sdpa_setting(variant: str, device: str):
    """The SDPA setting a variant runs under: torch's defaults, unless its name says pinned."""
    return sdpa_backends(device) if variant.endswith(PINNED) else contextlib.nullcontext()


# variant -> the variant it compiles as, decoded under skip_guard_eval_unsafe (same backend and
# options: where that variant is in the same process and compiled first, Dynamo serves its cache
# entries and this one compiles nothing of its own)
SKIP_GUARDS = {
    "piecewise-skip-guards": "piecewise",
    "piecewise-full-skip-guards": "piecewise-full",
    "piecewise-fast-call": "piecewise-no-clone",
}


def limit_graph(model, batch: int, prompt: int, device: str, tensor_pos: bool = False, inductor: bool = True):
    """The whole Inductor-compiled decode step at one shape and position, captured in one graph:
    (``replay()`` returning the graph's logits, seconds to compile and warm up). ``inductor=False``:
    the eager step captured instead (``coresidence.py``).

    ``replay.inputs`` holds the graph's inputs: a CUDA graph keeps only their addresses. Before it
    did, the token ids were freed when this function returned, later allocations reused their memory,
    and the replays read whatever lay there: at batch 8, ids out of the vocabulary and a device-side
    assert in the embedding, next to reduce-overhead's models on the H200.
    """
    if device != "cuda":
        raise RuntimeError("the limit is a CUDA graph: needs a GPU")
    compiled = torch.compile(model, dynamic=False) if inductor else model
    reset_caches(model)
    ids = torch.randint(0, model.cfg.vocab, (batch, 1), device=device)
    pos = torch.tensor([prompt], device=device) if tensor_pos else prompt
    start = time.perf_counter()
    for _ in range(3):  # compile and warm up at the fixed shape
        compiled(ids, pos)
    torch.cuda.synchronize()
    first_call = time.perf_counter() - start
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = compiled(ids, pos)

    def replay():
        graph.replay()
        return logits

    replay.inputs = (ids, pos)
    return replay, first_call


def floor_backend(replay):
    """A ``torch.compile`` backend whose every graph is ``replay()`` (the limit's graph): what a
    backend costs when it adds nothing to Dynamo's entry (``dynamo-floor``; timing only)."""

    def backend(gm, example_inputs):
        def run(*args):
            return (replay(),)

        return run

    return backend


def compiled_variant(variant: str, model, pinned: bool = False):
    """``variant`` compiled. ``pinned``: its ``+pinned-sdpa`` twin, compiled with one option more
    (a no-op for Inductor, the same pin for the backend's eager attention) so that Dynamo keeps its
    cache entries apart from the unpinned variant's: Inductor picks SDPA's kernel at compile time,
    and equal backends share Dynamo's cache within a process."""
    variant = SKIP_GUARDS.get(variant, variant)
    inductor_extra = {"max_autotune": False} if pinned else {}
    piecewise_extra = {"eager_sdpa_backends": ["flash", "efficient"]} if pinned else {}
    if variant == "inductor":
        return torch.compile(model, options=inductor_extra or None)
    if variant == "reduce-overhead":
        return torch.compile(model, options={"triton.cudagraphs": True, "graph_partition": False, **inductor_extra})
    if variant == "reduce-overhead+partition":
        return torch.compile(model, options={"triton.cudagraphs": True, "graph_partition": True, **inductor_extra})
    options = {
        "piecewise": {},
        "piecewise-eager-attention": {"graph_attention": False},
        "piecewise-kv-eager": {"capture_kv_writes": False, "graph_attention": False},
        "piecewise-no-clone": {"clone_outputs": False},
        "piecewise-full": {"mode": "full"},
        # its masked attention over the whole cache: nothing to rewrite
        "piecewise-full-static": {"mode": "full", "graph_attention": False},
    }
    if variant not in options:
        raise ValueError(variant)
    return torch.compile(model, backend="piecewise", options={**options[variant], **piecewise_extra} or None)


def piecewise_facts(graphs: list) -> dict:
    """What the backend made of the model: pieces, compiles, captures, copies per step."""
    main = max(graphs, key=lambda g: g.stats.calls)
    return {
        "graphs": len(graphs),
        "pieces": main.stats.num_pieces,
        "compute_pieces": main.stats.num_compute_pieces,
        "inductor_compiles": sum(g.stats.inductor_compiles for g in graphs),
        "captures": sum(g.stats.captures for g in graphs),
        "input_copies_per_step": round(
            sum(p.input_copies for p in main.stats.pieces.values()) / max(main.stats.calls, 1), 2
        ),
        "padding": main.stats.padding,
    }


def inductor_compiles() -> dict:
    """Inductor's graph counts so far: compiled afresh (``fxgraph_cache_miss``) or loaded from its
    cache (``fxgraph_cache_hit``)."""
    from torch._dynamo.utils import counters

    return {k: counters["inductor"].get(k, 0) for k in ("fxgraph_cache_miss", "fxgraph_cache_hit")}


def _since(before: dict) -> dict:
    """A row's compile facts: how many Inductor graphs its warm-up compiled and how many it loaded
    from the cache, so that ``first_call_s`` says which it timed (the device runs keep Inductor's
    cache between calls on one machine)."""
    now = inductor_compiles()
    return {
        "inductor_compiled": now["fxgraph_cache_miss"] - before["fxgraph_cache_miss"],
        "inductor_cache_hits": now["fxgraph_cache_hit"] - before["fxgraph_cache_hit"],
    }


def prepared_variant(variant: str, model, twin, batch: int, args, device: str):
    """Compile and warm up ``variant`` at ``batch`` (a short decode, or the limit's capture):
    (first call seconds, ``measure(pipelined=False)`` giving one decode run's median step ms and host ms,
    ``facts()`` giving the row's extra fields once the timing is done). Dynamo is not reset here: the sequential path
    resets before each variant, the interleaved one before each batch."""
    with sdpa_setting(variant, device):
        first_s, measure, facts = _prepared(
            base_variant(variant), model, twin, batch, args, device, pinned=variant.endswith(PINNED)
        )

    def measure_as_named(pipelined: bool = False):
        with sdpa_setting(variant, device):
            return measure(pipelined)

    return first_s, measure_as_named, facts


def _prepared(variant: str, model, twin, batch: int, args, device: str, pinned: bool):
    before = {g.serial for g in piecewise_backend.compiled_graphs()}
    compiles_before = inductor_compiles()
    if variant in ("limit", "limit-full"):
        full = variant == "limit-full"
        replay, first_s = limit_graph(twin if full else model, batch, args.prompt, device, tensor_pos=full)
        compiles = _since(compiles_before)
        return first_s, lambda pipelined=False: replay_ms(replay, args.steps, device, pipelined), lambda: compiles
    if variant == "eager":
        step, target = model, model
    elif variant == "dynamo-floor":
        replay, _ = limit_graph(model, batch, args.prompt, device)
        step, target = torch.compile(model, backend=floor_backend(replay)), model
    else:
        target = twin if variant == "piecewise-full-static" else model
        step = compiled_variant(variant, target, pinned)
    tensor_pos = variant == "piecewise-full-static"
    _, first_s = time_decode(step, target, batch, args.prompt, 4, device, tensor_pos=tensor_pos)
    compiles = _since(compiles_before)

    stance = (
        (lambda: torch.compiler.set_stance("default", skip_guard_eval_unsafe=True))
        if variant in SKIP_GUARDS
        else contextlib.nullcontext
    )

    def measure(pipelined: bool = False) -> tuple[float, float]:
        host = HostTimed(step)
        decode = pipelined_decode_ms if pipelined else lambda *a, **k: time_decode(*a, **k)[0]
        with stance():
            ms = decode(host, target, batch, args.prompt, args.steps, device, tensor_pos=tensor_pos)
        return ms, host.median_ms(args.steps)

    # this variant's graphs: those its warm-up compiled (SKIP_GUARDS' variants: none where Dynamo
    # serves them their base variant's cache entries)
    mine = [g for g in piecewise_backend.compiled_graphs() if g.serial not in before]

    def facts() -> dict:
        return {**compiles, "piecewise": piecewise_facts(mine)} if mine else compiles

    return first_s, measure, facts


def sdpa_label(variant: str) -> str:
    return "pinned flash/efficient" if variant.endswith(PINNED) else "torch default"
