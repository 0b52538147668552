"""Every notebook in notebooks/ runs top to bottom on the CPU (stored without outputs)."""

from __future__ import annotations

import os
import pathlib

import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_notebooks_exist() -> None:
    names = {p.name for p in NOTEBOOKS}
    missing = {"benchmark.ipynb", "quickstart.ipynb", "migrating.ipynb"} - names
    assert not missing, f"notebooks/ lacks {sorted(missing)}"


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path: pathlib.Path) -> None:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nbclient import NotebookClient

    root = str(path.parent.parent)
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": root}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "error"
    ]
    assert not errors
