"""The notebooks run, top to bottom, in a fresh Jupyter kernel (CPU), as a new user would run them."""

import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"inspect_split_graph.ipynb", "lazy_capture.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert outputs  # it showed something


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_with_its_outputs(path):
    """A reader on GitHub sees the tables and pictures without running anything."""
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code), "a cell was never run"
    outputs = [o for cell in code for o in cell.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no picture"
    assert not [o for o in outputs if o.get("output_type") == "error"]
