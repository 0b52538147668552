"""Text for explain's tables: shapes, values, dtypes, devices and why a leaf got its rule.

Small formatting helpers shared by :mod:`treegather._explain` (which works out each row) and :mod:`.table` (which renders the
rows as a table).
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from .._errors import safe_repr
from .._layout import EXPLAIN_POINTER, RuleSource, describe_source
from .._tree import NAMESPACE, describe, dtype_text, rows_of, shape_text, type_name

Tensor = torch.Tensor


def _strip(text: str) -> str:
    """A message without the trailing pointer to explain (we are in it)."""
    return text.removesuffix("\n" + EXPLAIN_POINTER)


def _value_text(x: Any, whole: bool) -> str:
    if isinstance(x, Tensor):
        where = "" if x.device.type == "cpu" else f" on {x.device}"
        return f"Tensor{shape_text(list(x.shape))} {dtype_text(x.dtype)}{where}"
    if rows_of(x) is not None:
        return describe(x)
    if whole and x is not None:
        try:
            children = optree.tree_flatten_one_level(x, namespace=NAMESPACE)[0]
        except ValueError:
            children = None
        if children is not None:
            return f"{type(x).__qualname__} of {len(children)} item(s)"
    return f"{type(x).__qualname__} {safe_repr(x, 30)}"


def _why(source: RuleSource, x: Any, root: str | None) -> str:
    if source.kind != "default":
        return describe_source(source, root)
    if isinstance(x, Tensor):
        return "default for a 0-dim Tensor" if x.dim() == 0 else "default for a Tensor with dims"
    return f"default for {type_name(x)}"


def _devices_text(devs: tuple[torch.device, ...]) -> str:
    names = [str(d) for d in devs]
    if len(set(names)) == 1:
        return f"{len(names)} devices ({names[0]} x{len(names)})"
    return f"{len(names)} devices ({', '.join(names)})"


def _compress(cells: tuple[str, ...]) -> str:
    if cells and all(c == cells[0] for c in cells) and cells[0] == "whole":
        return f"whole x{len(cells)}"
    return ", ".join(cells)
