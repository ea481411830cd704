"""Suite ``hf``: Hugging Face ``generate()`` per token: eager, torch.compile's paths and this backend,
side by side.

    python -m benchmarks hf [--variants 8L-512,1B] [--batches 1,4,16] [--tokens 64] [--rounds 3]
    python -m benchmarks hf --smoke             # CPU: the tiny Llama, batch 2, 8 tokens
    python -m benchmarks hf --dtype bfloat16 --variants qwen3-4L-512,phi3-28L-1.5b,gemma3-4L-512

The suite's variants are the models (one child process each); the ways of running ``generate()``
(``--backends``) are timed in turns in the model's process, and each row names its way.

Models: Llama shapes by name (``8L-512``, ``1B``, ``tiny``), or ``ARCH-NL-DIMS``: Llama, Qwen2, Qwen3,
Phi-3 or Gemma 3 at N layers with the widths of ``512`` (hidden 512) or ``1.5b`` (Qwen2.5-1.5B's).

What a user would run, with torch's and transformers' defaults (fp32, torch's SDPA selection,
random weights from the config): per model and batch, each variant generates ``--tokens`` greedy
tokens after a 16-token prompt. ``ms_per_token`` is the mean time between consecutive decode steps
(stamped by a logits processor, so the prefill is left out), the better of two timed runs after one
warm-up run that compiles and captures. ``token_agreement`` is the share of generated tokens equal
to eager's with the dynamic cache; ``speedup_vs_eager`` divides that eager row's time by the row's.

``--rounds N`` (N > 1) interleaves the variants: every variant is set up and timed in turn, N times
over, and a row's ``ms_per_token`` is the median of its rounds (``ms_rounds``). Why: one lease's
machine drifts by more than the gap between the fastest variants (transformers' static +
reduce-overhead against this backend's static cache: 7% slower on one lease, 28% faster on the
next); interleaved, a slow spell hits every variant. Each round recompiles from Inductor's caches.

Backends (each after ``torch._dynamo.reset()``, so none is served another's compiled code):

* ``eager`` / ``eager-static``: no compile; HF's default dynamic cache / ``cache_implementation="static"``
* ``compile-default``: ``model.forward = torch.compile(model.forward)`` (Inductor, default mode)
* ``hf-static-reduce-overhead``: transformers' documented path: static cache and its automatic
  ``compile_config`` (Inductor, ``mode="reduce-overhead"``, decode steps only); its error is recorded
  if it fails
* ``piecewise-dynamic`` / ``piecewise-static``: ``torch.compile(model.forward, backend="piecewise")``
* ``piecewise-compile-config``: the static cache with ``CompileConfig(backend="piecewise")``

A row that fails records ``error`` instead of timings. Rows come as their last round is measured.
"""

from __future__ import annotations

import statistics
import time
import traceback
import warnings
from collections.abc import Iterator

import torch
import transformers

from benchmarks.harness import Suite

# fmt: off
MODELS = {  # Llama shapes by name
    "8L-512": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, vocab_size=32000),  # the configuration of the issue: 8 layers, hidden 512, GQA
    "4L-256": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, vocab_size=1024),  # the reliability suite's threads model
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, vocab_size=256),  # a smoke test's size (``--device cpu``)
    "1B": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
}
# fmt: on
# ``ARCH-NL-DIMS`` model keys (``qwen3-4L-512``, ``gemma3-28L-1.5b``): an architecture, a depth, and
# the widths of one of these (``1.5b``: Qwen2.5-1.5B's)
DIMS = {
    "512": dict(
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=32000,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=32000,
    ),
}
ARCHS = {  # config class, model class, what the architecture adds
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # fused QKV and gate/up projections
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 512}),  # 5 sliding layers : 1 full
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),  # multipliers on embeddings, residuals, logits
}


ARCHITECTURE_MODELS = tuple(f"{arch}-{n}L-{dims}" for arch in ARCHS for n, dims in ((4, "512"), (28, "1.5b")))


def model_config(key: str):
    """(config, model class, row name, layers) of a model key: one of ``MODELS`` (Llama) or ``ARCH-NL-DIMS``."""
    if key in MODELS:
        cfg = transformers.LlamaConfig(max_position_embeddings=4096, **MODELS[key])
        return cfg, transformers.LlamaForCausalLM, f"hf-llama-{key}", cfg.num_hidden_layers
    arch, _, rest = key.partition("-")
    layers, _, dims = rest.partition("L-")
    if arch not in ARCHS or dims not in DIMS or not layers.isdigit():
        raise ValueError(
            f"unknown model {key!r}: one of {', '.join(MODELS)}, or ARCH-NL-DIMS with ARCH in "
            f"{', '.join(ARCHS)} and DIMS in {', '.join(DIMS)} (e.g. qwen3-4L-512)"
        )
    config_name, model_name, extra = ARCHS[arch]
    widths = dict(DIMS[dims])
    if arch == "phi3":
        widths.pop("head_dim")  # Phi-3 derives it
    cfg = getattr(transformers, config_name)(
        num_hidden_layers=int(layers),
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **widths,
        **extra,
    )
    return cfg, getattr(transformers, model_name), arch, int(layers)


VARIANTS = (
    "eager",
    "eager-static",
    "compile-default",
    "hf-static-reduce-overhead",
    "piecewise-dynamic",
    "piecewise-static",
    "piecewise-compile-config",
    "piecewise-static-second-call",
)
# A user's second generate() with a new max_new_tokens: transformers makes a new static cache, at new
# addresses and of a new length (Dynamo compiles again, with the length a symbol). Timed once, after
# one generate() of a quarter of the tokens (record.py files its rows under "hf_second_call").
SECOND_CALL = "piecewise-static-second-call"
PROMPT = 16


class StepStamps(transformers.LogitsProcessor):
    """Records the host time of every decode step (generate() waits for each step's tokens)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def build_model(key: str, device: str, dtype: torch.dtype = torch.float32):
    cfg, cls, _, _ = model_config(key)
    torch.manual_seed(0)
    model = cls(cfg).to(device, dtype).eval()
    model.generation_config.eos_token_id = None  # every run generates exactly --tokens tokens
    model.generation_config.pad_token_id = 0
    return model


def prepare(variant: str, model, eager_forward) -> dict:
    """Set the model up for ``variant``; returns the extra generate() arguments."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    torch._dynamo.reset()
    model.forward = eager_forward
    for attr in ("_compiled_call", "_last_compile_config"):
        model.__dict__.pop(attr, None)
    static = "static" in variant or variant.endswith("compile-config")
    kwargs = {"cache_implementation": "static"} if static else {}
    model.generation_config.disable_compile = variant not in ("hf-static-reduce-overhead", "piecewise-compile-config")
    if variant in ("compile-default", "piecewise-dynamic", "piecewise-static", SECOND_CALL):
        model.forward = torch.compile(eager_forward, **({"backend": "piecewise"} if "piecewise" in variant else {}))
    if variant == "hf-static-reduce-overhead":
        kwargs["compile_config"] = transformers.CompileConfig()
    if variant == "piecewise-compile-config":
        kwargs["compile_config"] = transformers.CompileConfig(backend="piecewise")
    return kwargs


def run(model, ids, tokens: int, kwargs: dict) -> tuple[torch.Tensor, float]:
    stamps = StepStamps()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            do_sample=False,
            logits_processor=transformers.LogitsProcessorList([stamps]),
            **kwargs,
        )
    if out.is_cuda:
        torch.cuda.synchronize()
    steps = stamps.times
    return out[:, ids.shape[1] :], (steps[-1] - steps[1]) * 1e3 / (len(steps) - 2)


def measure(model, ids, tokens: int, kwargs: dict, second_call: bool = False) -> tuple[torch.Tensor, float, dict]:
    """Tokens, ms per decode step (the better of two runs after a warm-up), and facts of the run."""
    if second_call:  # the first call at another length compiles and captures; the second is the one timed
        run(model, ids, max(3, tokens // 4), kwargs)
        start = time.perf_counter()
        out, ms = run(model, ids, tokens, kwargs)  # its steps from the second on: Dynamo's new graphs come before
        whole = (time.perf_counter() - start) * 1e3 / tokens
        return out, ms, {"call_ms_per_token": round(whole, 3)}  # the whole call, its compile included
    out, _ = run(model, ids, tokens, kwargs)  # compiles and captures
    times = [run(model, ids, tokens, kwargs)[1] for _ in range(2)]
    return out, min(times), {}


def token_agreement(out: torch.Tensor, reference: torch.Tensor) -> float:
    """The share of generated tokens equal to the reference run's (same prompts, greedy)."""
    return round((out.cpu() == reference.cpu()).float().mean().item(), 4)


def graph_calls() -> dict:
    """Calls served so far per compiled graph (its serial): what a row's run adds tells which graph served it."""
    import piecewise_backend

    return {g.serial: g.stats.calls for g in piecewise_backend.compiled_graphs()}


def piecewise_facts(calls_before: dict | None = None) -> dict:
    """Facts of the graph that served the most calls since ``calls_before`` (``graph_calls()``; None:
    the busiest graph): the decode graph of the row's batch, not another batch's."""
    import piecewise_backend

    graphs = piecewise_backend.compiled_graphs()
    if not graphs:
        return {}
    before = calls_before or {}
    busiest = max(graphs, key=lambda g: g.stats.calls - before.get(g.serial, 0))
    return {
        "graphs": len(graphs),
        "decode_pieces": busiest.stats.num_pieces,
        "decode_compute_pieces": busiest.stats.num_compute_pieces,
        "replays": busiest.stats.replays,
        "captures": busiest.stats.captures,
        "ungraphed_runs": busiest.stats.ungraphed_runs,
        "attention": [how for _, how in busiest.plan.report.attention][:1],
        "shape_key": [str(s) for s in busiest.plan.key.symbols],
        "misses": {
            str(miss): busiest.stats.miss_details.get(miss, "")[:300] for miss, n in busiest.stats.misses.items() if n
        },
    }


def bench_model(
    key: str,
    batches,
    tokens: int,
    variants,
    device: str,
    rounds: int = 1,
    dtype: torch.dtype = torch.float32,
) -> Iterator[dict]:
    """The model's rows, each once its last round is measured (or it failed)."""
    model = build_model(key, device, dtype)
    eager_forward = model.forward
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(3, model.config.vocab_size, (b, PROMPT), generator=g).to(device) for b in batches}
    reference: dict = {}  # batch -> eager's tokens
    by_key: dict = {}  # (variant, batch) -> row
    for round_ in range(rounds):
        for variant in variants:
            try:
                kwargs, failure = prepare(variant, model, eager_forward), None
            except Exception as exc:  # an unknown variant, a transformers without CompileConfig, ...
                kwargs, failure = {}, f"{type(exc).__name__}: {str(exc)[:300]}"
            for batch in batches:
                row = by_key.get((variant, batch))
                if row is None:
                    row = by_key[variant, batch] = _new_row(key, model, kwargs, batch, variant, tokens, rounds)
                elif "error" in row:
                    continue
                _measure_row(row, model, prompts[batch], kwargs, failure, reference, by_key)
                if round_ == rounds - 1 or "error" in row:
                    yield row
    model.forward = eager_forward


def _new_row(key: str, model, kwargs: dict, batch: int, variant: str, tokens: int, rounds: int) -> dict:
    _, _, name, layers = model_config(key)
    row = {
        "model": name,
        "layers": layers,
        "params": sum(p.numel() for p in model.parameters()),
        "cache": "static" if "static" in kwargs.get("cache_implementation", "") else "dynamic",
        "batch": batch,
        "variant": variant,
        "tokens": tokens,
        "dtype": str(model.dtype).removeprefix("torch."),
    }
    if rounds > 1:
        row["rounds"] = "interleaved"
    return row


def _measure_row(row: dict, model, ids, kwargs: dict, failure: str | None, reference: dict, by_key: dict) -> None:
    """One round of ``row``'s variant: time it, compare its tokens with eager's, update its figures."""
    batch, variant = row["batch"], row["variant"]
    try:
        if failure:
            raise RuntimeError(failure)
        calls_before = graph_calls() if "piecewise" in variant else None
        out, ms, facts = measure(model, ids, row["tokens"], kwargs, second_call=variant == SECOND_CALL)
        row.update(facts)
        if variant == "eager":
            reference.setdefault(batch, out)
        times = row.setdefault("ms_rounds", [])
        times.append(round(ms, 3))
        row["ms_per_token"] = round(statistics.median(times), 3)
        # the worst round's
        row["token_agreement"] = min(token_agreement(out, reference[batch]), row.get("token_agreement", 1.0))
        row["speedup_vs_eager"] = round(by_key["eager", batch]["ms_per_token"] / row["ms_per_token"], 2)
        if "piecewise" in variant:
            row.update(piecewise_facts(calls_before))
    except Exception as exc:  # a path that fails is a result too
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        traceback.print_exc()


def rows(variant: str, args) -> Iterator[dict]:
    """In the child: the model ``variant``'s rows (eager's first: the reference for agreement)."""
    backends = args.backends.split(",")
    backends = backends if "eager" in backends else ["eager", *backends]
    batches = [int(b) for b in str(args.batches).split(",")]
    for row in bench_model(
        variant, batches, args.tokens, backends, args.device, args.rounds, getattr(torch, args.dtype)
    ):
        yield {**row, "transformers": transformers.__version__}


def options(parser) -> None:
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--backends", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=1, help="interleave the backends, N rounds (see above)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


# fmt: off
SUITE = Suite("hf", "Hugging Face generate() ms per token: eager, torch.compile's routes and this backend",
              tuple(MODELS) + ARCHITECTURE_MODELS, rows, options, default=("8L-512", "1B"),
              smoke="--variants tiny --batches 2 --tokens 8 --device cpu --backends eager,piecewise-dynamic".split())
# fmt: on
