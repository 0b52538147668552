"""The exceptions treegather raises.

Every class refines the builtin a caller would catch anyway (``ValueError``,
``TypeError``) and shows ``treegather`` as its module in tracebacks.
"""

from __future__ import annotations

__all__ = [
    "TreegatherError",
    "LayoutError",
    "StructureMismatchError",
    "BatchSizeError",
    "LeafTypeError",
    "ShapeMismatchError",
]


class TreegatherError(Exception):
    """Base class of every error treegather raises on bad input."""


class LayoutError(TreegatherError, ValueError):
    """A layout does not fit the data: unknown rule, prefix mismatch, pattern matching nothing."""


class StructureMismatchError(TreegatherError, ValueError):
    """Per-replica (or per-rank) trees differ in structure: a key, a length, ``None`` vs a value."""


class BatchSizeError(TreegatherError, ValueError):
    """Split leaves disagree on the batch size, or explicit shard sizes do not add up."""


class LeafTypeError(TreegatherError, TypeError):
    """A rule was applied to a leaf it cannot handle (e.g. ``split()`` on a string)."""


class ShapeMismatchError(TreegatherError, ValueError):
    """Per-replica tensors cannot be combined: other dims, dtypes or devices disagree."""


for _cls in (
    TreegatherError,
    LayoutError,
    StructureMismatchError,
    BatchSizeError,
    LeafTypeError,
    ShapeMismatchError,
):
    _cls.__module__ = "treegather"
del _cls


def bullet_list(problems: list[str], hint: str | None = None) -> str:
    """Join several problems into one message, one per line, with an optional closing hint."""
    if len(problems) == 1:
        text = problems[0]
    else:
        text = f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems)
    if hint:
        text += f"\nHint: {hint}"
    return text
