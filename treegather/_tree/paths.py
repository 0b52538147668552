"""Paths: every node of a structure as the user would type it (``outputs['logits']``, ``out.hidden[2]``).

:func:`nodes` walks a structure (iteratively: any depth optree can flatten) and gives each node
its path; :func:`display_path` and :func:`format_path` write paths for messages, also for a
call's ``(args, kwargs)`` or ``(input, kwargs)`` pair.
"""

from __future__ import annotations

import keyword
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
from optree import PyTreeKind, PyTreeSpec

from .._errors import safe_repr

__all__ = [
    "INPUT_AND_KWARGS",
    "MAPPING_KINDS",
    "Node",
    "child_styles",
    "display_path",
    "format_path",
    "is_call_root",
    "leaf_nodes",
    "nodes",
]


MAPPING_KINDS = (PyTreeKind.DICT, PyTreeKind.ORDEREDDICT, PyTreeKind.DEFAULTDICT)


class Node(NamedTuple):
    """One node of a structure, as seen from the root."""

    path: tuple[tuple[Any, str], ...]
    """``(entry, style)`` pairs from the root; style is ``"key"``, ``"index"`` or ``"attr"``."""
    raw: tuple[Any, ...]
    """The optree entries from the root (indices for sequences and namedtuples)."""
    start: int
    """Index of the node's first leaf in the flat leaf list."""
    stop: int
    """One past the node's last leaf."""
    spec: PyTreeSpec
    """The node's own structure."""


def child_styles(node: PyTreeSpec) -> list[tuple[Any, str]]:
    """How each child of ``node`` is written in a path: ``(entry, "key" | "index" | "attr")``."""
    kind = node.kind
    entries = node.entries()
    if kind in MAPPING_KINDS:
        return [(k, "key") for k in entries]
    if kind in (PyTreeKind.NAMEDTUPLE, PyTreeKind.STRUCTSEQUENCE):
        fields = (
            node.type._fields  # type: ignore[union-attr]
            if kind == PyTreeKind.NAMEDTUPLE
            else optree.structseq_fields(node.type)  # type: ignore[arg-type]
        )
        return [(f, "attr") for f in fields]
    if kind == PyTreeKind.CUSTOM:
        return [
            (e, "attr")
            if isinstance(e, str) and e.isidentifier() and not keyword.iskeyword(e)
            else (e, "index" if isinstance(e, int) else "key")
            for e in entries
        ]
    return [(i, "index") for i in range(len(entries))]


def nodes(spec: PyTreeSpec) -> list[Node]:
    """Every node of ``spec`` in pre-order (root first, leaves included), with its path and leaves.

    Iterative: a tree of any depth optree can flatten is fine.

    >>> [format_path("x", n.path) for n in nodes(optree.tree_structure({"a": [1, 2]}))]
    ['x', "x['a']", "x['a'][0]", "x['a'][1]"]
    """
    out: list[Node] = []
    stack: list[tuple[PyTreeSpec, tuple[tuple[Any, str], ...], tuple[Any, ...], int]] = [
        (spec, (), (), 0)
    ]
    while stack:
        node, path, raw, start = stack.pop()
        out.append(Node(path, raw, start, start + node.num_leaves, node))
        if node.is_leaf():
            continue
        children = []
        pos = start
        for styled, entry, child in zip(child_styles(node), node.entries(), node.children()):
            children.append((child, (*path, styled), (*raw, entry), pos))
            pos += child.num_leaves
        stack.extend(reversed(children))
    return out


def leaf_nodes(spec: PyTreeSpec) -> list[Node]:
    """The nodes of ``spec``'s leaves, in leaf order."""
    return [nd for nd in nodes(spec) if nd.spec.is_leaf()]


INPUT_AND_KWARGS = "(inputs, kwargs)"
"""The ``root`` of an ``(input, kwargs)`` pair: :func:`treegather.data_parallel`'s single
input (paths start at it, ``inputs['names']``) next to its keyword arguments (``kwargs['labels']``).
``root=None`` is an ``(args, kwargs)`` pair, whose paths start at the positional index."""


def is_call_root(root: str | None) -> bool:
    """Whether ``root`` names a call's pair (``(args, kwargs)`` or ``(input, kwargs)``), whose
    first level (the pair's index) is not part of any path."""
    return root is None or root == INPUT_AND_KWARGS


def display_path(node: Node, root: str | None) -> str:
    """A node's path for messages; ``root=None`` means an ``(args, kwargs)`` pair and
    :data:`INPUT_AND_KWARGS` an ``(input, kwargs)`` pair.

    >>> [display_path(n, INPUT_AND_KWARGS) for n in nodes(optree.tree_structure(({"a": 1}, {"b": 2})))]
    ['(inputs, kwargs)', 'inputs', "inputs['a']", 'kwargs', "kwargs['b']"]
    """
    if root is not None and root != INPUT_AND_KWARGS:
        return format_path(root, node.path)
    if not node.path:
        return "(args, kwargs)" if root is None else INPUT_AND_KWARGS
    head = "kwargs" if node.raw[0] == 1 else "args" if root is None else "inputs"
    return format_path(head, node.path[1:])


def format_path(root: str, path: Sequence[tuple[Any, str]]) -> str:
    """Write a path as a user would type it: ``outputs['logits']``, ``out.hidden[2]``.

    >>> format_path("outputs", [("hidden", "attr"), (2, "index"), ("k", "key")])
    "outputs.hidden[2]['k']"
    """
    parts = [root]
    for entry, style in path:
        if style == "attr":
            parts.append(f".{entry}")
        elif style == "index":
            parts.append(f"[{entry}]")
        else:
            parts.append(f"[{safe_repr(entry)}]")
    return "".join(parts)
