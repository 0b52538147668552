"""Layout rules: what happens to one leaf (or one subtree) on the way in and on the way out.

A rule is a small frozen object whose class owns its meaning (:mod:`.base`). Scatter rules
(:mod:`.scatter`: :func:`split`, :func:`broadcast`, :func:`split_items`) say how an input is
divided over devices; gather rules say how per-replica outputs become one, leaf by leaf
(:mod:`.leafwise`: :func:`cat`, :func:`stack`, :func:`pad`; :mod:`.reductions`: :func:`mean`,
:func:`sum`) or taking a subtree whole (:mod:`.whole`: :func:`as_list`, :func:`first`,
:func:`cat_items`, any callable ``f(values, device)``).
"""

from __future__ import annotations

import torch

from .._tree import rows_of
from .base import (
    HINTS,
    Combining,
    Cut,
    GatherRule,
    Problem,
    Rule,
    ScatterRule,
    foreign_rule,
    is_foreign,
    is_number,
    rule_named,
    to_rule,
)
from .leafwise import Cat, LeafRule, Pad, Padded, Stack, cat, fill_fits, pad, stack
from .reductions import Mean, Sum, mean, sum
from .scatter import (
    SPLIT_ROWS,
    Broadcast,
    Split,
    SplitItems,
    broadcast,
    default_cut,
    split,
    split_items,
)
from .whole import (
    JOIN_ROWS,
    LEAF_AS_LIST,
    ROOT,
    AsList,
    CatItems,
    Custom,
    First,
    as_list,
    cat_items,
    first,
    where,
)

__all__ = [
    "HINTS",
    "JOIN_ROWS",
    "LEAF_AS_LIST",
    "SPLIT_ROWS",
    "ROOT",
    "AsList",
    "Broadcast",
    "Cat",
    "CatItems",
    "Combining",
    "Custom",
    "Cut",
    "First",
    "GatherRule",
    "LeafRule",
    "Mean",
    "Pad",
    "Padded",
    "Problem",
    "Rule",
    "ScatterRule",
    "Split",
    "SplitItems",
    "Stack",
    "Sum",
    "as_list",
    "broadcast",
    "cat",
    "cat_items",
    "default_cut",
    "default_rule",
    "fill_fits",
    "first",
    "foreign_rule",
    "is_foreign",
    "is_number",
    "mean",
    "pad",
    "rule_named",
    "split",
    "split_items",
    "stack",
    "sum",
    "to_rule",
    "where",
]


def default_rule(value: object, dim: int) -> tuple[GatherRule, str]:
    """The gather rule a leaf gets when the layout names none, and how messages name it:
    tensors are concatenated along the call's ``dim``, a value laid out by rows its own way (a
    ``PackedSequence``, a PyG graph batch) joined by its rows, anything else is listed."""
    if isinstance(value, torch.Tensor):
        return Cat(dim), f"cat(dim={dim})"
    if rows_of(value) is not None:
        return JOIN_ROWS, JOIN_ROWS.describe()
    return LEAF_AS_LIST, "as_list()"
