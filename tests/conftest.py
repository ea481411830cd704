"""Shared fixtures: tiny toy models, compiled once per session (Inductor on 2 CPU cores is slow)."""

import warnings

import pytest
import torch

from piecewise_backend import emulated_graphs as emulating_graphs

CUDA = torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_empty_cuda_graph(request):
    """No CUDA test may see torch's "The CUDA Graph is empty": a capture that recorded no kernel
    (a piece without device work is run as it is, never captured). Counted here for every one."""
    if request.node.get_closest_marker("cuda") is None:
        yield
        return
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield
    empty = [str(w.message) for w in seen if "CUDA Graph is empty" in str(w.message)]
    assert not empty, f"torch warned {len(empty)} time(s): {empty[0]}"
    for w in seen:  # hand the rest on, as if nothing had listened
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def emulated_graphs():
    """CUDA graphs emulated on CPU for a whole test module (``runtime/emulation.py``), so the
    capture, replay and padding logic runs without a GPU. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("emulated_graphs")``."""
    with emulating_graphs():
        yield
