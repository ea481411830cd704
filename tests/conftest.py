"""Shared fixtures: tiny toy models, compiled once per session (Inductor on 2 CPU cores is slow)."""

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
