"""The exceptions treegather raises, and the checks of plain arguments that raise them.

Every class refines the builtin a caller would catch anyway (``ValueError``,
``TypeError``) and shows ``treegather`` as its module in tracebacks.
"""

from __future__ import annotations

import operator

__all__ = [
    "EXPLAIN_POINTER",
    "layout_error",
    "TreegatherError",
    "LayoutError",
    "StructureMismatchError",
    "BatchSizeError",
    "LeafTypeError",
    "ShapeMismatchError",
    "DeviceError",
    "ArgumentTypeError",
    "StateError",
    "check_dim",
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


class DeviceError(TreegatherError, ValueError):
    """A device names nothing usable: an unknown string (``"gpu:0"``), an index below ``-1``, or
    a CUDA device (an int id counts) on a machine where CUDA is not available."""


class ArgumentTypeError(TreegatherError, TypeError):
    """An argument has the wrong type: ``dim=True`` or ``dim=1.0`` (a dim is an int), a device
    given as ``True``, ``1.0`` or ``None`` (a device is an int, a string or a ``torch.device``)."""


class StateError(TreegatherError, RuntimeError):
    """An object is used out of order: a :class:`treegather.distributed.Collector` added to
    or exchanged again after its exchange, without ``reset()``."""


for _cls in (
    StateError,
    TreegatherError,
    LayoutError,
    StructureMismatchError,
    BatchSizeError,
    LeafTypeError,
    ShapeMismatchError,
    DeviceError,
    ArgumentTypeError,
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


def check_dim(dim: object, where: str) -> int:
    """``dim`` as an int, or an :class:`ArgumentTypeError` naming ``where`` it was given.

    Any int is accepted (negative dims count from the end; whether the dim exists is checked
    against each tensor later), and integer types with ``__index__`` (``numpy.int64``) become
    ``int``. ``True``/``False`` and floats are refused: torch would read ``True`` as dim 1.

    >>> check_dim(-1, "gather")
    -1
    >>> check_dim(True, "scatter")
    Traceback (most recent call last):
    ...
    treegather.ArgumentTypeError: scatter: dim must be an int (...), got bool True; write dim=0 ...
    """
    if type(dim) is int:
        return dim
    if not isinstance(dim, bool):
        try:
            return operator.index(dim)  # type: ignore[arg-type]
        except TypeError:
            pass
    if isinstance(dim, bool):
        fix = "write dim=0 or dim=1 (a bool is not a dim)"
    elif isinstance(dim, float) and dim.is_integer():
        fix = f"write dim={int(dim)}"
    else:
        fix = "write an int such as dim=0"
    raise ArgumentTypeError(
        f"{where}: dim must be an int (a tensor dim, negative from the end), "
        f"got {type(dim).__name__} {dim!r}; {fix}"
    )


EXPLAIN_POINTER = "(treegather.explain(tree, layout) shows the rule of every leaf)"
"""The line every layout error ends with: where to see what a layout does to each leaf."""


def layout_error(message: str) -> LayoutError:
    """A :class:`LayoutError` about fitting a layout to data, ending with the explain pointer."""
    return LayoutError(f"{message}\n{EXPLAIN_POINTER}")
