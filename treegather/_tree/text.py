"""How messages and tables describe a value: a tensor's shape, dtype and device, else its repr."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]

from .._errors import safe_repr
from .batch import rows_of

__all__ = ["describe", "differing", "dtype_text", "shape_text", "type_name"]


def shape_text(shape: Sequence[Any]) -> str:
    """A shape as tables and messages write it: ``(3,)``, ``(2, 4)``, ``()``.

    >>> shape_text([3]), shape_text([2, "k*4"]), shape_text([])
    ('(3,)', '(2, k*4)', '()')
    """
    return f"({shape[0]},)" if len(shape) == 1 else "(" + ", ".join(map(str, shape)) + ")"


def dtype_text(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def type_name(value: Any) -> str:
    """The name messages give a value's type: its class's, or for a value laid out by rows
    (:func:`~treegather._tree.rows_of`) its kind's (``PackedSequence``, ``graph batch``).

    >>> type_name(1.0), type_name([])
    ('float', 'list')
    """
    rows = rows_of(value)
    if rows is not None:
        return rows.kind.name
    return type(value).__qualname__


def describe(value: Any) -> str:
    """A short description of a leaf for error messages: shape/dtype/device or type, and a
    ``repr`` cut to 60 characters that never raises (:func:`treegather._errors.safe_repr`); a
    value laid out by rows by its kind and rows (``PackedSequence of 3 rows``)."""
    rows = None if isinstance(value, torch.Tensor) else rows_of(value)
    if rows is not None:
        try:
            return f"{rows.kind.name} of {rows.rows} rows"
        except Exception:  # (a kind whose rows cannot be read from this value)
            return rows.kind.name
    if isinstance(value, torch.Tensor):
        if value.is_nested:  # a nested tensor has no single shape
            return f"nested Tensor(dtype={value.dtype}, device={value.device})"
        if isinstance(value, UninitializedTensorMixin):  # (no shape yet)
            return f"{type(value).__name__}(dtype={value.dtype}, device={value.device})"
        layout = "" if value.layout is torch.strided else f", layout={value.layout}"
        return (
            f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}{layout}, "
            f"device={value.device})"
        )
    return f"{type(value).__qualname__} {safe_repr(value, 60)}"


def differing(texts: Sequence[str], width: int = 60) -> list[str]:
    """Each text around where they first differ, at most about ``width`` characters (what a
    message shows of reprs too long to show whole, such as a TensorDict's pytree context).

    >>> differing([repr({"keys": ["x"], "names": ["b"]}), repr({"keys": ["x"], "names": ["c"]})], 30)
    ["...'names': ['b']}", "...'names': ['c']}"]
    >>> differing(["('w0', 3)", "('w1', 3)"])
    ["('w0', 3)", "('w1', 3)"]
    """
    same = 0
    for chars in zip(*texts):
        if len(set(chars)) > 1:
            break
        same += 1
    start = 0
    if same > width // 3:  # from the item the difference is in, if it starts close by
        near = same - width // 2
        comma, brace = texts[0].rfind(", ", near, same), texts[0].rfind("{", near, same)
        found = max(comma + 2 if comma >= 0 else -1, brace + 1 if brace >= 0 else -1)
        start = found if found > 0 else same - width // 3
    return [
        ("..." if start else "")
        + text[start : start + width]
        + ("..." if len(text) > start + width else "")
        for text in texts
    ]
