"""Capture-policy logic without a GPU: options, schemes, bucket choice, lazy/eager, budgets."""

import pytest
import torch

from piecewise_backend import PiecewiseConfig
from piecewise_backend.config import scheme_sizes
from piecewise_backend.kinds import Miss
from piecewise_backend.runtime import memory_estimate
from piecewise_backend.runtime.capture import deferral as capture_deferral
from piecewise_backend.runtime.capture import traffic as capture_traffic
from piecewise_backend.runtime.capture.policy import CapturePolicy, Route
from piecewise_backend.runtime.capture.traffic import CaptureTraffic
from piecewise_backend.runtime.memory_estimate import GraphMemoryEstimate, fit


def test_default_scheme_is_vllms_67_sizes_up_to_512():
    sizes = scheme_sizes("default", 512)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-2:] == (504, 512)
    assert len(sizes) == 67 and all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))


def test_schemes_always_include_their_max():
    assert scheme_sizes("powers_of_two", 48) == (1, 2, 4, 8, 16, 32, 48)
    assert scheme_sizes("default", 12) == (1, 2, 4, 8, 12)


@pytest.mark.parametrize(
    "options,error,message",
    [
        ({"capture_sizes": "fibonacci"}, ValueError, "unknown capture scheme 'fibonacci'.*'default', 'powers_of_two'"),
        ({"capture_sizes": [4, -2]}, ValueError, r"'capture_sizes' holds \[-2\]; sizes must be ints >= 1"),
        ({"capture_sizes": [0]}, ValueError, "sizes must be ints >= 1"),
        ({"capture_sizes": [2.5]}, ValueError, "sizes must be ints >= 1"),
        ({"capture_sizes": []}, ValueError, "'capture_sizes' is empty"),
        ({"capture_sizes": 8}, TypeError, "must be a list of batch sizes"),
        ({"capture_sizes": [1, 2], "max_capture_size": 8}, ValueError, "contradicts capture_sizes"),
        ({"max_capture_size": 0}, ValueError, "'max_capture_size' must be an int >= 1"),
        ({"eager_capture_sizes": [3]}, ValueError, r"eager_capture_sizes \[3\] are not capture sizes"),
        ({"eager_capture_sizes": "some"}, ValueError, "must be a list of capture sizes or 'all'"),
        ({"max_graph_memory": -1}, ValueError, "'max_graph_memory' must be an int >= 0 or None"),
        ({"max_captured_sizes": 1.5}, ValueError, "'max_captured_sizes' must be an int"),
        ({"max_unreplayed_captures": 0}, ValueError, "'max_unreplayed_captures' must be an int >= 1 or None"),
        ({"mode": "whole"}, ValueError, "'mode' must be one of 'piecewise', 'full'"),
        ({"padding": 1}, TypeError, "'padding' must be True or False"),
    ],
)
def test_bad_capture_options_fail_with_a_fix(options, error, message):
    with pytest.raises(error, match=message):
        PiecewiseConfig.from_options(options)


def test_capture_options_are_normalised():
    cfg = PiecewiseConfig.from_options({"capture_sizes": [8, 2, 2, 4], "eager_capture_sizes": [2, 8]})
    assert cfg.sizes == (2, 4, 8) and cfg.largest_size == 8
    assert cfg.eager_sizes == (8, 2)  # largest first
    assert PiecewiseConfig.from_options({"max_capture_size": 64, "eager_capture_sizes": "all"}).eager_sizes[0] == 64


def _policy(pad_position=0, no_padding=None, **options):
    return CapturePolicy(PiecewiseConfig.from_options(options), pad_position, no_padding)


def test_bucket_is_the_next_capture_size():
    policy = _policy(capture_sizes=[1, 2, 4, 8, 16])
    assert [policy.bucket(n) for n in (1, 3, 4, 5, 9, 16, 17)] == [1, 4, 4, 8, 16, 16, None]


def test_plan_pads_captures_and_misses():
    policy = _policy(capture_sizes=[2, 4, 8])
    assert policy.route((3,), set(), lambda: 0) == policy.route((3,), set(), lambda: 0)
    route = policy.route((3,), set(), lambda: 0)
    assert (route.key, route.size, route.padded, route.capture) == ((4,), 3, True, True)
    route = policy.route((3,), {(4,)}, lambda: 0)
    assert (route.key, route.padded, route.capture) == ((4,), True, False)
    assert policy.route((9,), set(), lambda: 0).miss == Miss.ABOVE_MAX


def test_full_graphs_have_their_own_keys_padding_rule_and_fallback_reasons():
    """A full graph's padding may be refused where the pieces' is not (a splitting op the proof cannot
    see into): full calls then get exact sizes while piecewise calls pad; a refused graph and a failed
    key route to no full graph, saying why."""
    policy = CapturePolicy(
        PiecewiseConfig.from_options({"capture_sizes": [2, 4, 8], "defer_captures": False}),
        0,
        None,
        full_padding=("mylib::attention is a custom op ...", None),
    )
    assert policy.route((3,), set(), lambda: 0).key == (4,)
    full = policy.full_route((3,), {}, {}, lambda: 0, set(), None)
    assert (full.key, full.capture, full.padded, full.full) == ((3,), True, False, True)
    assert policy.full_route((3,), {(3,): "graph"}, {}, lambda: 0, set(), None).capture is False
    failed = policy.full_route((3,), {}, {(3,): "why"}, lambda: 0, set(), None)
    assert failed.key is None and failed.detail == "its capture failed"
    refused = policy.full_route((3,), {}, {}, lambda: 0, set(), "it holds an op tagged cudagraph_unsafe")
    assert refused.key is None and "cudagraph_unsafe" in refused.detail
    above = policy.full_route((9,), {}, {}, lambda: 0, set(), None)
    assert above.key is None and "largest capture size" in above.detail


def test_pad_position_leaves_other_dynamic_sizes_exact():
    policy = _policy(pad_position=1, capture_sizes=[2, 4, 8])
    assert policy.route((17, 3), set(), lambda: 0).key == (17, 4)


def test_lazy_off_pads_to_the_smallest_captured_size():
    policy = _policy(capture_sizes=[2, 4, 8], lazy_capture=False)
    assert policy.route((3,), {(8,)}, lambda: 0).key == (8,)
    assert policy.route((3,), {(2,)}, lambda: 0).miss == Miss.NOT_CAPTURED


def test_refused_padding_captures_each_size_as_it_is():
    policy = _policy(no_padding="x.sum(0) reduces over the batch", capture_sizes=[2, 4, 8])
    route = policy.route((3,), set(), lambda: 0)
    assert route.capture and route.key == (3,) and not route.padded
    assert policy.route((3,), {(3,)}, lambda: 0) == Route((3,), 3)
    assert policy.route((9,), set(), lambda: 0).miss == Miss.ABOVE_MAX


def test_padding_false_serves_capture_sizes_only():
    policy = _policy(padding=False, capture_sizes=[2, 4, 8])
    route = policy.route((3,), set(), lambda: 0)
    assert route.miss == Miss.NOT_A_CAPTURE_SIZE and "padding=False" in route.detail
    assert policy.route((4,), set(), lambda: 0).capture


def test_budget_refuses_by_count_and_by_measured_bytes():
    policy = _policy(capture_sizes=[2, 4, 8], max_captured_sizes=1)
    route = policy.route((4,), {(2,)}, lambda: 0)
    assert route.miss == Miss.OVER_BUDGET and "max_captured_sizes=1" in route.detail

    policy = _policy(capture_sizes=[2, 4, 8], max_graph_memory=100 * 2**20)
    assert policy.route((2,), set(), lambda: 0).capture  # nothing measured yet: allowed
    policy.budget.record(2, 30 * 2**20)  # size 2 grew the pool by 30 MiB: 15 MiB per row
    assert policy.route((4,), {(2,)}, lambda: 30 * 2**20).capture  # 30 + 60 <= 100
    route = policy.route((8,), {(2,), (4,)}, lambda: 90 * 2**20)  # 90 + 120 > 100
    assert route.miss == Miss.OVER_BUDGET and "90.0 MiB" in route.detail and "100.0 MiB" in route.detail


def test_new_shapes_stop_being_captured_while_earlier_ones_never_replayed():
    policy = CapturePolicy(
        PiecewiseConfig.from_options({"capture_sizes": [2, 4, 8], "max_unreplayed_captures": 3}),
        0,
        None,
        symbols=("s0", "s1"),
    )
    captured = {(2, 5), (2, 6), (2, 7)}
    assert policy.route((2, 8), captured, lambda: 0, unreplayed={(2, 6), (2, 7)}).capture  # 2 < 3: captures
    route = policy.route((2, 8), captured, lambda: 0, unreplayed=captured)
    assert route.key is None and route.miss == Miss.NEVER_REPLAYED
    assert "3 shapes captured were never replayed" in route.detail and "s1 (5, 6, 7, 8)" in route.detail
    assert "s0" not in route.detail  # the batch did not change
    assert policy.route((2, 5), captured, lambda: 0, unreplayed=captured).key == (2, 5)  # captured: replays
    assert policy.admit((2, 9), captured, lambda: 0).capture  # up front (capture()): not limited
    unlimited = _policy(capture_sizes=[2, 4, 8], max_unreplayed_captures=None)
    assert unlimited.route((2, 8), captured, lambda: 0, unreplayed=captured).capture


def test_a_new_size_rides_a_larger_captured_graph_until_it_has_come_often_enough():
    policy = _policy(capture_sizes=[2, 4, 8, 16, 32])
    near = [policy.route((12,), {(32,)}, lambda: 0) for _ in range(capture_deferral.NEAR_CALLS)]
    # bucket 16 rides 32 (within 2x) and waits; its NEAR_CALLS-th call captures it
    assert {(p.key, p.size, p.padded, p.waiting, p.capture) for p in near[:-1]} == {((32,), 12, True, (16,), False)}
    assert (near[-1].key, near[-1].capture, near[-1].waiting) == ((16,), True, None)
    far = [policy.route((3,), {(16,), (32,)}, lambda: 0) for _ in range(capture_deferral.FAR_CALLS)]
    # bucket 4 would ride 16, 4x its size: captured at its FAR_CALLS-th call
    assert {(p.key, p.waiting) for p in far[:-1]} == {((16,), (4,))} and far[-1].capture and far[-1].key == (4,)
    first = policy.route((40,), {(16,)}, lambda: 0)
    assert first.miss == Miss.ABOVE_MAX  # 40 > 32
    first = policy.route((7,), {(4,)}, lambda: 0)  # nothing larger captured: captured at once, as before
    assert first.capture and first.key == (8,)


def test_a_refused_capture_rides_a_larger_graph_instead_of_running_ungraphed():
    policy = _policy(capture_sizes=[2, 4, 8, 16], max_captured_sizes=1)
    plans = [policy.route((3,), {(16,)}, lambda: 0) for _ in range(capture_deferral.FAR_CALLS)]
    refused = plans[-1]
    assert (refused.key, refused.padded, refused.capture, refused.miss) == ((16,), True, False, Miss.OVER_BUDGET)
    assert refused.wanted == (4,) and "max_captured_sizes=1" in refused.detail


def test_sizes_that_differ_only_in_the_padded_size_are_not_churn():
    policy = _policy(capture_sizes=[2, 4, 8, 16], max_unreplayed_captures=2)
    unreplayed = {(2,), (4,), (8,)}  # a serving engine's token counts: at most len(capture_sizes) of them
    assert policy.route((16,), unreplayed, lambda: 0, unreplayed=unreplayed).capture


def test_a_refused_size_that_keeps_coming_replaces_the_least_used_captured_one():
    traffic = CaptureTraffic(window=64)
    captured = {(2,), (4,)}
    for _ in range(20):
        traffic.saw((2,))
    traffic.saw((4,))
    for _ in range(capture_traffic.MIN_CALLS - 1):
        traffic.saw((8,))
    assert traffic.victim((8,), captured) is None  # not yet MIN_CALLS calls
    traffic.saw((8,))
    assert traffic.victim((8,), captured) == (4,)  # 16 calls > 2 x 1: the least used goes
    for _ in range(30):  # (4,) comes back: 31 calls, not more than twice the least used's 16 (8,)
        traffic.saw((4,))
    assert traffic.victim((4,), {(2,), (8,)}) is None
    for _ in range(64):  # the window forgets: only (4,) came lately
        traffic.saw((4,))
    assert traffic.calls((8,)) == 0 and traffic.victim((4,), {(2,), (8,)}) == (2,)  # ties: the smaller key


def test_graph_memory_is_a_line_through_two_captures_and_answers_for_a_list_and_a_budget():
    fixed, per_row = fit([(8, 30 * 2**20), (64, 100 * 2**20)])
    assert per_row == 70 * 2**20 / 56 and fixed == pytest.approx(20 * 2**20)
    guess = GraphMemoryEstimate((8, 64), ((8, 30 * 2**20), (64, 100 * 2**20)), fixed, per_row)
    assert guess.predicted_bytes == 100 * 2**20
    assert guess.for_sizes([8, 16, 512]) == int(fixed + per_row * 512)  # the largest size decides
    assert guess.for_sizes([1, 2]) == int(fixed + per_row * 2)
    assert fit([(8, 40), (64, 30)]) == (30, 0.0)  # a pool that did not grow: no negative slope
    assert guess.largest_size_within(120 * 2**20, [8, 64, 72, 80, 96]) == 80  # 20 + 100 = 120 MiB at 80
    assert guess.largest_size_within(10 * 2**20, [8, 64]) is None
    assert fit([(512, 96 * 2**20)]) == (96 * 2**20, 0.0)  # one size: flat
    assert "MiB" in str(guess)


def _relaid(sizes) -> bool:
    """Has a size just below the largest (within half of it) been captured beside it?"""
    return any(max(sizes) / 2 <= s < max(sizes) for s in sizes)


def _pool_events(order, fixed=10 * 2**20, per_row=2**17, slack=20 * 2**20):
    """Capture events of a graph whose memory, after the sizes ``order`` were captured in that
    order, is what the largest of them needs while it runs (``fixed + per_row * rows``), plus once
    a segment that a size just below it takes when it re-lays the pool (the serving engine's 504
    after 512; its 1 adds nothing): the physics ``memory_estimate`` assumes. Returns (events,
    truth for a list captured largest first)."""
    from piecewise_backend.runtime.stats import CaptureEvent

    events, before = [], fixed // 2  # the keeper and what the device held before
    for i, size in enumerate(order):
        memory = int(fixed + per_row * max(order[: i + 1]) + (slack if _relaid(order[: i + 1]) else 0))
        events.append(CaptureEvent((size,), "lazy", 0.1, memory, memory - before, 3, i + 1))
        before = memory
    return events, lambda sizes: int(fixed + per_row * max(sizes) + (slack if _relaid(sizes) else 0))


@pytest.mark.parametrize(
    "order", [(504, 512, 1), (512, 504), (512, 64, 504, 1)], ids=["below-first", "largest-first", "after-a-warm-up"]
)
def test_graph_memory_of_every_size_is_what_the_largest_and_the_next_size_leave(order):
    sizes = (1, 2, 4, 8) + tuple(range(16, 513, 8))
    events, truth = _pool_events(order)
    guess = memory_estimate.from_events(sizes, events, 0)
    assert guess.predicted_bytes == pytest.approx(truth(sizes), rel=1e-6), str(guess)
    assert guess.for_sizes([512]) == guess.predicted_bytes
    if order[0] == 504:  # the size below alone came first: lists without the largest are answered from the line
        assert guess.for_sizes([504]) == pytest.approx(truth([504]), rel=1e-6)
    assert guess.largest_size_within(guess.predicted_bytes, sizes) == 512
    assert guess.largest_size_within(guess.predicted_bytes - 1, sizes) < 512


def test_the_largest_and_the_smallest_would_miss_the_re_layout():
    """What the estimate before this one measured (512, then 1) misses the segment the next size
    takes: the reason it captures the size next below the largest instead."""
    sizes = (1, 2, 4, 8) + tuple(range(16, 513, 8))
    events, truth = _pool_events((512, 1))
    held_before = events[0].pool_bytes - events[0].pool_growth
    old = memory_estimate.fit([(0, held_before), (512, events[-1].pool_bytes)])
    assert old[0] + old[1] * 512 < 0.9 * truth(sizes)


def test_estimate_captures_the_largest_then_the_next_size_and_nothing_more():
    """``estimate``'s captures on a stand-in graph whose memory follows ``_pool_events``' physics
    (a warm-up already captured 48): it adds the largest and the size next below it, two captures."""
    import types

    sizes = (1, 2, 4, 8, 16, 32, 48, 64)
    order = [48]

    def capture(asked):
        order.extend(asked)
        graph.captured.update((s,) for s in asked)
        graph.stats.events = _pool_events(order)[0]
        return [(s,) for s in asked]

    graph = types.SimpleNamespace(
        device=torch.device("cuda"),
        serial=3,
        pad_position=0,
        captured={(48,)},
        stats=types.SimpleNamespace(events=_pool_events(order)[0]),
        capture=capture,
        up_front=types.SimpleNamespace(keys_of=lambda _: [(s,) for s in reversed(sizes)]),
    )
    guess = memory_estimate.estimate(graph, "all")
    assert order == [48, 64]  # the largest; 48, the size next below it, was captured by the warm-up
    assert guess.predicted_bytes == pytest.approx(_pool_events(order)[1](sizes), rel=1e-6), str(guess)
    order.extend([1, 2])  # further sizes add nothing: the prediction already holds them
    assert _pool_events(order)[0][-1].pool_bytes == guess.predicted_bytes


def test_estimating_graph_memory_off_the_gpu_says_where_it_must_run():
    import types

    graph = types.SimpleNamespace(device=torch.device("cpu"), serial=7)
    with pytest.raises(ValueError, match="graph 7 runs on cpu: graph memory is measured from the CUDA allocator"):
        memory_estimate.estimate(graph)
