"""The gather rules that take a value whole: as_list, first, cat_items and custom callables.

On an inner node each takes the per-replica subtrees whole (they may differ inside, like
per-sample lists of uneven length). Each class combines them (:meth:`combine`, raising typed
errors that name the node), says what is wrong (:meth:`problem`: tensors without data it
would move or compare) and what they become (:meth:`becomes`). :data:`LEAF_AS_LIST` is the default rule of a leaf
that is not a tensor.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._errors import BatchSizeError, LeafTypeError, ShapeMismatchError, safe_repr
from .._tree import describe, display_path, flatten, format_path, move_tree, nodes
from . import kinds
from .base import Combining, GatherRule, Problem, constructor, custom_rule
from .leafwise import JOIN_ROWS

__all__ = [
    "JOIN_ROWS",
    "LEAF_AS_LIST",
    "ROOT",
    "AsList",
    "CatItems",
    "Custom",
    "First",
    "as_list",
    "cat_items",
    "first",
    "where",
]

Tensor = torch.Tensor
ROOT = "outputs"  # how gather's messages name the tree
MAX_PATHS = 10


def where(node: Any) -> str:
    """``"outputs['x']: "`` for a plan node (``""`` without one), to start an error message."""
    return "" if node is None else f"{display_path(node, ROOT)}: "


@dataclasses.dataclass(frozen=True)
class AsList(GatherRule, name="as_list"):
    """The per-replica values, untouched (the default for non-tensors)."""

    whole = True

    def describe(self) -> str:
        return "as_list()"

    def combine(self, col: tuple[Any, ...], ctx: Combining) -> Any:
        return list(col)

    def becomes(self, x: Any, k: int | None) -> tuple[str, str | None]:
        return f"list of {'k' if k is None else k} per-replica values", None


class _LeafAsList(AsList):
    """``as_list()`` as the default rule of a leaf that is not a tensor: an unregistered
    dataclass there is refused (gather cannot look inside it)."""

    whole = False

    def combine(self, col: tuple[Any, ...], ctx: Combining) -> Any:
        if dataclasses.is_dataclass(col[0]) and not isinstance(col[0], type):
            raise TypeError("an unregistered dataclass output")
        return list(col)

    def problem(self, col: tuple[Any, ...], ctx: Combining, shown: str = "") -> Problem | None:
        classes = {type(v) for v in col if dataclasses.is_dataclass(v) and not isinstance(v, type)}
        if not classes:
            return None
        names = ", ".join(sorted(c.__qualname__ for c in classes))
        return Problem(
            f"{names} is a dataclass treegather does not know, so {shown or 'as_list()'} cannot "
            "look inside it; register it with treegather.register_dataclass",
            True,
            "dataclass",
        )


LEAF_AS_LIST = _LeafAsList()


@dataclasses.dataclass(frozen=True)
class First(GatherRule, name="first"):
    """Replica 0's value (tensors moved to the target); ``check``: every replica must agree."""

    check: bool = False
    whole = True

    def combine(self, col: tuple[Any, ...], ctx: Combining) -> Any:
        if self.check:
            for r, other in enumerate(col[1:], start=1):
                if not tree_equal(col[0], other):
                    raise ShapeMismatchError(
                        f"{where(ctx.node)}first(check=True): replica {r} differs from replica 0"
                        f" ({describe(other)} vs {describe(col[0])})"
                    )
        return move_tree(col[0], ctx.target)

    def problem(self, col: tuple[Any, ...], ctx: Combining, shown: str = "") -> Problem | None:
        # (with check, every replica's value is compared: none may lack data)
        return _without_data(col if self.check else col[:1], ctx, shown or self.describe())

    def becomes(self, x: Any, k: int | None) -> tuple[str, str | None]:
        checked = " (checked equal in every replica)" if self.check else ""
        return "replica 0's value" + checked, None


@dataclasses.dataclass(frozen=True)
class CatItems(GatherRule, name="cat_items"):
    """Per-replica lists (or tuples) of items, one after the other (inverse of split_items)."""

    whole = True

    def describe(self) -> str:
        return "cat_items()"

    def combine(self, col: tuple[Any, ...], ctx: Combining) -> Any:
        node, sizes = ctx.node, ctx.sizes
        for r, v in enumerate(col):
            if not isinstance(v, (list, tuple)):
                raise LeafTypeError(
                    f"{where(node)}cat_items() needs a list or tuple in every replica; replica "
                    f"{r} holds {describe(v)}"
                )
        if sizes is not None and [len(v) for v in col] != list(sizes):
            lengths = ", ".join(f"replica {r}: {len(v)}" for r, v in enumerate(col))
            raise BatchSizeError(
                f"{where(node)}cat_items() got lists of {lengths} items for shards of "
                f"{list(sizes)} rows: the items are not per sample of the shard.\nHint: split "
                "a per-sample list with split_items() in the in-layout, so that each replica "
                "gets (and returns) its own items; as_list() keeps per-replica values"
            )
        items = list(itertools.chain.from_iterable(col))
        if any(issubclass(t, Tensor) for t in set(map(type, items))):
            items = move_tree(items, ctx.target)  # (strings and numbers stay as they are)
        return tuple(items) if isinstance(col[0], tuple) else items

    def problem(self, col: tuple[Any, ...], ctx: Combining, shown: str = "") -> Problem | None:
        return _without_data(col, ctx, shown or self.describe())

    def becomes(self, x: Any, k: int | None) -> tuple[str, str | None]:
        if not isinstance(x, (list, tuple)):
            return "-", f"{self.describe()} needs a list or tuple, got {type(x).__qualname__}"
        n = f"{k * len(x)}" if k is not None else f"k*{len(x)}"
        return f"{type(x).__qualname__} of {n} item(s) (if every replica has {len(x)})", None


@dataclasses.dataclass(frozen=True)
class Custom(GatherRule):
    """A callable ``f(values, device)`` given the per-replica values (subtrees on a node)."""

    fn: Callable[[list[Any], torch.device], Any]
    whole = True

    def describe(self) -> str:
        return f"custom rule {safe_repr(getattr(self.fn, '__qualname__', self.fn))}"

    def combine(self, col: tuple[Any, ...], ctx: Combining) -> Any:
        try:
            return self.fn(list(col), ctx.target)
        except Exception as exc:  # keep the user's exception, say where it came from
            note = (
                f"raised by the gather rule {self.describe()} at {where(ctx.node).rstrip(': ')} "
                "(a custom rule is called as f(values, device) with the per-replica values)"
            )
            if note not in getattr(exc, "__notes__", ()):
                exc.add_note(note)
            raise

    def becomes(self, x: Any, k: int | None) -> tuple[str, str | None]:
        return (
            f"what {safe_repr(getattr(self.fn, '__qualname__', self.fn), text=str)} returns",
            None,
        )


custom_rule(Custom)


def _without_data(values: Sequence[Any], ctx: Combining, shown: str) -> Problem | None:
    """The tensors without data a whole-value rule would move onto the target or compare
    (``first()``: replica 0's value, every replica's with ``check``; ``cat_items()``: every
    replica's items): meta tensors (unless the target is the meta device), uninitialized
    parameters."""
    if ctx.node is None:
        return None
    root = display_path(ctx.node, ROOT)
    found: list[str] = []
    first: Tensor | None = None
    for r, value in enumerate(values):
        leaves, spec = flatten(value, root)
        empty = [
            isinstance(x, Tensor)
            and kinds.no_data(x)
            and not (x.is_meta and ctx.target.type == "meta")
            for x in leaves
        ]
        if not any(empty):
            continue
        paths = [format_path(root, n.path) for n in nodes(spec) if n.spec.is_leaf()]
        found += [f"{p} (replica {r})" for p, e in zip(paths, empty) if e]
        if first is None:
            first = next(x for x, e in zip(leaves, empty) if e)
    if first is None:
        return None
    shown_paths = ", ".join(found[:MAX_PATHS]) + (" ..." if len(found) > MAX_PATHS else "")
    text, hint = kinds.no_data_text(first, ctx.target, shown)
    return Problem(text, True, hint, path=shown_paths)


def tree_equal(a: Any, b: Any) -> bool:
    """Whether two subtrees hold equal values (tensors of every kind by value, array-likes as
    arrays), NaN equal to NaN in the same place (a value compared with itself is the same
    value)."""
    la, sa = flatten(a)
    lb, sb = flatten(b)
    if sa != sb:
        return False
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            if not (isinstance(x, Tensor) and isinstance(y, Tensor)):
                return False
            if not kinds.same_values(x, y):
                return False
        elif not _same_value(x, y):
            return False
    return True


def _same_value(x: Any, y: Any) -> bool:
    """``x == y`` as one bool, NaN equal to NaN in the same place; array-likes (numpy arrays,
    ...) compared as arrays: the same shape, then every element (``bool()`` of an elementwise
    ``==`` is ambiguous). Duck-typed: numpy is not a dependency."""
    shape_x, shape_y = getattr(x, "shape", None), getattr(y, "shape", None)
    if shape_x is None and shape_y is None:
        return bool(x == y) or _both_nan(x, y)
    try:
        if tuple(shape_x) != tuple(shape_y):  # type: ignore[arg-type]
            return False
    except TypeError:  # a ``shape`` that is not a sequence of dims: compare the values
        return bool(x == y) or _both_nan(x, y)
    same = x == y
    if _has_nan(x) and _has_nan(y):  # (NaN is only in float and complex arrays)
        same = same | ((x != x) & (y != y))  # NaN in both, there
    for _ in range(64):  # an array of results: reduce it with its own all() (a DataFrame: twice)
        every = getattr(same, "all", None)
        if not getattr(same, "ndim", 0) or not callable(every):
            break
        same = every()
    return bool(same)


def _both_nan(x: Any, y: Any) -> bool:
    """Two numbers (Python's, numpy's) that are NaN alike: a float NaN each, or complex numbers
    with NaN in the same parts and the other parts equal."""
    if not (isinstance(x, numbers.Number) and isinstance(y, numbers.Number)):
        return False
    if isinstance(x, numbers.Real) and isinstance(y, numbers.Real):
        return bool(x != x and y != y)
    if not (isinstance(x, numbers.Complex) and isinstance(y, numbers.Complex)):
        return False
    parts = [(x.real, y.real), (x.imag, y.imag)]
    return all(p == q or (p != p and q != q) for p, q in parts)


def _has_nan(x: Any) -> bool:
    """Whether an array-like may hold a NaN: a floating or complex dtype (numpy's kinds)."""
    return getattr(getattr(x, "dtype", None), "kind", None) in ("f", "c")


# --------------------------------------------------------------------------- constructors


@constructor(AsList)
def as_list() -> AsList:
    """Gather rule: the per-replica values, untouched (the default for non-tensors).

    On an inner node it gives the list of per-replica subtrees.

    >>> import treegather as tg
    >>> tg.gather([{"meta": {"id": 1}}, {"meta": {"id": 2}}], "cpu", {"meta": tg.as_list()})
    {'meta': [{'id': 1}, {'id': 2}]}
    """
    return AsList()


@constructor(First)
def first(check: bool = False) -> First:
    """Gather rule: replica 0's value (tensors moved to the target device).

    With ``check=True`` it is an error if any replica holds a different value.

    >>> import treegather as tg
    >>> tg.gather([{"lr": 0.1}, {"lr": 0.1}], "cpu", tg.first(check=True))
    {'lr': 0.1}
    """
    return First(bool(check))


@constructor(CatItems)
def cat_items() -> CatItems:
    """Gather rule: concatenate per-replica lists/tuples of items into one (inverse of split_items).

    >>> import treegather as tg
    >>> tg.gather([{"ids": ["a", "b"]}, {"ids": ["c"]}], "cpu", {"ids": tg.cat_items()})
    {'ids': ['a', 'b', 'c']}
    """
    return CatItems()
