"""The public face: every name in ``__all__`` imports and is documented; the doctests really run."""

from __future__ import annotations

import ast
import doctest
import inspect
import itertools
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
    docs = [_assigned_docstring(p, name) for p in (ROOT / "treegather").rglob("*.py")]
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


def test_the_doctests_run_in_this_session(request: pytest.FixtureRequest) -> None:
    """The doctests run once, in the test command's own session (conftest checks that a run
    collecting treegather/ finds more than MIN_DOCTESTS of them and fails if one skips)."""
    from conftest import DOCTESTS, MIN_DOCTESTS

    found = request.config.stash.get(DOCTESTS, None)
    if found is None:
        pytest.skip("this run does not collect treegather/ (the full test command does)")
    assert len(found) > MIN_DOCTESTS
    assert any("treegather.gather" in nodeid or "_gather.py" in nodeid for nodeid in found)


def test_dir_lists_the_public_names_only() -> None:
    """``dir()`` of the package and of ``treegather.distributed``: what the docs document (the
    names in ``__all__``, the lazy ``distributed`` submodule and ``__version__``); the internal
    modules stay reachable but are not listed."""
    import treegather.distributed as tgd

    assert dir(treegather) == sorted([*treegather.__all__, "distributed", "__version__"])
    assert dir(tgd) == sorted(tgd.__all__)
    for module, internal in ((treegather, "_gather"), (tgd, "preamble"), (tgd, "wire")):
        assert internal not in dir(module) and hasattr(module, internal)
