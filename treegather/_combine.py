"""How each gather rule combines one position's per-replica values.

Leaf-wise rules (:func:`cat`, :func:`stack`, :func:`mean`, :func:`sum`, :func:`pad`, and the
defaults) combine tensors; whole-value rules (:func:`as_list`, :func:`first`,
:func:`cat_items`, custom callables) take per-replica subtrees. These functions raise plain
errors for bad data; :func:`treegather._mismatch.diagnose` then names the paths.
"""

from __future__ import annotations

import builtins
import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ._errors import BatchSizeError, LeafTypeError, ShapeMismatchError
from ._layout import Plan
from ._mismatch import is_number, where
from ._rules import (
    AsList,
    Cat,
    CatItems,
    Custom,
    First,
    Mean,
    Pad,
    Padded,
    Rule,
    Stack,
    Sum,
    fill_fits,
)
from ._tree import describe, flatten, move_tree

__all__ = ["combine_default", "combine_planned", "needs_move"]

Tensor = torch.Tensor


def needs_move(columns: list[tuple[Any, ...]], target: torch.device) -> bool:
    """Whether any replica's tensors live off ``target`` (sampled: the first tensor position).

    Only a hint for the fast path: a leaf elsewhere is still moved, just less cheaply (and a
    meta tensor elsewhere still found: moving it raises, and ``gather`` names its path).
    """
    for column in columns:
        if any(type(v) is Tensor or isinstance(v, Tensor) for v in column):
            return any(isinstance(v, Tensor) and v.device != target for v in column)
    return False


def _one_dtype(col: Sequence[Tensor]) -> None:
    """Refuse per-replica tensors of several dtypes (torch would promote them: an int64 id
    becomes a float32 that cannot hold it); ``diagnose`` names the path and each dtype."""
    first = col[0].dtype
    for v in col:
        if v.dtype != first:
            raise ValueError("per-replica tensors have different dtypes")


def _to(values: Sequence[Tensor], target: torch.device) -> list[Tensor]:
    nb = target.type == "cuda"
    return [v if v.device == target else v.to(target, non_blocking=nb) for v in values]


def _cat(col: Sequence[Tensor], target: torch.device, moving: bool, dim: int) -> Tensor:
    _one_dtype(col)
    if moving:
        col = _to(col, target)
    if col[0].dim() == 0:
        try:
            out = torch.stack(col)  # type: ignore[arg-type]
        except RuntimeError:
            if moving:
                raise
            out = torch.stack(_to(col, target))
    else:
        try:
            out = torch.cat(col, dim)  # type: ignore[arg-type]
        except RuntimeError:
            if moving:
                raise
            out = torch.cat(_to(col, target), dim)
    if out.device != target:
        out = out.to(target)
    return out


def combine_default(
    columns: Iterable[tuple[Any, ...]],
    target: torch.device,
    moving: bool,
    dim: int,
) -> list[Any]:
    """The default rules (tensors: cat, others: as_list), leaf by leaf.

    Every result is checked to be on ``target``: ``torch.cat`` of a column wholly on another
    device (a GPU, or the meta device even on a CPU-only machine) stays there, and moving it
    there raises for a meta tensor (``gather`` then names the path).
    (The all-tensor CPU case of a structure seen before never gets here: ``gather`` does it in
    one comprehension.)
    """
    if moving:
        return [
            _cat(col, target, True, dim) if isinstance(col[0], Tensor) else _as_list(col)
            for col in columns
        ]
    cat = torch.cat
    out: list[Any] = []
    append = out.append
    cpu = target.type == "cpu"
    index = target.index
    for col in columns:
        try:
            r = cat(col, dim) if dim else cat(col)
        except (TypeError, RuntimeError):
            if isinstance(col[0], Tensor):  # 0-dim values, or replicas on several devices
                append(_cat(col, target, False, dim))
            else:
                append(_as_list(col))
            continue
        _one_dtype(col)  # torch.cat promoted mixed dtypes: refuse them
        if (not r.is_cpu) if cpu else (r.get_device() != index):
            r = r.to(target)
        append(r)
    return out


def _as_list(col: tuple[Any, ...]) -> list[Any]:
    """The default for non-tensors: the per-replica values; an unregistered dataclass is an
    error (``diagnose`` names the path and hints ``register_dataclass``)."""
    if dataclasses.is_dataclass(col[0]) and not isinstance(col[0], type):
        raise TypeError("an unregistered dataclass output")
    return list(col)


def combine_planned(
    plan: Plan,
    columns: Iterable[tuple[Any, ...]],
    target: torch.device,
    moving: bool,
    sizes: tuple[int, ...] | None,
    dim: int,
) -> list[Any]:
    out: list[Any] = []
    default = combine_default
    deferred = []
    for pos, col in enumerate(columns):
        group = plan.groups[pos]
        if group is not None:
            # Whole-value rules (custom callables may have side effects) run only once every
            # leaf-wise rule has succeeded.
            deferred.append((pos, group, col))
            out.append(None)
            continue
        rule = plan.rules[pos]
        if rule is None:
            out.extend(default([col], target, moving, dim))
        else:
            out.append(_leaf(rule, col, target, moving, sizes))
    for pos, group, col in deferred:
        out[pos] = _whole(group[2], col, target, group[1], sizes)
    return out


def _leaf(
    rule: Rule,
    col: tuple[Any, ...],
    target: torch.device,
    moving: bool,
    sizes: tuple[int, ...] | None,
) -> Any:
    if isinstance(rule, Cat):
        return _cat(col, target, moving, rule.dim)
    if isinstance(rule, (Mean, Sum)):
        return _reduce(rule, col, target, sizes)
    if isinstance(rule, Stack):
        _one_dtype(col)
        return torch.stack(_to(col, target), rule.dim)
    if isinstance(rule, Pad):
        return _pad(rule, col, target)
    raise LeafTypeError(f"{rule.describe()} is not a gather rule")


def _reduce(
    rule: Rule, col: tuple[Any, ...], target: torch.device, sizes: tuple[int, ...] | None
) -> Any:
    if sizes is not None and builtins.sum(sizes) == 0:
        if len(sizes) > 1:  # weights that are all zero weigh nothing: no mean to take
            raise ValueError("mean() weighted by sizes needs sizes that add up to more than 0")
        sizes = None  # an empty batch (one empty shard): nothing to weight by
    if all(is_number(v) for v in col):
        if isinstance(rule, Sum):
            return builtins.sum(col)
        if sizes is None:
            return builtins.sum(col) / len(col)
        total = builtins.sum(sizes)
        if all(type(v) is int for v in col):  # exact
            return builtins.sum(v * s for v, s in zip(col, sizes)) / total
        # Each value times its share of the rows: never a product larger than the value (a
        # numpy float16 times 4096 rows overflows); a share of 0 leaves the value out (NaN).
        return builtins.sum(v * (s / total) for v, s in zip(col, sizes) if s)
    _one_dtype(col)
    stacked = torch.stack(_to(col, target))
    if isinstance(rule, Sum):
        return stacked.sum(0)
    if not (stacked.is_floating_point() or stacked.is_complex()):
        stacked = stacked.to(torch.get_default_dtype())
    if sizes is None:
        return stacked.mean(0)
    return _weighted_mean(stacked, sizes)


# The dtype torch's mean accumulates in, where it is not the input's (at::opmath_type).
_ACCUMULATE = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.complex32: torch.complex64,
}


def _weighted_mean(stacked: Tensor, sizes: tuple[int, ...]) -> Tensor:
    """The mean of ``stacked`` along dim 0 weighted by ``sizes`` (adding up to more than 0),
    accumulated as :func:`torch.mean` does (float16 and bfloat16 in float32), each value times
    its share of the rows (so no product exceeds the value: a float16 loss of 100 times 4096
    rows would be inf), and returned in the input's dtype. A replica of 0 rows takes no part:
    its value (the NaN mean of an empty batch) is replaced by 0 before it is weighted by 0,
    which also gives it a zero gradient rather than a NaN one."""
    dtype = stacked.dtype
    wide = _ACCUMULATE.get(dtype, dtype)
    total = builtins.sum(sizes)
    shape = (-1,) + (1,) * (stacked.dim() - 1)
    shares = torch.tensor([s / total for s in sizes], dtype=wide, device=stacked.device)
    values = stacked.to(wide)
    if 0 in sizes:
        kept = torch.tensor([s > 0 for s in sizes], device=stacked.device).reshape(shape)
        values = torch.where(kept, values, torch.zeros((), dtype=wide, device=stacked.device))
    return (values * shares.reshape(shape)).sum(0).to(dtype)


def _pad(rule: Pad, col: tuple[Any, ...], target: torch.device) -> Any:
    _one_dtype(col)
    if not fill_fits(rule.fill, col[0].dtype):
        raise ValueError(f"pad(fill={rule.fill!r}) cannot be stored in {col[0].dtype}")
    values = _to(col, target)
    ndim = values[0].dim()
    if ndim == 0 or any(v.dim() != ndim for v in values):
        # A plain ValueError: gather's diagnose turns it into a message naming the leaf's path.
        raise ValueError("pad() needs tensors of the same number of dims (at least 1)")
    if not -ndim <= rule.dim < ndim:  # never wrap around: pad(dim=2) on 2-dim tensors is a mistake
        raise ValueError(f"pad(dim={rule.dim}) is out of range for {ndim}-dim tensors")
    d = rule.dim % ndim
    shape = [builtins.max(v.shape[j] for v in values) for j in range(ndim)]
    padded = []
    for v in values:
        want = list(shape)
        want[d] = v.shape[d]
        if list(v.shape) == want:
            padded.append(v)
            continue
        buf = v.new_full(want, rule.fill)
        buf[tuple(slice(0, s) for s in v.shape)] = v
        padded.append(buf)
    data = torch.cat(padded, d)
    if not rule.lengths:
        return data
    lengths = torch.tensor([list(v.shape) for v in values], dtype=torch.long, device=target)
    return Padded(data, lengths)


def _whole(
    rule: Rule,
    col: tuple[Any, ...],
    target: torch.device,
    node: Any = None,
    sizes: tuple[int, ...] | None = None,
) -> Any:
    if isinstance(rule, AsList):
        return list(col)
    if isinstance(rule, First):
        if rule.check:
            for r, other in enumerate(col[1:], start=1):
                if not _tree_equal(col[0], other):
                    raise ShapeMismatchError(
                        f"{where(node)}first(check=True): replica {r} differs from replica 0"
                        f" ({describe(other)} vs {describe(col[0])})"
                    )
        return move_tree(col[0], target)
    if isinstance(rule, CatItems):
        for r, v in enumerate(col):
            if not isinstance(v, (list, tuple)):
                raise LeafTypeError(
                    f"{where(node)}cat_items() needs a list or tuple in every replica; replica {r} holds "
                    f"{describe(v)}"
                )
        if sizes is not None and [len(v) for v in col] != list(sizes):
            lengths = ", ".join(f"replica {r}: {len(v)}" for r, v in enumerate(col))
            raise BatchSizeError(
                f"{where(node)}cat_items() got lists of {lengths} items for shards of "
                f"{list(sizes)} rows: the items are not per sample of the shard.\nHint: split "
                "a per-sample list with split_items() in the in-layout, so that each replica "
                "gets (and returns) its own items; as_list() keeps per-replica values"
            )
        items = move_tree(list(itertools.chain.from_iterable(col)), target)
        return tuple(items) if isinstance(col[0], tuple) else items
    if isinstance(rule, Custom):
        try:
            return rule.fn(list(col), target)
        except Exception as exc:  # keep the user's exception, say where it came from
            note = (
                f"raised by the gather rule {rule.describe()} at {where(node).rstrip(': ')} "
                "(a custom rule is called as f(values, device) with the per-replica values)"
            )
            if note not in getattr(exc, "__notes__", ()):
                exc.add_note(note)
            raise
    raise LeafTypeError(f"{rule.describe()} is not a gather rule")


def _tree_equal(a: Any, b: Any) -> bool:
    la, sa = flatten(a)
    lb, sb = flatten(b)
    if sa != sb:
        return False
    for x, y in zip(la, lb):
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            if not (isinstance(x, Tensor) and isinstance(y, Tensor)):
                return False
            if x.shape != y.shape or not torch.equal(x, y.to(x.device)):
                return False
        elif not _same_value(x, y):
            return False
    return True


def _same_value(x: Any, y: Any) -> bool:
    """``x == y`` as one bool; array-likes (numpy arrays, ...) compared as arrays: the same
    shape, then every element (``bool()`` of an elementwise ``==`` is ambiguous). Duck-typed:
    numpy is not a dependency."""
    shape_x, shape_y = getattr(x, "shape", None), getattr(y, "shape", None)
    if shape_x is None and shape_y is None:
        return bool(x == y)
    try:
        if tuple(shape_x) != tuple(shape_y):  # type: ignore[arg-type]
            return False
    except TypeError:  # a ``shape`` that is not a sequence of dims: compare the values
        return bool(x == y)
    same = x == y
    for _ in range(64):  # an array of results: reduce it with its own all() (a DataFrame: twice)
        every = getattr(same, "all", None)
        if not getattr(same, "ndim", 0) or not callable(every):
            break
        same = every()
    return bool(same)
