"""TEMPORARY stub of the foundation's pytree layer (replaced by main's module at the merge)."""

from __future__ import annotations

from typing import Any

import optree

NAMESPACE = "treegather"


def flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` in the treegather namespace (``None`` is an empty node)."""
    return optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)
