"""Hugging Face ``generate()`` through the backend: the same greedy tokens as eager (fp32), with the
decode step in as few graphs as its cache allows, batch sizes changing in one process.

* ``DynamicCache`` (grown by ``torch.cat``): the cat, the window crop and the mask run beside the
  eager attention, so the compute pieces are captured once per batch size and replay at every KV
  length (before, every KV length was a new capture and nothing replayed).
* ``StaticCache`` (``index_copy_`` at ``cache_position``, attention over the whole cache with a
  mask): the decode step is one graph: the writes and the fixed-shape attention are captured.
* transformers' own ``compile_config`` route (``CompileConfig(backend="piecewise")``).

Tiny configurations on CPU (graphs emulated); the issue's 8-layer configuration on CUDA. Skipped
where transformers is not installed. Compiled with ``capture_behind=False`` (``helpers.INLINE``): the
step that meets a size captures it, so what one ``generate()`` replays is known; captures behind the
calls, the default, are tested on ``generate()`` in ``test_the_default_captures_behind_generate``.
"""

import logging
import warnings

import pytest
import torch

from piecewise_backend.kinds import GraphMode, Miss

from .helpers import INLINE, busiest_graph, graphs_since, last_serial

transformers = pytest.importorskip("transformers")

PROMPT = 7


def _config(arch: str, layers: int, hidden: int, **hybrid_overrides):
    common = dict(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    if arch == "qwen2":
        return transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    if arch == "mistral":  # a window shorter than prompt + new tokens: the window's crop and mask are exercised
        return transformers.MistralConfig(sliding_window=5, **common), transformers.MistralForCausalLM
    if arch == "gemma":
        return transformers.GemmaConfig(head_dim=hidden // 8, **common), transformers.GemmaForCausalLM
    if arch == "gemma2":  # attention written as matmuls (its default in transformers 5.24, asked for by name)
        return transformers.Gemma2Config(
            head_dim=hidden // 8, sliding_window=4, attn_implementation="eager", **common
        ), transformers.Gemma2ForCausalLM
    if arch == "qwen3":  # q/k norms
        return transformers.Qwen3Config(head_dim=hidden // 8, **common), transformers.Qwen3ForCausalLM
    if arch == "granite":  # the second-call model: multipliers on embeddings, residuals and logits
        return transformers.GraniteConfig(**common), transformers.GraniteForCausalLM
    if arch == "phi3":  # fused QKV and gate/up projections
        return transformers.Phi3Config(pad_token_id=0, **common), transformers.Phi3ForCausalLM
    if arch == "gpt2":
        return (
            transformers.GPT2Config(vocab_size=256, n_embd=hidden, n_layer=layers, n_head=4, n_positions=512),
            transformers.GPT2LMHeadModel,
        )
    # sliding-window layers beside full-attention ones, a window shorter than prompt + new tokens
    hybrid = dict(layer_types=["sliding_attention", "full_attention"] * max(1, layers // 2), sliding_window=4)
    hybrid.update(hybrid_overrides)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(head_dim=hidden // 8, **hybrid, **common), transformers.Gemma3ForCausalLM
    if arch == "olmo3":
        return transformers.Olmo3Config(**hybrid, **common), transformers.Olmo3ForCausalLM
    if arch == "exaone4":
        return transformers.Exaone4Config(**hybrid, **common), transformers.Exaone4ForCausalLM
    if arch == "cohere2":
        return transformers.Cohere2Config(pad_token_id=0, **hybrid, **common), transformers.Cohere2ForCausalLM
    raise ValueError(arch)


def _model(arch: str, device: str, layers: int = 2, hidden: int = 64, **hybrid_overrides):
    config, cls = _config(arch, layers, hidden, **hybrid_overrides)
    torch.manual_seed(0)
    return cls(config).to(device).eval()


def _generate(model, ids, new_tokens: int, **kwargs):
    kwargs.setdefault("attention_mask", torch.ones_like(ids))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)


def _generate_both(model, batches, new_tokens, device, options=None, dynamic=None, **kwargs):
    """Greedy tokens of eager and of ``model.forward`` compiled with the backend, per batch size."""
    eager_forward = model.forward
    compiled_forward = torch.compile(
        eager_forward, backend="piecewise", options={**INLINE, **(options or {})}, dynamic=dynamic
    )
    g = torch.Generator().manual_seed(0)
    out = []
    for batch in batches:
        ids = torch.randint(0, model.config.vocab_size, (batch, PROMPT), generator=g).to(device)
        model.forward = compiled_forward
        mine = _generate(model, ids, new_tokens, **kwargs)
        model.forward = eager_forward
        out.append((batch, mine, _generate(model, ids, new_tokens, **kwargs)))
    return out


def _compiled_and_eager(model, **compile_kwargs):
    """``both(batch, new_tokens)``: greedy tokens of one compiled forward (kept across calls, so its
    Dynamo cache grows as a server's would) and of eager, on the same random prompt."""
    eager_forward = model.forward
    compiled = torch.compile(eager_forward, backend="piecewise", options=INLINE, **compile_kwargs)
    g = torch.Generator().manual_seed(0)

    def both(batch, new_tokens):
        ids = torch.randint(0, model.config.vocab_size, (batch, PROMPT), generator=g)
        model.forward = compiled
        mine = _generate(model, ids, new_tokens)
        model.forward = eager_forward
        return batch, mine, _generate(model, ids, new_tokens)

    return both


def _assert_same_tokens(results):
    for batch, mine, theirs in results:
        assert torch.equal(mine, theirs), f"batch {batch}: {mine} vs {theirs}"


def _assert_dynamic_cache_replays(start):
    """The decode graph's shape keys are batch sizes only: compute pieces replay across KV lengths."""
    decode = busiest_graph(start)
    assert decode.stats.replays > 0
    assert all(len(key) <= 1 for key in decode.stats.captured_keys), decode.stats.summary()
    assert any("grow by torch.cat" in how for _, how in decode.plan.report.attention), decode.plan.report.attention


def _assert_static_decode_is_one_graph(start):
    decode = busiest_graph(start)
    assert decode.stats.num_pieces == 1, decode.stats.summary()
    assert decode.stats.replays > 0
    assert all(how == "graph: compiled with its piece" for _, how in decode.plan.report.attention)


@pytest.mark.usefixtures("emulated_graphs")
def test_llama_dynamic_cache_replays_across_kv_lengths_with_changing_batch_sizes():
    torch._dynamo.reset()
    start = last_serial()
    _assert_same_tokens(_generate_both(_model("llama", "cpu"), (1, 4, 3), 8, "cpu", {"capture_sizes": [1, 2, 4, 8]}))
    _assert_dynamic_cache_replays(start)


@pytest.mark.usefixtures("emulated_graphs")
def test_llama_static_cache_decode_step_is_one_graph():
    torch._dynamo.reset()
    start = last_serial()
    _assert_same_tokens(_generate_both(_model("llama", "cpu"), (1, 3), 8, "cpu", cache_implementation="static"))
    _assert_static_decode_is_one_graph(start)


@pytest.mark.usefixtures("emulated_graphs")
def test_an_eight_layer_static_cache_decode_step_is_one_graph_compiled_layer_by_layer():
    torch._dynamo.reset()
    start = last_serial()
    _assert_same_tokens(_generate_both(_model("qwen3", "cpu", layers=8), (2,), 6, "cpu", cache_implementation="static"))
    _assert_static_decode_is_one_graph(start)
    decode = busiest_graph(start)
    assert decode.stats.inductor_compiles == 3, decode.stats.summary()  # first, middle (x7), last: layer_chain.py
    assert decode.plan.report.inductor_code[decode.pieces[0].name].count("# ---- ") == 3


@pytest.mark.usefixtures("emulated_graphs")
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_without_inductor_generate_gives_eager_tokens_and_compiles_nothing(cache):
    """``compiler="eager"``: the pieces run their traced code, captured as Inductor's would be."""
    torch._dynamo.reset()
    start = last_serial()
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
    _assert_same_tokens(_generate_both(_model("qwen2", "cpu"), (1, 3), 8, "cpu", {"compiler": "eager"}, **kwargs))
    (_assert_static_decode_is_one_graph if cache == "static" else _assert_dynamic_cache_replays)(start)
    assert all(g.stats.inductor_compiles == 0 for g in graphs_since(start))


@pytest.mark.usefixtures("emulated_graphs")
@pytest.mark.parametrize("arch", ["gpt2", "qwen2", "mistral", "gemma"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_other_architectures_give_eager_tokens(arch, cache):
    torch._dynamo.reset()
    start = last_serial()
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
    _assert_same_tokens(_generate_both(_model(arch, "cpu"), (1, 3), 8, "cpu", **kwargs))
    assert sum(g.stats.replays for g in graphs_since(start)) > 0
    if arch == "mistral":
        # The window's layers keep their length in a Python int (hoisted: the batch-1 step is one
        # compute piece) and, once full, roll and write the whole cache by ``copy_``. With the batch
        # dynamic those writes run eagerly, and batch 3 pads to 4 (the window's write
        # ``new_keys[:, :, index] = k`` keeps rows apart): every decode step replays.
        if cache == "static":
            graphs = graphs_since(start)
            assert sum(g.stats.ungraphed_runs for g in graphs) == 0, [g.stats.summary() for g in graphs]
            assert any(g.stats.num_compute_pieces == 1 and g.stats.replays > 0 for g in graphs)
        return
    if cache == "static":
        _assert_static_decode_is_one_graph(start)
    else:
        decode = busiest_graph(start)
        assert all(len(key) <= 1 for key in decode.stats.captured_keys), decode.stats.summary()


@pytest.mark.usefixtures("emulated_graphs")
@pytest.mark.parametrize("arch", ["gemma3", "olmo3", "exaone4"])
def test_sliding_and_full_attention_layers_with_the_dynamic_cache_give_eager_tokens(arch):
    """Gemma 3, OLMo 3, EXAONE 4 alternate sliding-window and full-attention layers (on the H200 at
    6b12b66c: a ``NameError`` at the first capture, then ``generate()`` raised)."""
    torch._dynamo.reset()
    start = last_serial()
    _assert_same_tokens(_generate_both(_model(arch, "cpu"), (1, 3), 10, "cpu"))
    decode = busiest_graph(start)  # one key for every decode step at a batch size: replayed at every KV length
    assert len(decode.stats.captured_keys) == 1 and decode.stats.replays > 0, decode.stats.summary()
    assert decode.stats.ungraphed_runs == 0, decode.stats.summary()


# Hybrid models as a user meets them, unlike the configurations above: three layers, Gemma 3's all
# sliding (transformers 5.17 then builds a full-attention mask nothing reads) with a window the run
# never fills, the others two sliding layers to one full with a window filled in a few steps.
HYBRID_CHECK = {
    "gemma3": (["sliding_attention"] * 3, 64),
    "exaone4": (["sliding_attention"] * 2 + ["full_attention"], 64),
    "olmo3": (["sliding_attention"] * 2 + ["full_attention"], 5),
    "cohere2": (["sliding_attention"] * 2 + ["full_attention"], 5),
}


def _decode_calls_graphed(start: int, batches, new_tokens: int) -> float:
    """Of the decode calls (one per new token after the first, per ``generate()``), the share a graph
    served: every call graphs served, less one prefill per ``generate()`` (counted as if graphed)."""
    served = sum(sum(g.stats.graph_calls.values()) for g in graphs_since(start))
    return (served - len(batches)) / (len(batches) * (new_tokens - 1))


@pytest.mark.usefixtures("emulated_graphs")
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("arch", sorted(HYBRID_CHECK))
def test_hybrid_models_give_eager_tokens_with_nine_in_ten_decode_calls_graphed(arch, cache):
    """On the H200 (transformers 5.17, package 64639c65) the dynamic cache gave 0 decode replays: a
    capture per KV length, then "never replayed"."""
    torch._dynamo.reset()
    start = last_serial()
    layer_types, window = HYBRID_CHECK[arch]
    model = _model(arch, "cpu", layers=3, layer_types=layer_types, sliding_window=window)
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
    # which code the pieces run does not change what is captured: no Inductor here, to keep CI short
    _assert_same_tokens(_generate_both(model, (1, 3), 12, "cpu", {"compiler": "eager"}, **kwargs))
    share = _decode_calls_graphed(start, (1, 3), 12)
    assert share >= 0.9, [g.stats.summary() for g in graphs_since(start)]


@pytest.mark.usefixtures("emulated_graphs")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_with_dynamic_true_gives_eager_tokens(arch):
    """``dynamic=True`` (which the README offers) makes every float attribute (norm eps, attention
    scaling) a CPU scalar input: their values join the shape key, and the graphs replay."""
    torch._dynamo.reset()
    start = last_serial()
    _assert_same_tokens(_generate_both(_model(arch, "cpu"), (1, 3), 8, "cpu", dynamic=True))
    decode = busiest_graph(start)
    assert decode.stats.replays > 0 and decode.stats.ungraphed_runs == 0, decode.stats.summary()


@pytest.mark.usefixtures("emulated_graphs")
def test_dynamic_true_warmed_at_batches_1_and_2_compiles_nothing_for_other_batches_or_lengths():
    """README's recipe for one compile for all sizes (the dynamic cache): Dynamo keeps size 1 apart
    from the others (its 0/1 specialisation, ``dynamic=True`` or not), so batch 1 and the first
    batch above it compile each (prefill, the first decode step, the later ones: 3 new tokens or
    more); after both, no batch size or ``max_new_tokens`` compiles again."""
    torch._dynamo.reset()
    first = last_serial()
    both = _compiled_and_eager(_model("qwen2", "cpu"), dynamic=True)
    warm = [both(1, 4), both(2, 4)]  # start-up: prefill, first and later decode steps, at 1 and at 2
    start = last_serial()
    later = [both(batch, tokens) for batch, tokens in ((5, 6), (3, 12), (1, 9), (8, 4))]
    _assert_same_tokens(warm + later)
    assert graphs_since(start) == [], [g.stats.summary() for g in graphs_since(start)]
    # the README's fast-call switch once warmed: Dynamo checks only the guards that tell its graphs
    # apart (batch 1 from the others); every batch still gets eager's tokens
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        _assert_same_tokens([both(batch, tokens) for batch, tokens in ((3, 5), (1, 7), (6, 4))])
    decode = max((g for g in graphs_since(first) if g.pad_position is not None), key=lambda g: g.stats.calls)
    assert decode.stats.replays > 0 and decode.stats.ungraphed_runs == 0, decode.stats.summary()


@pytest.mark.usefixtures("emulated_graphs")
def test_specialize_float_spares_dynamo_its_restarts_with_dynamic_true(monkeypatch):
    """README's warm-start advice: under ``dynamic=True`` Dynamo traces transformers' float
    attributes (norm ``eps``, RoPE scaling) as symbols, Inductor cannot turn some into tensors, and
    each such compile makes Dynamo trace the whole frame again (``TensorifyScalarRestartAnalysis``;
    3 of 9 traces for a 4-layer Qwen3 on CPU, warm or cold). ``specialize_float=True`` while
    compiling keeps floats constants: no restart, eager's tokens, and still one compile for all
    batch sizes after batch 1 and 2."""
    import torch._dynamo.exc as dynamo_exc

    restarts = []
    restart_init = dynamo_exc.TensorifyScalarRestartAnalysis.__init__

    def counting_init(self, *args, **kwargs):
        restarts.append(1)
        restart_init(self, *args, **kwargs)

    monkeypatch.setattr(dynamo_exc.TensorifyScalarRestartAnalysis, "__init__", counting_init)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(specialize_float=True):  # read while Dynamo traces: the calls' time
        both = _compiled_and_eager(_model("qwen3", "cpu"), dynamic=True)
        warm = [both(1, 4), both(2, 4)]
        start = last_serial()
        later = [both(3, 6)]
    _assert_same_tokens(warm + later)
    assert restarts == []
    assert graphs_since(start) == [], [g.stats.summary() for g in graphs_since(start)]


@pytest.mark.usefixtures("emulated_graphs")
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_beam_search_gives_eager_tokens(cache):
    """Beam search reorders the cache between steps (``index_select`` on the batch dim, outside the
    graph). The dynamic cache's graphs replay. The static cache becomes new tensors at every step,
    and the graph writes them in place, at their own addresses: a new set of graphs per step up to
    ``max_weight_sets``, then un-graphed, with one warning naming the moved cache."""
    torch._dynamo.reset()
    start = last_serial()
    model = _model("llama", "cpu")
    ids = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    kwargs = {"num_beams": 2, **({"cache_implementation": "static"} if cache == "static" else {})}
    theirs = _generate(model, ids, 10, **kwargs)
    model.forward = torch.compile(model.forward, backend="piecewise", options=INLINE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            mine = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=0, **kwargs
            )
    assert torch.equal(mine, theirs)
    graphs = graphs_since(start)
    if cache == "dynamic":
        assert sum(g.stats.replays for g in graphs) > 0
        assert sum(g.stats.ungraphed_runs for g in graphs) == 0, [g.stats.summary() for g in graphs]
    else:
        assert any(g.stats.misses[Miss.WEIGHTS_MOVED] for g in graphs), [g.stats.summary() for g in graphs]
        assert [w for w in caught if "layers_0_keys" in str(w.message) and "max_weight_sets" in str(w.message)]


@pytest.mark.usefixtures("emulated_graphs")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_many_generate_calls_with_the_static_cache_keep_replaying(device):
    """transformers makes a new static cache per ``generate()``: new addresses for the decode graph's
    written inputs at every call (kept apart here by holding each call's cache). Past
    ``max_weight_sets`` the decode graph used to run un-graphed for good; now each call's first decode
    step runs un-graphed and the rest replay."""
    torch._dynamo.reset()
    start = last_serial()
    model = _model("llama", device)
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(0)).to(device)
    theirs = _generate(model, ids, 8, cache_implementation="static")
    model.forward = torch.compile(model.forward, backend="piecewise", options=INLINE)
    kept, replays = [], []
    for _ in range(7):
        out = _generate(model, ids, 8, cache_implementation="static", return_dict_in_generate=True)
        assert torch.equal(out.sequences, theirs)
        kept.append(out.past_key_values)  # its cache stays alive: the next call's is elsewhere
        decode = busiest_graph(start)
        replays.append(decode.stats.replays)
    assert all(later - earlier >= 5 for earlier, later in zip(replays, replays[1:])), (replays, decode.stats.summary())
    assert decode.stats.weight_sets == 7 and decode.stats.weight_sets_replaced == 3, decode.stats.summary()
    assert decode.stats.misses[Miss.WEIGHTS_MOVED] == 3, decode.stats.summary()


@pytest.mark.usefixtures("emulated_graphs")
def test_a_second_generate_with_a_new_static_cache_length_is_served_by_graphs():
    """``generate(max_new_tokens=n)`` with the static cache and no ``max_cache_len``: each call's cache
    is new, at new addresses and ``prompt + n`` long. Dynamo compiles again for the second length (the
    length a symbol from then on), and the second and third calls' decode steps are graphed: all but
    each call's first decode step, which meets the new graph or the new cache."""
    torch._dynamo.reset()
    start = last_serial()
    model = _model("granite", "cpu")
    model.generation_config.eos_token_id = None  # every call makes all its tokens
    eager_forward = model.forward
    compiled = torch.compile(eager_forward, backend="piecewise", options={"compiler": "eager", **INLINE})
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    for new_tokens in (4, 16, 10):
        model.forward = eager_forward
        theirs = _generate(model, ids, new_tokens, cache_implementation="static")
        model.forward = compiled
        served = {g.serial: sum(g.stats.graph_calls.values()) for g in graphs_since(start)}
        assert torch.equal(_generate(model, ids, new_tokens, cache_implementation="static"), theirs)
        graphs = graphs_since(start)
        now_served = sum(sum(g.stats.graph_calls.values()) - served.get(g.serial, 0) for g in graphs)
        # a prefill and new_tokens - 1 decode steps, all but one of them graphed at least
        assert now_served >= new_tokens - 1, [g.stats.summary() for g in graphs]


@pytest.mark.usefixtures("emulated_graphs")
def test_static_cache_after_dynamic_cache_in_one_process_replays():
    """A user's order: ``generate()`` with the dynamic cache, then with the static one, no Dynamo reset.
    Dynamo has seen the window's cache grow, so the static window's length (5) comes as a symbol; taken
    for the batch (the first dynamic dim of the first input), it was refused padding and, not being a
    capture size, every decode step ran un-graphed."""
    torch._dynamo.reset()
    model = _model("mistral", "cpu")
    _assert_same_tokens(_generate_both(model, (1,), 16, "cpu"))
    start = last_serial()
    _assert_same_tokens(_generate_both(model, (1,), 16, "cpu", cache_implementation="static"))
    graphs = graphs_since(start)
    assert sum(g.stats.replays for g in graphs) > 0
    assert sum(g.stats.ungraphed_runs for g in graphs) == 0, [g.stats.summary() for g in graphs]


@pytest.mark.usefixtures("emulated_graphs")
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_left_padded_prompts_of_different_lengths_give_eager_tokens(cache):
    """Batched prompts of different lengths, padded on the left (the attention mask has zeros): the
    mask reaches attention each step, and the decode steps replay."""
    torch._dynamo.reset()
    start = last_serial()
    model = _model("llama", "cpu")
    ids = torch.randint(1, 256, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = mask[2, :2] = 0
    ids[mask == 0] = 0
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
    theirs = _generate(model, ids, 12, attention_mask=mask, **kwargs)
    model.forward = torch.compile(model.forward, backend="piecewise", options=INLINE)
    assert torch.equal(_generate(model, ids, 12, attention_mask=mask, **kwargs), theirs)
    assert sum(g.stats.replays for g in graphs_since(start)) > 0


@pytest.mark.usefixtures("emulated_graphs")
def test_sliding_window_static_cache_decode_step_is_one_compute_piece():
    """A window not yet full (the usual case: Mistral's is 4,096 tokens): each layer adds to a Python
    int, ``cumulative_length_int``, which only transformers reads back. Those adds run in the eager
    prologue; before, each one cut the step's graph (3 compute pieces for 2 layers)."""
    config, cls = _config("mistral", 2, 64)
    config.sliding_window = 64
    torch.manual_seed(0)
    torch._dynamo.reset()
    start = last_serial()
    _assert_same_tokens(_generate_both(cls(config).eval(), (1, 3), 8, "cpu", cache_implementation="static"))
    decode = [g for g in graphs_since(start) if g.stats.replays > 0]
    assert len(decode) == 2 and all(g.stats.num_compute_pieces == 1 for g in decode), [
        g.stats.summary() for g in decode
    ]


@pytest.mark.usefixtures("emulated_graphs")
def test_attention_written_as_matmuls_does_not_capture_a_graph_per_step():
    """Gemma 2's default attention is matmuls, not SDPA: with the dynamic cache the KV length is in
    the compute pieces, so every decode step was a new shape, captured and never replayed."""
    torch._dynamo.reset()
    start = last_serial()
    model = _model("gemma2", "cpu")
    assert model.config._attn_implementation == "eager"
    _assert_same_tokens(_generate_both(model, (1, 3), 16, "cpu", {"max_unreplayed_captures": 4}))
    graphs = graphs_since(start)
    stopped = [g for g in graphs if g.stats.misses[Miss.NEVER_REPLAYED]]
    assert stopped and all(len(g.captured) <= 4 for g in stopped), [g.stats.summary() for g in graphs]
    assert "never replayed" in stopped[0].stats.summary()
    # the warning's other way out: the static cache's shapes are fixed, so its decode steps replay
    torch._dynamo.reset()  # Dynamo's recompile limit would stop a third set of graphs for forward
    start = last_serial()
    _assert_same_tokens(_generate_both(model, (1, 3), 16, "cpu", cache_implementation="static"))
    graphs = graphs_since(start)
    assert sum(g.stats.replays for g in graphs) > 0
    assert not any(g.stats.misses[Miss.NEVER_REPLAYED] for g in graphs), [g.stats.summary() for g in graphs]


@pytest.mark.usefixtures("emulated_graphs")
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_256_new_tokens_without_a_recompile_warning(cache, caplog):
    torch._dynamo.reset()
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        _assert_same_tokens(_generate_both(_model("llama", "cpu", layers=1), (2,), 256, "cpu", **kwargs))
    assert not [r for r in caplog.records if "recompile" in r.getMessage()], caplog.text


@pytest.mark.usefixtures("emulated_graphs")
def test_a_static_cache_sized_by_max_cache_len_serves_a_longer_generate_without_a_new_graph():
    """README: ``max_cache_len`` sizes the static cache once, so a later ``generate()`` with more new
    tokens reuses it: a capture at most, no compile (without it the cache grows and Dynamo recompiles)."""
    torch._dynamo.reset()
    model = _model("llama", "cpu", layers=1)
    eager_forward = model.forward
    compiled = torch.compile(eager_forward, backend="piecewise", options=INLINE)
    ids = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    for new_tokens in (4, 12):
        start = last_serial()
        model.forward = compiled
        mine = _generate(model, ids, new_tokens, cache_implementation="static", max_cache_len=48)
        model.forward = eager_forward
        assert torch.equal(mine, _generate(model, ids, new_tokens, cache_implementation="static", max_cache_len=48))
    assert graphs_since(start) == []  # the second generate() compiled nothing


@pytest.mark.usefixtures("emulated_graphs")
def test_a_new_batch_size_with_the_static_cache_is_a_capture_not_a_compile():
    """transformers makes a static cache per batch size, its batch dim the batch's. The decode rewrite
    read that dim as an int, so Dynamo's automatic dynamic batch was specialised again (a guard
    ``s == 2`` from the rewrite) and every new batch size recompiled. Now, after the start-up calls at
    batch 1 and 2, later sizes compile nothing; each is captured at its own size (the cache, used in
    place, has no rows to pad into), with eager's tokens."""
    torch._dynamo.reset()
    model = _model("llama", "cpu", layers=1)
    eager_forward = model.forward
    compiled = torch.compile(eager_forward, backend="piecewise", options=INLINE)
    g = torch.Generator().manual_seed(0)
    first = last_serial()
    for batch in (1, 2, 4, 3):
        start = last_serial()
        ids = torch.randint(0, 256, (batch, PROMPT), generator=g)
        model.forward = compiled
        mine = _generate(model, ids, 5, cache_implementation="static", max_cache_len=32)
        model.forward = eager_forward
        assert torch.equal(mine, _generate(model, ids, 5, cache_implementation="static", max_cache_len=32))
        if batch > 2:
            assert graphs_since(start) == [], f"batch {batch} compiled again"
    decode = busiest_graph(first)
    assert {key[decode.pad_position] for key in decode.stats.captured_keys} == {2, 3, 4}, decode.stats.summary()
    assert decode.stats.ungraphed_runs == 0, decode.stats.summary()
    assert "is used in place and has the batch size" in decode.stats.padding, decode.stats.padding


@pytest.mark.usefixtures("emulated_graphs")
def test_transformers_compile_config_route():
    """``CompileConfig(backend="piecewise")``: transformers compiles the decode steps itself (its default
    mode, "reduce-overhead", is what the backend does anyway) and runs the prefill eagerly."""
    torch._dynamo.reset()
    start = last_serial()
    model = _model("llama", "cpu")
    config = transformers.CompileConfig(backend="piecewise")
    config._compile_all_devices = True  # transformers compiles on CUDA only, unless told (its own test hook)
    ids = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    mine = _generate(model, ids, 8, cache_implementation="static", compile_config=config)
    model.generation_config.disable_compile = True
    theirs = _generate(model, ids, 8, cache_implementation="static")
    assert torch.equal(mine, theirs)
    _assert_static_decode_is_one_graph(start)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the README says of CPU")
def test_the_readmes_compile_config_line_runs_eager_on_cpu_as_the_readme_says():
    """README: transformers compiles through ``compile_config`` on CUDA only. Run exactly as written on
    CPU (no private flag), generate() gives eager's tokens and the backend compiled nothing."""
    torch._dynamo.reset()
    start = last_serial()
    model = _model("llama", "cpu", layers=1)
    ids = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    mine = _generate(
        model, ids, 4, cache_implementation="static", compile_config=transformers.CompileConfig(backend="piecewise")
    )
    assert graphs_since(start) == []
    model.generation_config.disable_compile = True
    assert torch.equal(mine, _generate(model, ids, 4, cache_implementation="static"))


@pytest.mark.cuda
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_llama_generate_on_cuda_gives_eager_tokens(cache):
    # the configuration that hit a device-side assert (8 layers, hidden 512, GQA), batch sizes changing
    torch._dynamo.reset()
    start = last_serial()
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
    _assert_same_tokens(_generate_both(_model("llama", "cuda", 8, 512), (1, 4, 3), 16, "cuda", **kwargs))
    if cache == "static":
        _assert_static_decode_is_one_graph(start)
    else:
        _assert_dynamic_cache_replays(start)


@pytest.mark.cuda
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_eight_layer_decode_steps_on_cuda_compile_layer_by_layer_with_eager_tokens(cache, caplog):
    """Mistral (a sliding window shorter than the text), 8 layers: where the decode step is one piece
    it is compiled layer by layer (``layer_chain.py``), never falling back to a whole compile (with
    transformers 5.17's dynamic cache it did: ``KeyError: s86``, a cache view's storage offset)."""
    torch._dynamo.reset()
    start = last_serial()
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
    with caplog.at_level(logging.INFO, logger="piecewise_backend"):
        _assert_same_tokens(_generate_both(_model("mistral", "cuda", 8, 256), (1, 3), 16, "cuda", **kwargs))
    assert not [r.getMessage() for r in caplog.records if "layer by layer failed" in r.getMessage()]
    decode = busiest_graph(start)
    assert decode.stats.replays > 0 and decode.stats.ungraphed_runs == 0, decode.stats.summary()


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["gpt2", "mistral", "qwen3", "phi3"])
def test_other_architectures_on_cuda_give_eager_tokens(arch):
    for kwargs in ({}, {"cache_implementation": "static"}):
        torch._dynamo.reset()  # else Dynamo's recompile limit may leave the second cache's calls eager
        start = last_serial()
        _assert_same_tokens(_generate_both(_model(arch, "cuda", 4, 256), (1, 3), 16, "cuda", **kwargs))
        if arch in ("qwen3", "phi3"):
            assert busiest_graph(start).stats.replays > 0, busiest_graph(start).stats.summary()
    if arch == "mistral":  # its static cache's decode graph is dynamic in the batch
        decode = busiest_graph(start)
        assert decode.stats.replays > 0 and decode.stats.ungraphed_runs == 0, decode.stats.summary()
        # a graph left un-graphed says why (transformers 5.17: a prefill reading a CPU counter)
        for g in graphs_since(start):
            assert not g.stats.ungraphed_runs or g.stats.graphs_disabled_reason or g.stats.miss_details, (
                g.stats.summary()
            )


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["gemma3", "olmo3", "exaone4", "llama-dynamic-true"])
def test_hybrid_attention_and_dynamic_true_on_cuda_give_eager_tokens(arch):
    """On the GPU: the sliding/full-attention models with the dynamic cache, and Llama compiled with
    ``dynamic=True`` (its float attributes are CPU scalars there: they must not turn graphs off)."""
    torch._dynamo.reset()
    start = last_serial()
    dynamic = arch.endswith("-dynamic-true")
    model = _model(arch.removesuffix("-dynamic-true"), "cuda")
    _assert_same_tokens(_generate_both(model, (1, 3), 10, "cuda", dynamic=True if dynamic else None))
    decode = busiest_graph(start)
    assert decode.stats.replays > 0 and decode.stats.ungraphed_runs == 0, decode.stats.summary()
    assert decode.stats.graphs_disabled_reason is None, decode.stats.summary()


@pytest.mark.cuda
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_the_hybrid_check_on_cuda_all_sliding_gemma3(cache):
    """:data:`HYBRID_CHECK`'s Gemma 3 on the GPU, with Inductor: eager's tokens (fp32), nine in ten
    decode calls served by graphs."""
    torch._dynamo.reset()
    start = last_serial()
    layer_types, window = HYBRID_CHECK["gemma3"]
    model = _model("gemma3", "cuda", layers=3, layer_types=layer_types, sliding_window=window)
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
    _assert_same_tokens(_generate_both(model, (1, 3), 12, "cuda", **kwargs))
    assert _decode_calls_graphed(start, (1, 3), 12) >= 0.9, [g.stats.summary() for g in graphs_since(start)]


@pytest.mark.usefixtures("emulated_graphs")
def test_backed_size_oblivious_with_the_static_cache_compiles_and_gives_eager_tokens():
    """torch's experimental ``backed_size_oblivious`` (no 0/1 specialization), ``dynamic=True``, the
    static cache sized by ``max_cache_len``. Was: ``cycle exists between partitions!`` from
    split_module (a size the data decides crossed into the piece that binds it). Now eager's tokens.
    (Run alone on torch 2.13, new batch sizes after the first two calls compiled nothing; in the
    whole suite, or on torch 2.11, some did: Dynamo's own state decides, so it is not asserted.)"""
    import torch.fx.experimental._config as fx_config

    torch._dynamo.reset()
    model = _model("llama", "cpu", layers=1)
    eager_forward = model.forward
    compiled = torch.compile(eager_forward, backend="piecewise", options=INLINE, dynamic=True)
    with fx_config.patch(backed_size_oblivious=True):
        for batch, new_tokens in ((1, 3), (2, 3), (4, 6), (3, 5)):
            ids = torch.randint(0, 256, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
            model.forward = compiled
            mine = _generate(model, ids, new_tokens, cache_implementation="static", max_cache_len=32)
            model.forward = eager_forward
            assert torch.equal(mine, _generate(model, ids, new_tokens, cache_implementation="static", max_cache_len=32))


@pytest.mark.usefixtures("emulated_graphs")
def test_the_default_captures_behind_generate_and_the_next_generate_replays():
    """The default, captures behind the calls: a first ``generate()`` at a batch size is served while its
    graphs are captured behind it; after the thread is done, the next replays them; eager's tokens."""
    import piecewise_backend

    torch._dynamo.reset()
    start = last_serial()
    model = _model("llama", "cpu")
    eager_forward = model.forward
    compiled = torch.compile(eager_forward, backend="piecewise")
    ids = torch.randint(0, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    expected = _generate(model, ids, 6)
    model.forward = compiled
    try:
        first = _generate(model, ids, 6)
        assert piecewise_backend.wait_for_captures(timeout=120)
        replays = sum(g.stats.replays for g in graphs_since(start))
        second = _generate(model, ids, 6)
    finally:
        model.forward = eager_forward
    assert torch.equal(first, expected) and torch.equal(second, expected)
    graphs = graphs_since(start)
    behind = [
        g for g in graphs if g.decisions.inline[GraphMode.PIECEWISE] is None
    ]  # (one that draws random numbers: inline)
    assert sum(g.stats.captures_behind for g in behind) > 0 and sum(g.stats.replays for g in graphs) > replays
    assert all(g.stats.request_path_capture_seconds == 0 and g.stats.failed_captures == 0 for g in behind), [
        g.stats.summary() for g in graphs
    ]
