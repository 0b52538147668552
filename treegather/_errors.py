"""The exceptions treegather raises, and the checks of plain arguments that raise them.

Every class refines the builtin a caller would catch anyway (``ValueError``,
``TypeError``, ``RuntimeError`` where torch raises that) and shows ``treegather`` as its module in tracebacks.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

__all__ = [
    "EXPLAIN_POINTER",
    "REPR_LIMIT",
    "safe_repr",
    "layout_error",
    "TreegatherError",
    "LayoutError",
    "StructureMismatchError",
    "BatchSizeError",
    "WeightError",
    "LeafTypeError",
    "ShapeMismatchError",
    "DeviceError",
    "ArgumentTypeError",
    "UninitializedModuleError",
    "TreeDepthError",
    "StateError",
    "check_dim",
]


class TreegatherError(Exception):
    """Base class of every error treegather raises on bad input."""


class LayoutError(TreegatherError, ValueError):
    """A layout does not fit the data: unknown rule, prefix mismatch, pattern matching nothing."""


class StructureMismatchError(TreegatherError, ValueError):
    """Per-replica (or per-rank) trees differ in structure: a key, a length, ``None`` vs a value.

    Also a list that holds one item per sample of each replica's shard, gathered by the default
    rules with the shard sizes known (its replicas' lengths differ as soon as the shards do;
    ``cat_items()`` gathers it)."""


class BatchSizeError(TreegatherError, ValueError):
    """Split leaves disagree on the batch size, or explicit shard sizes do not add up."""


class WeightError(BatchSizeError):
    """``mean(weight=f)`` could not weigh a replica: ``f`` does not take the shard's call or
    raised (its exception is the ``__cause__``), or it returned a weight below 0, NaN or
    infinite. The message names the path and the rule. (A weight that is no number at all is an
    :class:`ArgumentTypeError`.)"""


class LeafTypeError(TreegatherError, TypeError):
    """A rule was applied to a leaf it cannot handle (e.g. ``split()`` on a string)."""


class ShapeMismatchError(TreegatherError, ValueError):
    """Per-replica tensors cannot be combined: other dims, dtypes or devices disagree, or (with
    the shard sizes known) the default rule would join a tensor along a dim other than the one
    its rows are along."""


class DeviceError(TreegatherError, ValueError):
    """A device names nothing usable: an unknown string (``"gpu:0"``), an index below ``-1``, or
    a CUDA device (an int id counts) on a machine where CUDA is not available."""


class ArgumentTypeError(TreegatherError, TypeError):
    """An argument has the wrong type: ``dim=True`` or ``dim=1.0`` (a dim is an int), a device
    given as ``True``, ``1.0`` or ``None`` (a device is an int, a string or a ``torch.device``)."""


class UninitializedModuleError(TreegatherError, RuntimeError):
    """A module with uninitialized (lazy) parameters or buffers (``nn.LazyLinear`` before its first
    forward) was to be replicated; the message names each such module and says to run one forward
    on one device first. A ``RuntimeError``, as torch's own refusal of lazy modules is."""


class TreeDepthError(TreegatherError, ValueError):
    """A tree that cannot be flattened: it contains itself (a cycle, ``d["self"] = d``) or is
    nested deeper than optree's limit (1000 levels). The message names the path where the cycle
    closes, or where the limit is passed."""


class StateError(TreegatherError, RuntimeError):
    """An object is used out of order: a :class:`treegather.distributed.Collector` added to
    or exchanged again after its exchange, without ``reset()``."""


for _cls in (
    StateError,
    TreegatherError,
    LayoutError,
    StructureMismatchError,
    BatchSizeError,
    WeightError,
    LeafTypeError,
    ShapeMismatchError,
    DeviceError,
    ArgumentTypeError,
    UninitializedModuleError,
    TreeDepthError,
):
    _cls.__module__ = "treegather"
del _cls


REPR_LIMIT = 80
"""The most characters of one user value an error message shows (see :func:`safe_repr`)."""


def safe_repr(
    value: Any,
    limit: int | None = REPR_LIMIT,
    *,
    text: Callable[[Any], str] = repr,
    stable: bool = False,
) -> str:
    """``repr(value)`` for a message, whatever the value: the one way treegather writes a user
    value (a leaf, a dict key, node metadata, an argument) into an error or explanation.

    A ``repr`` that raises (a lazy proxy, a handle to a closed resource) or returns something
    other than a ``str`` gives ``<Foo object at 0x...>`` instead, so the message stays the one
    about the user's problem; a longer text than ``limit`` characters is cut, ending ``...``
    (``None``: never cut). ``text=str`` for a value's ``str`` with the same fallback;
    ``stable=True`` for a fallback without the address (``<Foo object>``: the same in every
    process, for a key several ranks compare).

    >>> class Odd:
    ...     def __repr__(self): raise RuntimeError("closed")
    >>> safe_repr(Odd()).startswith("<Odd object at 0x")
    True
    >>> safe_repr("x" * 100, 10), safe_repr(["a"])
    ("'xxxxxx...", "['a']")
    """
    try:
        shown = text(value)
        if type(shown) is not str:
            raise TypeError(f"{text.__name__}() returned {type(shown).__name__}")
    except Exception:
        if type(value) in (tuple, list) and text is repr:  # (node metadata): item by item
            items = [safe_repr(v, limit, stable=stable, text=_flat) for v in value]
            tail = "," if type(value) is tuple and len(items) == 1 else ""
            ends = "()" if type(value) is tuple else "[]"
            shown = ends[0] + ", ".join(items) + tail + ends[1]
        else:
            shown = _fallback(value, stable)
    if limit is not None and len(shown) > limit:
        shown = shown[: max(limit - 3, 0)] + "..."
    return shown


def _flat(value: Any) -> str:
    """``repr`` for an item of a container whose own repr failed (no second level)."""
    return repr(value) if type(value) not in (tuple, list) else _fallback(value, True)


def _fallback(value: Any, stable: bool) -> str:
    where = "" if stable else f" at {id(value):#x}"
    return f"<{_type_name(value)} object{where}>"


def _type_name(value: Any) -> str:
    try:
        return str(type(value).__qualname__)
    except Exception:  # a metaclass with a misbehaving __qualname__
        return "object"


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
