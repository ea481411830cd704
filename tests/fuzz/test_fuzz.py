"""The CI slice of the differential fuzzer: random models against eager on CPU, graphs emulated.

Bounded to a few minutes on two cores (each model costs an Inductor compile or two). The GPU run
(``python -m tests.fuzz --device cuda``) is the long one: thousands of steps, batch sizes up to 600,
memory over 10,000 replays.
"""

import warnings

import pytest
import torch

from .runner import fuzz

SEEDS = range(12)
CAPTURE_SIZES = [1, 2, 4, 8, 12]  # batch sizes are drawn up to 14: above the largest size too
pytestmark = pytest.mark.usefixtures("emulated_graphs")


#: What the backend says while fuzzing, on purpose: the fuzzer swaps weights (new graphs for them).
EXPECTED_WARNINGS = ("are at new addresses", "captured per exact batch size")  # swaps; row-mixing ops


@pytest.fixture(scope="module")
def fuzzed_and_warned():
    with torch.no_grad(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        result = fuzz(SEEDS, steps=10, max_batch=14, options={"capture_sizes": CAPTURE_SIZES})
    return result, [str(w.message) for w in said if "piecewise" in str(w.message)]


@pytest.fixture(scope="module")
def fuzzed(fuzzed_and_warned):
    return fuzzed_and_warned[0]


def test_the_backend_warns_only_of_what_the_fuzzer_does_on_purpose(fuzzed_and_warned):
    result, said = fuzzed_and_warned
    assert result.weight_swaps > 0 and any(EXPECTED_WARNINGS[0] in m for m in said)
    assert [m for m in said if not any(e in m for e in EXPECTED_WARNINGS)] == []


def test_random_models_match_eager_at_every_step(fuzzed):
    assert fuzzed.steps == 10 * len(SEEDS)
    assert fuzzed.wrong == 0, "\n".join(fuzzed.failures[:20])


def test_the_slice_covers_padded_and_refused_graphs_and_weight_swaps(fuzzed):
    # the slice would prove little if the backend never padded, never refused, or weights never moved
    assert fuzzed.padded_graphs > 0 and fuzzed.unpadded_graphs > 0, fuzzed
    assert fuzzed.weight_swaps > 0, fuzzed


def test_the_slice_covers_dynamic_true_graph_breaks_and_values_crossing_pieces(fuzzed):
    assert fuzzed.dynamic_models > 0 and fuzzed.breaking_models > 0 and fuzzed.crossing_models > 0, fuzzed
