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
    for module, internal in ((treegather, "_gather"), (tgd, "exchange"), (tgd, "describe")):
        assert internal not in dir(module) and hasattr(module, internal)


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The package's modules ``module`` (at ``path``) imports, wherever the import statement is
    (inside functions too: a lazy import still ties the two modules). ``from pkg import name``
    is an arrow to ``pkg.name`` when that is a module of the package, else to ``pkg``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    return {m for m in found if m in modules and m != module}


def test_the_package_has_no_import_circle() -> None:
    """Imports run one way, down (ARCHITECTURE.md): no module reaches itself through the modules
    it imports, a package's ``__init__`` included (it re-exports its modules' names)."""
    paths = {}
    for path in (ROOT / "treegather").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        paths[name] = path
    modules = set(paths)
    graph = {m: _imports(p, m, modules) for m, p in paths.items()}
    circles = []
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(m: str, trail: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                circles.append([*trail[trail.index(n) :], n])
            elif n not in state:
                walk(n, [*trail, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m, [m])
    assert graph["treegather._scatter"], "the import graph was not read"
    assert not circles, "\n".join(" -> ".join(c) for c in circles)
