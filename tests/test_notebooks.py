"""Every notebook in notebooks/ runs top to bottom on the CPU (stored without outputs)."""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import nbformat
import pytest
import spawned_groups

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# The guides that need an optional dependency carry its marker (``-m transformers`` selects them).
MARKS = {"transformers": [pytest.mark.transformers]}
PARAMS = [pytest.param(p, id=p.stem, marks=MARKS.get(p.stem, [])) for p in NOTEBOOKS]


def test_notebooks_exist() -> None:
    names = {p.name for p in NOTEBOOKS}
    missing = {"benchmark.ipynb", "quickstart.ipynb", "migrating.ipynb", "transformers.ipynb"}
    missing -= names
    assert not missing, f"notebooks/ lacks {sorted(missing)}"


@pytest.mark.notebook
@pytest.mark.parametrize("path", PARAMS)
def test_notebook_is_stored_without_outputs(path: pathlib.Path) -> None:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"


_EXECUTE = """
import sys, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": sys.argv[2]}})
try:
    client.execute()  # raises CellExecutionError, naming the cell, on any error
finally:
    nbformat.write(nb, sys.argv[3])
"""
DEADLINE_S = 300.0


def execute(path: pathlib.Path, out: pathlib.Path) -> tuple[int, str, pathlib.Path | None]:
    """Run the notebook top to bottom in a kernel of its own (from a fresh interpreter, so that
    it can run in the background: :func:`background_job`): the return code, the end of the
    output, and the executed notebook's path (``None`` where none was written). The notebook is
    not read here: reading validates it (jsonschema), which leaves objects in reference cycles,
    and a background thread's would be counted by the tests that check a call leaves none."""
    root = str(path.parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "MPLBACKEND": "Agg",
    }
    written = out / f"{path.stem}.ipynb"
    with (out / f"{path.stem}.log").open("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _EXECUTE, str(path), root, str(written)],
            cwd=root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + DEADLINE_S
        while (
            proc.poll() is None and time.monotonic() < deadline and not spawned_groups.STOP.is_set()
        ):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.2)
        if proc.poll() is None:  # past the deadline, or the session ended: the kernel too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.seek(0)
        text = log.read()[-4000:]
    return proc.returncode, text, written if written.exists() else None


def background_job(item: pytest.Item) -> Any:
    """The notebook a ``test_notebook_runs`` item runs, as a job started at collection."""
    path = getattr(item, "callspec", None) and item.callspec.params.get("path")
    if getattr(item, "originalname", None) != "test_notebook_runs" or path is None:
        return None
    return ("notebook", path.stem), lambda: functools.partial(
        execute, path, spawned_groups.scratch(f"notebook-{path.stem}")
    )


@pytest.mark.notebook
@pytest.mark.parametrize("path", PARAMS)
def test_notebook_runs(path: pathlib.Path, tmp_path: pathlib.Path) -> None:
    job = spawned_groups.started(("notebook", path.stem))
    returncode, output, written = job.result() if job is not None else execute(path, tmp_path)
    assert returncode == 0, output
    assert written is not None
    nb = nbformat.read(written, as_version=4)  # (here, not in the background job: see execute)
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "error"
    ]
    assert not errors
    assert all(cell.execution_count for cell in nb.cells if cell.cell_type == "code")


def test_every_script_guide_runs_in_the_suite() -> None:
    """Each guide that is a script (notebooks/*.py) runs in the suite: under torchrun in
    conftest's launch (``ddp_eval.py``, ``contrastive.py``), or on a spawned group's ranks
    from the test module that loads it (``frameworks.py``: tests/test_frameworks.py, where
    Lightning is imported already)."""
    tests = pathlib.Path(__file__).parent
    text = "".join(p.read_text() for p in tests.glob("*.py") if p.name != "test_notebooks.py")
    scripts = sorted((tests.parent / "notebooks").glob("*.py"))
    assert scripts, "notebooks/ holds no script guide"
    missing = [p.name for p in scripts if f'"{p.name}"' not in text]
    assert not missing, f"no test runs {missing}"
