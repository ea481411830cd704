"""The SDPA kernels eager attention runs with (``eager_sdpa_backends``, ``runtime/sdpa_backends.py``).

On CPU the flags change no kernel, but they are the same process-wide switches: each test puts a
probe in an eager attention piece and reads the switches there, during a real call, and after it.
``"auto"`` concerns cuDNN, a CUDA kernel: on CPU it acts only with graphs emulated.
"""

import pytest
import torch

import piecewise_backend
from piecewise_backend.kinds import PieceKind
from piecewise_backend.runtime.sdpa_backends import NAMES, SdpaBackends
from toys.models import ToyConfig, ToyLlama, ToyStaticCacheLlama

from .helpers import SPLIT_ATTENTION, assert_results_close, busiest_graph, compile_with_reference, decode_at_sizes

CFG = ToyConfig(layers=2, max_batch=8, max_seq=32)
_flags = {
    "flash": torch.backends.cuda.flash_sdp_enabled,
    "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
    "math": torch.backends.cuda.math_sdp_enabled,
    "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
}


def _enable(name: str, on: bool) -> None:
    getattr(torch.backends.cuda, "enable_mem_efficient_sdp" if name == "efficient" else f"enable_{name}_sdp")(on)


def _switches() -> dict:
    return {name: get() for name, get in _flags.items()}


def _probe_attention_pieces(graph) -> list:
    """Record the switches each time an eager attention piece of ``graph`` runs."""
    seen = []
    gm = graph.split_module  # the copy whose pieces the compiled graph calls
    for spec in graph.pieces:
        if spec.kind == PieceKind.SPLIT:
            run = gm.__dict__[spec.name]
            gm.__dict__[spec.name] = lambda *a, run=run: (seen.append(_switches()), run(*a))[1]
    return seen


def _decode_and_probe(model_cls, options, static_cache=False):
    with piecewise_backend.emulated_graphs(), torch.no_grad():  # read when the graphs compile, at their first call
        compiled, reference, start = compile_with_reference(model_cls, CFG, options)
        results = decode_at_sizes(compiled, reference, (3, 3), static_cache=static_cache)
        graph = busiest_graph(start)
        seen = _probe_attention_pieces(graph)
        results += decode_at_sizes(compiled, reference, (3,), static_cache=static_cache, start_pos=2)
    assert_results_close(results)
    return graph, seen


@pytest.fixture
def torch_defaults():
    """Every backend on (torch's default), and put back whatever a test changed."""
    before = _switches()
    for name in NAMES:
        _enable(name, True)
    yield
    for name, value in before.items():
        _enable(name, value)


def test_auto_turns_cudnn_off_while_kv_lengths_change_and_restores_it(torch_defaults):
    graph, seen = _decode_and_probe(ToyLlama, SPLIT_ATTENTION)
    assert seen and all(s == {"flash": True, "efficient": True, "math": True, "cudnn": False} for s in seen), seen
    assert _switches()["cudnn"], "the caller's cuDNN setting was not restored"
    assert "cuDNN attention off" in graph.stats.summary() and "new KV length" in graph.stats.eager_sdpa


def test_auto_leaves_torch_to_choose_where_kv_lengths_are_fixed(torch_defaults):
    """The static cache is attended whole: one shape per batch size, which cuDNN plans once (kept eager
    here: by default such attention is compiled with its piece)."""
    graph, seen = _decode_and_probe(ToyStaticCacheLlama, SPLIT_ATTENTION, static_cache=True)
    assert graph.plan.sdpa_choice is None and graph.stats.eager_sdpa == ""
    assert seen and all(s["cudnn"] for s in seen), seen


def test_auto_leaves_the_switches_alone_on_a_cpu_graph(torch_defaults):
    compiled, reference, start = compile_with_reference(ToyLlama, CFG, SPLIT_ATTENTION)  # not emulated
    with torch.no_grad():
        assert_results_close(decode_at_sizes(compiled, reference, (3, 3)))
    graph = busiest_graph(start)
    assert graph.plan.sdpa_choice is None and "cuDNN" not in graph.stats.summary(), graph.stats.summary()


def test_torch_option_leaves_the_switches_alone(torch_defaults):
    graph, seen = _decode_and_probe(ToyLlama, {**SPLIT_ATTENTION, "eager_sdpa_backends": "torch"})
    assert graph.plan.sdpa_choice is None and seen and all(s["cudnn"] for s in seen)


def test_a_list_enables_exactly_those_backends_during_the_call(torch_defaults):
    graph, seen = _decode_and_probe(ToyLlama, {**SPLIT_ATTENTION, "eager_sdpa_backends": ["math"]})
    assert seen and all(s == {"flash": False, "efficient": False, "math": True, "cudnn": False} for s in seen), seen
    assert all(_switches().values()), "the caller's settings were not restored"


def test_auto_never_turns_off_the_only_backend_the_caller_left_on(torch_defaults):
    for name in ("flash", "efficient", "math"):
        _enable(name, False)
    during = SdpaBackends({"cudnn": False}, "auto").call(_switches, ())
    assert during["cudnn"] and _switches()["cudnn"], during


@pytest.mark.parametrize("value", ["fast", [], ["flash", "tensor_cores"], 3])
def test_bad_values_name_what_is_accepted(value):
    with pytest.raises(ValueError, match="'eager_sdpa_backends' must be 'auto', 'torch' or a non-empty list"):
        piecewise_backend.PiecewiseConfig.from_options({"eager_sdpa_backends": value})


def _attention_ops(run) -> set:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return {e.key for e in prof.key_averages() if "attention" in e.key}


@pytest.mark.cuda
def test_gpu_eager_attention_never_runs_cudnn_while_kv_lengths_grow(torch_defaults):
    """torch's default order may pick cuDNN attention, which plans every new KV length (~9 ms of host
    time each on the H200). The compiled model's eager attention runs another kernel and still
    matches eager."""
    cfg = ToyConfig(layers=2, max_batch=8, max_seq=64, hidden=128, heads=2)
    compiled, reference, start = compile_with_reference(ToyLlama, cfg, SPLIT_ATTENTION, device="cuda")
    g = torch.Generator().manual_seed(0)
    calls = [(torch.randint(0, cfg.vocab, (b, 1), generator=g).cuda(), pos) for pos, b in enumerate((2, 2, 4, 4, 4))]
    warm, timed = calls[:2], calls[2:]  # Dynamo's first graph has the length fixed (pos = 0): torch's choice
    with torch.no_grad():
        expected = [reference(ids, pos).clone() for ids, pos in calls]
        eager_ops = _attention_ops(lambda: [reference(ids, pos) for ids, pos in timed])
        actual = [compiled(ids, pos).clone() for ids, pos in warm]
        compiled_ops = _attention_ops(lambda: actual.extend(compiled(ids, pos).clone() for ids, pos in timed))
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=1e-3, rtol=1e-3)
    assert not [op for op in compiled_ops if "cudnn" in op], (compiled_ops, "eager itself ran", eager_ops)
    assert "cuDNN attention off" in busiest_graph(start).stats.eager_sdpa
