"""Flattening and mapping trees in treegather's namespace: the plain definition, no cache.

Everything treegather does to a tree goes through :func:`flatten`, so that one place knows which
classes are containers (:mod:`.registry`): optree's built-ins (dict, OrderedDict, defaultdict,
list, tuple, namedtuple, deque, ``None`` as an empty node) and every registered class. A tree
that contains itself, or is deeper than optree flattens, is a :class:`~treegather.TreeDepthError`
naming the path.
"""

from __future__ import annotations

import keyword
from collections import OrderedDict, defaultdict, deque
from collections.abc import Sequence
from typing import Any

import optree
import torch
from optree import PyTreeSpec

from .._errors import TreeDepthError
from .batch import check_sizes, note, tally, unreadable
from .paths import Node, display_path, format_path
from .registry import NAMESPACE, sync

__all__ = ["alike", "depth_error", "flatten", "move_tree"]


def flatten(tree: Any, root: str | None = "tree", where: str = "") -> tuple[list[Any], PyTreeSpec]:
    """Flatten ``tree`` in treegather's namespace (``None`` is an empty node).

    The plain definition: one ``optree.tree_flatten``, no cache (the compiled layer,
    :mod:`treegather._compiled`, recognises structures it has seen before without it). A tree
    that contains itself, or is deeper than optree flattens, is a :class:`TreeDepthError`
    naming the path (from ``root``, as :func:`display_path` writes it; ``where`` starts the
    message, e.g. ``"replica 1: "``), not optree's bare ``RecursionError``.

    >>> leaves, spec = flatten({"b": 1, "a": (2, None)})
    >>> leaves, spec.unflatten(leaves)
    ([2, 1], {'b': 1, 'a': (2, None)})
    >>> d = {"x": 1}; d["self"] = d
    >>> flatten(d, "inputs")
    Traceback (most recent call last):
    ...
    treegather.TreeDepthError: inputs['self'] is inputs itself: the tree contains itself ...
    """
    sync()
    counted, bad = tally(), unreadable()
    try:
        leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    except RecursionError:
        raise depth_error(tree, root, where) from None
    if tally() != counted:  # it flattened a batch node (treegather._tree.batch)
        note(spec)
        if unreadable() != bad:  # a batch size that cannot be read: where
            check_sizes(spec, root, where)
    return leaves, spec


MAX_DEPTH: int = getattr(getattr(optree, "_C", None), "MAX_RECURSION_DEPTH", 1000)
"""How deep a tree optree flattens."""
_WALK_BUDGET = 1_000_000  # nodes depth_error visits at most (a DAG may share subtrees)


def depth_error(tree: Any, root: str | None = "tree", where: str = "") -> TreeDepthError:
    """Why ``tree`` cannot be flattened: the path where it contains itself (a container that
    is its own ancestor), or the path where it passes :data:`MAX_DEPTH` levels. Iterative."""
    ancestors: list[int] = []  # ids of the containers from the root down to the current node
    depth_of: dict[int, int] = {}
    stack: list[tuple[Any, tuple[tuple[Any, str], ...], tuple[Any, ...]]] = [(tree, (), ())]
    budget = _WALK_BUDGET
    while stack and budget:
        budget -= 1
        node, path, raw = stack.pop()
        while len(ancestors) > len(path):
            depth_of.pop(ancestors.pop(), None)
        if node is None or optree.tree_is_leaf(node, namespace=NAMESPACE):
            continue
        seen = depth_of.get(id(node))
        if seen is not None:
            here = _shown_path(root, path, raw)
            return TreeDepthError(
                f"{where}{here} is {_shown_path(root, path[:seen], raw[:seen])} itself: the "
                "tree contains itself (a cycle), so it has no end to flatten\n"
                "Hint: a container must not hold itself or one of its ancestors; keep such a "
                "reference out of the tree (e.g. in a static field, or as a plain id)"
            )
        if len(path) >= MAX_DEPTH:
            return TreeDepthError(
                f"{where}{_shown_path(root, path, raw)}: the tree is nested deeper than "
                f"{MAX_DEPTH} levels, the most optree flattens\n"
                "Hint: flatten the nesting (e.g. a list of layers instead of a chain of dicts)"
            )
        depth_of[id(node)] = len(ancestors)
        ancestors.append(id(node))
        children, _, entries, _ = optree.tree_flatten_one_level(node, namespace=NAMESPACE)
        steps = zip(_styles_of(node, entries), entries, children)
        stack.extend(
            (child, (*path, styled), (*raw, entry))
            for styled, entry, child in reversed(list(steps))
        )
    return TreeDepthError(
        f"{where}{'(args, kwargs)' if root is None else root}: the tree is too deep to flatten "
        "(optree raised RecursionError)"
    )


def _styles_of(node: Any, entries: Sequence[Any]) -> list[tuple[Any, str]]:
    """:func:`child_styles` for a container itself (one level, from its optree entries)."""
    if type(node) in (dict, OrderedDict, defaultdict):
        return [(k, "key") for k in entries]
    if optree.is_namedtuple(node):
        return [(f, "attr") for f in type(node)._fields]
    if optree.is_structseq(node):
        return [(f, "attr") for f in optree.structseq_fields(node)]
    if type(node) in (list, tuple, deque):
        return [(i, "index") for i in range(len(entries))]
    return [
        (e, "attr")
        if isinstance(e, str) and e.isidentifier() and not keyword.iskeyword(e)
        else (e, "index" if isinstance(e, int) else "key")
        for e in entries
    ]


def _shown_path(root: str | None, path: tuple[tuple[Any, str], ...], raw: tuple[Any, ...]) -> str:
    """:func:`display_path` for a path of any length: a long one keeps its ends."""
    node = Node(path, raw, 0, 0, None)  # type: ignore[arg-type]
    if len(path) <= 24:
        return display_path(node, root)
    head = display_path(Node(path[:12], raw[:12], 0, 0, None), root)  # type: ignore[arg-type]
    tail = format_path("", path[-8:])
    return f"{head}...{tail} ({len(path)} levels)"


def move_tree(tree: Any, target: torch.device) -> Any:
    """``tree`` with every tensor leaf on ``target`` (others untouched)."""
    return optree.tree_map(
        lambda x: x.to(target) if isinstance(x, torch.Tensor) and x.device != target else x,
        tree,
        namespace=NAMESPACE,
    )


def alike(structures: Sequence[Any]) -> bool:
    """Whether the structures (specs, or anything compared with ``==``) are all equal to the
    first; metadata whose ``==`` is not one bool (an array) cannot say so: not alike.

    >>> alike([optree.tree_structure([1, 2])] * 2), alike([[1], [1, 2]])
    (True, False)
    """
    first = structures[0]
    try:
        return all(bool(other == first) for other in structures[1:])
    except Exception:  # (node metadata whose == is not one bool, such as an array)
        return False
