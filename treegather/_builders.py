"""Compiled builders: the k per-device trees of a scatter, from per-leaf columns, in one call.

scatter ends with one column per leaf (the k pieces of its ``tensor_split``) and must hand back
k trees. ``zip(*columns)`` and k ``PyTreeSpec.unflatten`` calls cost about 4% of the bare
``tensor_split`` work at 1000 leaves; a function compiled for the structure, whose body is the
k trees written out as dict, list and tuple displays (``{"x": c0[1], "y": [c1[1]]}``), does the
same in about two thirds of the time. It is compiled only for a structure seen
``_COMPILE_AFTER`` times with the same k (a training loop's batch), and only when every node is
a plain ``dict`` with ``str`` keys, a ``list``, a ``tuple`` or ``None``; anything else keeps
``unflatten``, which rebuilds every registered class exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from optree import PyTreeSpec

__all__ = ["replica_builder"]

Builder = Callable[..., list[Any]]

_COMPILE_AFTER = 3  # sightings of one (structure, k) before it is compiled
_MAX_CELLS = 40_000  # leaves x replicas; compiling takes about 8 ms per 1000 of them, once
_MAX_DEPTH = 50  # well inside the parser's limit on nested brackets
_MAX_ENTRIES = 256

# id(spec), k -> (spec, sightings so far | builder | None when it cannot be compiled). Keyed by
# id because hashing a 1000-leaf spec walks all of it (about 11 us); the spec is kept alive in
# the value and compared by identity, so a recycled id never matches.
_CACHE: dict[tuple[int, int], tuple[PyTreeSpec, int | Builder | None]] = {}


def replica_builder(spec: PyTreeSpec, k: int) -> Builder | None:
    """A function ``build(*columns) -> [tree_0, ..., tree_{k-1}]`` for ``spec``, or ``None``.

    ``columns[i][r]`` is leaf ``i`` of tree ``r``. ``None`` until the structure has been seen
    ``_COMPILE_AFTER`` times with this ``k``, and for structures it cannot write out.

    >>> import optree
    >>> spec = optree.tree_structure({"x": 0, "y": [0, None]})
    >>> [replica_builder(spec, 2) for _ in range(_COMPILE_AFTER - 1)]
    [None, None]
    >>> replica_builder(spec, 2)(("a0", "a1"), ("b0", "b1"))
    [{'x': 'a0', 'y': ['b0', None]}, {'x': 'a1', 'y': ['b1', None]}]
    """
    key = (id(spec), k)
    entry = _CACHE.get(key)
    if entry is not None and entry[0] is spec:
        state = entry[1]
        if type(state) is not int:
            return state  # type: ignore[return-value]
        seen = state + 1
    else:
        seen = 1
        if len(_CACHE) >= _MAX_ENTRIES:
            _CACHE.clear()
    if seen < _COMPILE_AFTER:
        _CACHE[key] = (spec, seen)
        return None
    built = _compile(spec, k)
    _CACHE[key] = (spec, built)
    return built


class _Unsupported(Exception):
    pass


def _compile(spec: PyTreeSpec, k: int) -> Builder | None:
    n = spec.num_leaves
    if n == 0 or k < 1 or n * k > _MAX_CELLS:
        return None
    # The structure with leaf i replaced by the int i: its containers are the ones unflatten
    # builds, in the same order, and each int says which column a leaf comes from.
    try:
        template = spec.unflatten(list(range(n)))
        trees = [_display(template, r, 0) for r in range(k)]
    except Exception:  # _Unsupported, or a registered class refusing ints as its children
        return None
    params = ", ".join(f"c{i}" for i in range(n))
    source = f"def build({params}):\n    return [{', '.join(trees)}]\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<treegather builder: {n} leaves x {k}>", "exec"), namespace)
    build: Builder = namespace["build"]
    return build


def _display(node: Any, r: int, depth: int) -> str:
    """Python source building ``node`` for replica ``r`` (leaf ``i`` is ``c{i}[r]``)."""
    kind = type(node)
    if kind is int:
        return f"c{node}[{r}]"
    if node is None:
        return "None"
    if depth >= _MAX_DEPTH:
        raise _Unsupported
    if kind is dict:
        if not all(type(key) is str for key in node):
            raise _Unsupported
        items = (f"{key!r}: {_display(value, r, depth + 1)}" for key, value in node.items())
        return "{" + ", ".join(items) + "}"
    if kind is list:
        return "[" + ", ".join(_display(value, r, depth + 1) for value in node) + "]"
    if kind is tuple:
        return "(" + "".join(_display(value, r, depth + 1) + ", " for value in node) + ")"
    raise _Unsupported  # OrderedDict, namedtuple, a registered class: unflatten rebuilds it
