"""Parameters and buffers that get a new address after their graphs were captured.

Graphs read weights in place, so a weight replaced through ``.data``, ``load_state_dict(assign=True)``
or a second model's weights passed to the same compiled function must not replay the old
addresses, and must never be copied into the tensors captured before: those belong to the user.
Each set of addresses gets graphs of its own (``weight_sets.py``), up to ``max_weight_sets``; a
buffer the graph writes (a KV cache) is written at its new address. On CPU with emulated graphs,
against an eager copy treated the same way.
"""

import warnings

import pytest
import torch

import piecewise_backend
from piecewise_backend.kinds import Miss
from toys.models import ToyConfig, ToyLlama

from .helpers import (
    assert_results_close,
    busiest_graph,
    compile_with_reference,
    decode_at_sizes,
    graphs_since,
    last_serial,
)

CFG = ToyConfig(layers=2, max_batch=4, max_seq=32)
SIZES = [2, 4, 8]
pytestmark = pytest.mark.usefixtures("emulated_graphs")


def test_a_weight_replaced_through_data_gets_graphs_of_its_own_and_one_warning():
    compiled, reference, start = compile_with_reference(ToyLlama, CFG, {"capture_sizes": [2, 4]})
    results = decode_at_sizes(compiled, reference, (2, 2))
    old = compiled._orig_mod.layers[0].mlp.up.weight.data
    old_copy = old.clone()
    new_weight = torch.randn_like(reference.layers[0].mlp.up.weight)
    for model in (compiled._orig_mod, reference):  # a new tensor, same shape: no recompile
        model.layers[0].mlp.up.weight.data = new_weight.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results += decode_at_sizes(compiled, reference, (2, 2, 2), start_pos=4)
    assert_results_close(results)  # the replays use the new weight
    assert torch.equal(old, old_copy)  # and nothing was copied into the old one
    moved = [str(w.message) for w in caught if "new addresses" in str(w.message)]
    assert len(moved) == 1, [str(w.message) for w in caught]
    assert "layers_modules_0_modules_mlp_modules_up_parameters_weight" in moved[0], moved  # names what moved
    graph = busiest_graph(start)
    assert graph.stats.weight_sets == 2 and graph.stats.replays > 0 and not graph.stats.failed_captures


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).eval()


def _calls(compiled, net, sizes=(3, 4)):
    for size in sizes:
        x = torch.randn(size, 16)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), net(x))
        piecewise_backend.wait_for_captures()  # its size's graphs (captured behind it) in before the next call


def test_load_state_dict_assign_recaptures_and_never_writes_the_old_parameters():
    torch._dynamo.reset()
    start = last_serial()
    net = _mlp(0)
    compiled = torch.compile(net, backend="piecewise", options={"capture_sizes": SIZES})
    _calls(compiled, net)
    old = [p for p in net.parameters()]
    before = [p.detach().clone() for p in old]
    net.load_state_dict({k: torch.randn_like(v) for k, v in net.state_dict().items()}, assign=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _calls(compiled, net)
        _calls(compiled, net)
    for p, saved in zip(old, before):
        assert torch.equal(p, saved)  # the tensors the user held are unchanged
    graph = busiest_graph(start)
    assert graph.stats.weight_sets == 2 and "parameters moved" in graph.stats.summary()
    assert graph.captured == {(4,)} and graph.stats.replays > 0
    moved = [w for w in caught if "new addresses" in str(w.message)]
    assert len(moved) == 1, [str(w.message) for w in caught]


def test_with_dynamos_module_guards_skipped_moved_weights_still_get_graphs_of_their_own():
    """``guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe`` (fewer guards per call):
    Dynamo no longer checks the module, and this backend's own address check still sees new weights."""
    torch._dynamo.reset()
    start = last_serial()
    net = _mlp(0)
    compiled = torch.compile(
        net,
        backend="piecewise",
        options={"capture_sizes": SIZES, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
    )
    _calls(compiled, net)
    net.load_state_dict({k: torch.randn_like(v) for k, v in net.state_dict().items()}, assign=True)
    with pytest.warns(UserWarning, match="are at new addresses"):
        _calls(compiled, net)  # eager's outputs with the new weights
    graph = busiest_graph(start)
    assert len(graphs_since(start)) == 1 and graph.stats.weight_sets == 2 and graph.stats.replays > 0


def test_one_compiled_function_alternating_two_models_weights():
    torch._dynamo.reset()
    start = last_serial()
    a, b = _mlp(1), _mlp(2)
    saved = {id(p): p.detach().clone() for net in (a, b) for p in net.parameters()}
    compiled = torch.compile(lambda net, x: net(x), backend="piecewise", options={"capture_sizes": SIZES})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            for net in (a, b):
                _calls(lambda x: compiled(net, x), net)
    for net in (a, b):
        for p in net.parameters():
            assert torch.equal(p, saved[id(p)])
    graph = busiest_graph(start)
    assert graph.stats.weight_sets == 2
    assert graph.stats.replays > 0 and not graph.stats.misses[Miss.WEIGHTS_MOVED]


def test_weights_past_max_weight_sets_run_ungraphed_with_one_warning():
    torch._dynamo.reset()
    start = last_serial()
    nets = [_mlp(seed) for seed in (3, 4, 5)]
    compiled = torch.compile(
        lambda net, x: net(x), backend="piecewise", options={"capture_sizes": SIZES, "max_weight_sets": 2}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for net in nets:
                _calls(lambda x: compiled(net, x), net, sizes=(4,))
    graph = busiest_graph(start)
    assert graph.stats.misses[Miss.WEIGHTS_MOVED] == 2  # the third model, twice
    assert "max_weight_sets=2" in graph.stats.miss_details[Miss.WEIGHTS_MOVED]
    assert "and 3 more" in graph.stats.miss_details[Miss.WEIGHTS_MOVED]  # a new net: its 4 weights moved
    assert len([w for w in caught if "max_weight_sets=2" in str(w.message)]) == 1


def test_a_replaced_kv_cache_gets_graphs_that_write_the_new_one():
    compiled, reference, start = compile_with_reference(ToyLlama, CFG, {"capture_sizes": [2, 4]})
    results = decode_at_sizes(compiled, reference, (2, 2))
    old = compiled._orig_mod.layers[1].attn.k_cache
    old_copy = old.clone()
    for model in (compiled._orig_mod, reference):
        model.layers[1].attn.k_cache = model.layers[1].attn.k_cache.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results += decode_at_sizes(compiled, reference, (2, 2), start_pos=4)
    assert_results_close(results)
    assert torch.equal(old, old_copy)  # the graphs write the new cache, not the one they were captured with
    torch.testing.assert_close(compiled._orig_mod.layers[1].attn.k_cache, reference.layers[1].attn.k_cache)
    graph = busiest_graph(start)
    assert graph.stats.weight_sets == 2 and not graph.stats.failed_captures


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_per_call_address_check_sees_a_weight_moved_through_data(device):
    """``WeightSets.unchanged``, the check every call makes: torch's C++ comparison on CUDA builds
    (the Python tuple elsewhere). Only the parameters'/buffers' addresses count."""
    from piecewise_backend.runtime.capture.weight_sets import WeightSets

    weight, buffer = torch.zeros(4, device=device), torch.zeros(4, device=device)
    args = (weight, 3, buffer, torch.ones(2, device=device))
    sets = WeightSets((0, 2), limit=4)
    if device == "cuda":
        assert sets._ptrs_equal is not None  # the C++ path is the one under test
    assert not sets.unchanged(args)  # no active set yet
    addresses = sets.addresses(args)
    sets.activate(addresses, sets.find(addresses))
    assert sets.unchanged(args) and sets.unchanged((weight, 4, buffer, torch.zeros(3, device=device)))
    buffer.data = torch.zeros(4, device=device)  # same tensor object, new memory
    assert not sets.unchanged(args) and sets.addresses(args) != addresses


def test_past_max_weight_sets_addresses_that_come_again_replace_the_least_recently_used_set():
    """A fourth ``generate()`` with a new static cache used to run un-graphed for good. Past the bound,
    a new set runs its first call un-graphed; when its addresses come again (no other set in between)
    it gets graphs in place of the least recently used set, whose graphs are dropped."""
    torch._dynamo.reset()
    start = last_serial()
    first, second, third = (_mlp(seed) for seed in (3, 4, 5))
    compiled = torch.compile(
        lambda net, x: net(x), backend="piecewise", options={"capture_sizes": SIZES, "max_weight_sets": 2}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for net in (first, second, third, third, third):
            _calls(lambda x: compiled(net, x), net, sizes=(4,))
    graph = busiest_graph(start)
    assert graph.stats.misses[Miss.WEIGHTS_MOVED] == 1  # the third net's first call
    assert graph.stats.weight_sets == 3 and graph.stats.weight_sets_replaced == 1
    assert "1 replaced" in graph.stats.summary()
    assert len(graph.weights) == 2  # the first net's graphs were dropped
    replays = graph.stats.replays
    _calls(lambda x: compiled(third, x), third, sizes=(4,))
    assert graph.stats.replays == replays + 1
    _calls(lambda x: compiled(first, x), first, sizes=(4,))  # dropped: un-graphed until it comes again
    assert graph.stats.misses[Miss.WEIGHTS_MOVED] == 2
    bound = [str(w.message) for w in caught if "max_weight_sets=2" in str(w.message)]
    assert len(bound) == 1 and "in place of the least recently used set" in bound[0], bound


def test_addresses_new_at_every_call_past_the_bound_stay_ungraphed():
    """Beam search's reordered static cache: new tensors at every step. Past the bound nothing is
    captured for them (a capture per call costs more than the run); every such call is counted."""
    torch._dynamo.reset()
    start = last_serial()
    nets = [_mlp(seed) for seed in range(6)]
    compiled = torch.compile(
        lambda net, x: net(x), backend="piecewise", options={"capture_sizes": SIZES, "max_weight_sets": 2}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for net in nets:
            _calls(lambda x: compiled(net, x), net, sizes=(4,))
    graph = busiest_graph(start)
    assert graph.stats.misses[Miss.WEIGHTS_MOVED] == 4 and graph.stats.weight_sets == 2
    assert graph.stats.weight_sets_replaced == 0
