"""Builders the compiled layer generates for one structure: trees made from leaves.

Made from a ``PyTreeSpec`` alone (never from user data), written out as dict/list/tuple
displays; only for plain ``dict`` (``str`` keys), ``list``, ``tuple`` and ``None`` nodes
(anything else keeps ``unflatten``, which rebuilds every registered class exactly):

- :func:`compiled_builder`: ``build(*columns) -> [tree_0, ..., tree_{k-1}]``, the k per-device
  trees of a scatter from one column (k values) per leaf;
- :func:`compiled_unflatten`: ``build(leaves) -> tree``, ``spec.unflatten`` for small plain
  structures (gather's result).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from optree import PyTreeSpec

from .codegen import MAX_CELLS

__all__ = [
    "MAX_DEPTH",
    "MAX_UNFLATTEN",
    "Builder",
    "Unflatten",
    "compiled_builder",
    "compiled_unflatten",
]

Builder = Callable[..., list[Any]]
Unflatten = Callable[[list[Any]], Any]

MAX_UNFLATTEN = 256  # leaves; above, optree's unflatten (C) is as fast as a generated display
MAX_DEPTH = 50  # builder displays nest; well inside the parser's limit on nested brackets


class _Unsupported(Exception):
    pass


def compiled_builder(spec: PyTreeSpec, k: int) -> Builder | None:
    """A function ``build(*columns) -> [tree_0, ..., tree_{k-1}]`` for ``spec``, or ``None``.

    ``columns[i][r]`` is leaf ``i`` of tree ``r``; ``None`` for structures it cannot write out.

    >>> import optree
    >>> build = compiled_builder(optree.tree_structure({"x": 0, "y": [0, None]}), 2)
    >>> build(("a0", "a1"), ("b0", "b1"))
    [{'x': 'a0', 'y': ['b0', None]}, {'x': 'a1', 'y': ['b1', None]}]
    """
    n = spec.num_leaves
    if n == 0 or k < 1 or n * k > MAX_CELLS:
        return None
    # The structure with leaf i replaced by the int i: its containers are the ones unflatten
    # builds, in the same order, and each int says which column a leaf comes from.
    try:
        template = spec.unflatten(list(range(n)))
        trees = [_display(template, r) for r in range(k)]
    except Exception:  # _Unsupported, or a registered class refusing ints as its children
        return None
    params = ", ".join(f"c{i}" for i in range(n))
    source = f"def build({params}):\n    return [{', '.join(trees)}]\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<treegather builder: {n} leaves x {k}>", "exec"), namespace)
    build: Builder = namespace["build"]
    return build


def compiled_unflatten(spec: PyTreeSpec) -> Unflatten | None:
    """``spec.unflatten`` for plain structures: ``build(leaves)`` is the tree, or ``None``
    for structures :func:`compiled_builder` cannot write out.

    >>> import optree
    >>> build = compiled_unflatten(optree.tree_structure({"x": 0, "y": [0, None]}))
    >>> build(["a", "b"])
    {'x': 'a', 'y': ['b', None]}
    """
    n = spec.num_leaves
    if n == 0 or n > MAX_UNFLATTEN:
        return None
    try:
        tree = _display(spec.unflatten(list(range(n))), None)
    except Exception:
        return None
    names = ", ".join(f"c{i}" for i in range(n))
    namespace: dict[str, Any] = {}
    source = f"def build(leaves):\n    {names}, = leaves\n    return {tree}\n"
    exec(compile(source, f"<treegather unflatten: {n} leaves>", "exec"), namespace)
    build: Unflatten = namespace["build"]
    return build


def _display(template: Any, r: int | None) -> str:
    """Python source building ``template`` for replica ``r`` (leaf ``i`` is ``c{i}[r]``, or
    ``c{i}`` when ``r`` is ``None``)."""
    # Iterative (an explicit stack of pending parts), bounded by MAX_DEPTH for the parser.
    parts: list[str] = []
    stack: list[tuple[Any, int]] = [(template, 0)]
    while stack:
        node, depth = stack.pop()
        if type(node) is str:  # a piece of source text queued between children
            parts.append(node)
            continue
        kind = type(node)
        if kind is int:
            parts.append(f"c{node}" if r is None else f"c{node}[{r}]")
            continue
        if node is None:
            parts.append("None")
            continue
        if depth >= MAX_DEPTH:
            raise _Unsupported
        if kind is dict:
            if not all(type(key) is str for key in node):
                raise _Unsupported
            pending: list[Any] = ["{"]
            for key, value in node.items():
                pending += [f"{key!r}: ", (value, depth + 1), ", "]
            pending.append("}")
        elif kind is list or kind is tuple:
            pending = ["[" if kind is list else "("]
            for value in node:
                pending += [(value, depth + 1), ", "]
            pending.append("]" if kind is list else ")")
        else:
            raise _Unsupported  # OrderedDict, namedtuple, a registered class: unflatten rebuilds it
        stack.extend((p, depth) if type(p) is str else p for p in reversed(pending))
    return "".join(parts)
