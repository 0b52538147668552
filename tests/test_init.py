"""The public face: every name in ``__all__`` imports and is documented; the doctests really run."""

from __future__ import annotations

import ast
import doctest
import inspect
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

import treegather

ROOT = Path(__file__).resolve().parent.parent


def test_all_is_unique_and_every_name_imports() -> None:
    assert len(treegather.__all__) == len(set(treegather.__all__))
    for name in treegather.__all__:
        assert hasattr(treegather, name), name
        exec(f"from treegather import {name}", {})


def _assigned_docstring(module_path: Path, name: str) -> str | None:
    """The string literal right after ``name = ...`` at module level (an attribute docstring)."""
    body = ast.parse(module_path.read_text()).body
    for stmt, nxt in itertools.pairwise(body):
        targets = (
            stmt.targets
            if isinstance(stmt, ast.Assign)
            else ([stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                return str(nxt.value.value)
    return None


@pytest.mark.parametrize("name", treegather.__all__)
def test_every_public_name_is_documented(name: str) -> None:
    obj = getattr(treegather, name)
    if inspect.isclass(obj) or inspect.isfunction(obj):
        own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        assert own and own.strip(), f"treegather.{name} has no docstring of its own"
        return
    # A constant: documented by a string literal after its assignment in some module.
    docs = [_assigned_docstring(p, name) for p in (ROOT / "treegather").glob("_*.py")]
    assert any(docs), f"treegather.{name} has no attribute docstring"


PUBLIC_FUNCTIONS = [n for n in treegather.__all__ if inspect.isfunction(getattr(treegather, n))]


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_every_public_function_has_a_doctest_example(name: str) -> None:
    tests = doctest.DocTestFinder(recurse=False).find(getattr(treegather, name), name)
    assert tests and any(t.examples for t in tests), f"treegather.{name} has no >>> example"


def test_public_functions_are_the_expected_set() -> None:
    # The rule constructors and the four steps, at least (the check above must not be vacuous).
    expected = {
        "scatter",
        "scatter_kwargs",
        "gather",
        "split",
        "broadcast",
        "split_items",
        "cat",
        "stack",
        "mean",
        "sum",
        "pad",
        "as_list",
        "first",
        "cat_items",
        "by_path",
        "register_dataclass",
        "register_node",
    }
    assert expected <= set(PUBLIC_FUNCTIONS)


def test_the_doctests_actually_run_and_pass() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--doctest-modules",
            "treegather",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    tail = proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    match = re.search(r"(\d+) passed", proc.stdout)
    assert match, tail
    assert int(match.group(1)) > 20, tail
    assert "skipped" not in proc.stdout.splitlines()[-1], tail
