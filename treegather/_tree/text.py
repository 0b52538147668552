"""How messages and tables describe a value: a tensor's shape, dtype and device, else its repr."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]

from .._errors import safe_repr

__all__ = ["describe", "dtype_text", "shape_text"]


def shape_text(shape: Sequence[Any]) -> str:
    """A shape as tables and messages write it: ``(3,)``, ``(2, 4)``, ``()``.

    >>> shape_text([3]), shape_text([2, "k*4"]), shape_text([])
    ('(3,)', '(2, k*4)', '()')
    """
    return f"({shape[0]},)" if len(shape) == 1 else "(" + ", ".join(map(str, shape)) + ")"


def dtype_text(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def describe(value: Any) -> str:
    """A short description of a leaf for error messages: shape/dtype/device or type, and a
    ``repr`` cut to 60 characters that never raises (:func:`treegather._errors.safe_repr`)."""
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
