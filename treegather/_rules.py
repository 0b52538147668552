"""Layout rules: what happens to one leaf (or one subtree) on the way in and on the way out.

A rule is a small frozen object. Scatter rules (:func:`split`, :func:`broadcast`,
:func:`split_items`) say how an input is divided over devices; gather rules (:func:`cat`,
:func:`stack`, :func:`mean`, :func:`sum`, :func:`pad`, :func:`as_list`, :func:`first`,
:func:`cat_items`, or any callable ``f(values, device)``) say how per-replica outputs become one.
Leaf-wise rules placed on an inner node apply to every leaf below it; whole-value rules
(:func:`split_items`, :func:`as_list`, :func:`first`, :func:`cat_items`, callables) take the
subtree whole.
"""

from __future__ import annotations

import builtins
import dataclasses
import difflib
import numbers
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import torch

from ._errors import layout_error, safe_repr

__all__ = [
    "Rule",
    "ScatterRule",
    "GatherRule",
    "Split",
    "Broadcast",
    "SplitItems",
    "Cat",
    "Stack",
    "Mean",
    "Sum",
    "Pad",
    "AsList",
    "First",
    "CatItems",
    "Custom",
    "Padded",
    "split",
    "broadcast",
    "split_items",
    "cat",
    "stack",
    "mean",
    "sum",
    "pad",
    "as_list",
    "first",
    "cat_items",
    "fill_fits",
    "to_rule",
]


class Rule:
    """Base class of layout rules."""

    phase: ClassVar[str] = ""
    whole: ClassVar[bool] = False
    """True when the rule takes a subtree whole instead of applying to each leaf below it."""

    def describe(self) -> str:
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        args = ", ".join(
            f"{f.name}={safe_repr(getattr(self, f.name))}"
            for f in fields
            if getattr(self, f.name) != f.default
        )
        return f"{type(self).__name__.lower()}({args})"

    def _typed_fields(self) -> tuple[Any, ...]:
        """The field values, for :func:`treegather._caches.typed_key` (``True`` is not ``1``)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))  # type: ignore[arg-type]


class ScatterRule(Rule):
    """A rule for :func:`treegather.scatter`."""

    phase = "scatter"


class GatherRule(Rule):
    """A rule for :func:`treegather.gather`."""

    phase = "gather"


@dataclasses.dataclass(frozen=True)
class Split(ScatterRule):
    dim: int = 0
    sizes: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Broadcast(ScatterRule):
    pass


@dataclasses.dataclass(frozen=True)
class SplitItems(ScatterRule):
    whole = True

    def describe(self) -> str:
        return "split_items()"


@dataclasses.dataclass(frozen=True)
class Cat(GatherRule):
    dim: int = 0


@dataclasses.dataclass(frozen=True)
class Stack(GatherRule):
    dim: int = 0


@dataclasses.dataclass(frozen=True)
class Mean(GatherRule):
    pass


@dataclasses.dataclass(frozen=True)
class Sum(GatherRule):
    pass


@dataclasses.dataclass(frozen=True)
class Pad(GatherRule):
    dim: int = 0
    fill: float = 0
    lengths: bool = False


@dataclasses.dataclass(frozen=True)
class AsList(GatherRule):
    whole = True

    def describe(self) -> str:
        return "as_list()"


@dataclasses.dataclass(frozen=True)
class First(GatherRule):
    check: bool = False
    whole = True


@dataclasses.dataclass(frozen=True)
class CatItems(GatherRule):
    whole = True

    def describe(self) -> str:
        return "cat_items()"


@dataclasses.dataclass(frozen=True)
class Custom(GatherRule):
    fn: Callable[[list[Any], torch.device], Any]
    whole = True

    def describe(self) -> str:
        return f"custom rule {safe_repr(getattr(self.fn, '__qualname__', self.fn))}"


class Padded(NamedTuple):
    """What :func:`pad` with ``lengths=True`` gathers a leaf into."""

    data: torch.Tensor
    """The per-replica tensors padded to a common shape and concatenated along the pad dim."""
    lengths: torch.Tensor
    """An int64 tensor of shape ``(replicas, ndim)``: each replica's original shape."""


# --------------------------------------------------------------------------- constructors


def split(dim: int = 0, sizes: Sequence[int] | None = None) -> Split:
    """Scatter rule: split a tensor along ``dim`` over the devices.

    The default for tensors of one or more dims (along the call's ``dim``). Shards follow
    ``torch.tensor_split`` (10 rows on 4 devices: 3, 3, 2, 2) unless ``sizes`` gives the rows of
    each shard; every split leaf must agree on the batch size. ``sizes`` names the shards: it
    must add up to the batch size and may name fewer shards than there are devices (then only
    the first ``len(sizes)`` devices get one, as with a batch smaller than the device count);
    more shards than devices is an error.

    >>> import torch, treegather as tg
    >>> [s.shape[1] for s in tg.scatter(torch.zeros(2, 5), ["cpu"] * 2, tg.split(1, sizes=[4, 1]))]
    [4, 1]
    """
    if sizes is not None:
        sizes = tuple(int(s) for s in sizes)
        if not sizes or builtins.min(sizes) <= 0:
            raise ValueError(f"split(sizes=...) needs positive shard sizes, got {list(sizes)}")
    return Split(int(dim), sizes)


def broadcast() -> Broadcast:
    """Scatter rule: every replica gets the whole value (tensors moved to the replica's device).

    The default for non-tensors and 0-dim tensors.

    >>> import torch, treegather as tg
    >>> [s["w"].tolist() for s in tg.scatter({"w": torch.ones(2)}, ["cpu"] * 2, tg.broadcast())]
    [[1.0, 1.0], [1.0, 1.0]]
    """
    return Broadcast()


def split_items() -> SplitItems:
    """Scatter rule for a list/tuple of per-sample items (strings, ragged tensors).

    The sequence is cut into runs matching the tensor split; tensors among the items move to
    the replica's device. Its length must equal the batch size.

    >>> import torch, treegather as tg
    >>> shards = tg.scatter({"x": torch.zeros(3, 1), "ids": ["a", "b", "c"]}, ["cpu"] * 2,
    ...                     tg.by_path({"ids": tg.split_items()}))
    >>> [s["ids"] for s in shards]
    [['a', 'b'], ['c']]
    """
    return SplitItems()


def cat(dim: int = 0) -> Cat:
    """Gather rule: concatenate along ``dim`` (the default for tensors).

    When every replica holds a 0-dim tensor the result is the vector of them, as in torch.

    >>> import torch, treegather as tg
    >>> tg.gather([torch.ones(1, 2), torch.zeros(1, 3)], "cpu", tg.cat(1))
    tensor([[1., 1., 0., 0., 0.]])
    """
    return Cat(int(dim))


def stack(dim: int = 0) -> Stack:
    """Gather rule: stack the per-replica tensors along a new ``dim``.

    >>> import torch, treegather as tg
    >>> tg.gather([torch.ones(2), torch.zeros(2)], "cpu", tg.stack()).shape
    torch.Size([2, 2])
    """
    return Stack(int(dim))


def mean() -> Mean:
    """Gather rule: the mean of the per-replica values, weighted by shard sizes when known.

    With ``gather(..., sizes=[...])`` (which :func:`treegather.data_parallel` passes for you) the
    mean of per-shard batch means equals the full-batch mean, even for uneven splits. Integer
    tensors are promoted to the default float dtype; Python numbers give a Python float.

    The weighted mean accumulates as :func:`torch.mean` does: float16 and bfloat16 values (and
    complex32) in float32, other dtypes in their own, each value multiplied by its share of the
    rows (``sizes[i] / sum(sizes)``, so no product is larger than the value), and the result
    comes back in the values' dtype: a float16 loss of 100.0 over two shards of 4096 rows is
    100.0, not ``inf``. A replica of 0 rows (``sizes[i] == 0``) takes no part in the mean: its
    value (torch's mean of an empty batch is NaN) neither reaches the result nor gets a NaN
    gradient (its gradient is zero). Without ``sizes`` it is the plain :func:`torch.mean` of
    the per-replica values. The result is differentiable either way.

    >>> import torch, treegather as tg
    >>> tg.gather([torch.tensor(1.0), torch.tensor(4.0)], "cpu", tg.mean(), sizes=[2, 1])
    tensor(2.)
    >>> half = [torch.tensor(100.0, dtype=torch.float16)] * 2
    >>> tg.gather(half, "cpu", tg.mean(), sizes=[4096, 4096])
    tensor(100., dtype=torch.float16)
    >>> tg.gather([torch.tensor(1.0), torch.tensor(float("nan"))], "cpu", tg.mean(), sizes=[3, 0])
    tensor(1.)
    """
    return Mean()


def sum() -> Sum:
    """Gather rule: the elementwise sum of the per-replica values.

    >>> import torch, treegather as tg
    >>> tg.gather([{"n": torch.tensor(2)}, {"n": torch.tensor(3)}], "cpu", tg.sum())
    {'n': tensor(5)}
    """
    return Sum()


def pad(dim: int = 0, fill: float = 0, lengths: bool = False) -> Pad:
    """Gather rule: pad every other dim to the largest replica, then concatenate along ``dim``.

    With ``lengths=True`` the leaf becomes ``Padded(data, lengths)``, ``lengths`` holding each
    replica's original shape, shape ``(replicas, ndim)``.

    >>> import torch, treegather as tg
    >>> out = tg.gather([torch.ones(1, 2), torch.ones(1, 3)], "cpu", tg.pad(fill=-1, lengths=True))
    >>> out.data
    tensor([[ 1.,  1., -1.],
            [ 1.,  1.,  1.]])
    >>> out.lengths
    tensor([[1, 2],
            [1, 3]])
    """
    return Pad(int(dim), fill, bool(lengths))


def as_list() -> AsList:
    """Gather rule: the per-replica values, untouched (the default for non-tensors).

    On an inner node it gives the list of per-replica subtrees.

    >>> import treegather as tg
    >>> tg.gather([{"meta": {"id": 1}}, {"meta": {"id": 2}}], "cpu", {"meta": tg.as_list()})
    {'meta': [{'id': 1}, {'id': 2}]}
    """
    return AsList()


def first(check: bool = False) -> First:
    """Gather rule: replica 0's value (tensors moved to the target device).

    With ``check=True`` it is an error if any replica holds a different value.

    >>> import treegather as tg
    >>> tg.gather([{"lr": 0.1}, {"lr": 0.1}], "cpu", tg.first(check=True))
    {'lr': 0.1}
    """
    return First(bool(check))


def cat_items() -> CatItems:
    """Gather rule: concatenate per-replica lists/tuples of items into one (inverse of split_items).

    >>> import treegather as tg
    >>> tg.gather([{"ids": ["a", "b"]}, {"ids": ["c"]}], "cpu", {"ids": tg.cat_items()})
    {'ids': ['a', 'b', 'c']}
    """
    return CatItems()


def fill_fits(fill: Any, dtype: torch.dtype) -> bool:
    """Whether ``pad(fill=...)`` can be stored in ``dtype`` exactly (no wrap, no truncation).

    >>> import torch
    >>> fill_fits(-1, torch.uint8), fill_fits(1.5, torch.int64), fill_fits(True, torch.bool)
    (False, False, True)
    """
    if isinstance(fill, bool):
        return True  # False/True are 0/1 in every dtype
    if not isinstance(fill, numbers.Number):
        return False
    if dtype.is_complex:
        return True
    if isinstance(fill, complex):
        return False
    if dtype.is_floating_point:
        return True
    value = float(fill)  # type: ignore[arg-type]
    if not value.is_integer():  # 1.5, nan, inf
        return False
    if dtype == torch.bool:
        return value in (0.0, 1.0)
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max


SHORTHANDS: dict[str, Callable[[int], Rule]] = {
    "split": lambda d: Split(d),
    "broadcast": lambda d: Broadcast(),
    "split_items": lambda d: SplitItems(),
    "cat": lambda d: Cat(d),
    "stack": lambda d: Stack(d),
    "mean": lambda d: Mean(),
    "sum": lambda d: Sum(),
    "pad": lambda d: Pad(d),
    "as_list": lambda d: AsList(),
    "first": lambda d: First(),
    "cat_items": lambda d: CatItems(),
}


# The rule factories, which written without a call (``{"loss": tg.mean}``) would otherwise be
# taken for custom gather rules; found by identity, never by == (a user callable may not compare).
_FACTORIES: tuple[tuple[Any, str], ...] = (
    (split, "split"),
    (broadcast, "broadcast"),
    (split_items, "split_items"),
    (cat, "cat"),
    (stack, "stack"),
    (mean, "mean"),
    (sum, "sum"),
    (pad, "pad"),
    (as_list, "as_list"),
    (first, "first"),
    (cat_items, "cat_items"),
)


def _factory_name(value: Any) -> str | None:
    """The rule's name when ``value`` is one of the rule factories itself (not called)."""
    for factory, name in _FACTORIES:
        if value is factory:
            return name
    return None


def to_rule(value: Any, phase: str, dim: int, where: str) -> Rule | None:
    """Normalise one layout entry to a rule (``None`` result: the default for the leaf's type)."""
    if isinstance(value, Rule):
        if value.phase != phase:
            raise layout_error(
                f"{where}: {value.describe()} is a {value.phase} rule and cannot be used in {phase}"
            )
        return value
    if value is None:
        return Broadcast() if phase == "scatter" else First()
    if isinstance(value, bool):
        raise layout_error(f"{where}: {safe_repr(value)} is not a rule")
    if isinstance(value, int):
        return Split(value) if phase == "scatter" else Cat(value)
    if isinstance(value, str):
        make = SHORTHANDS.get(value)
        if make is None:
            close = difflib.get_close_matches(value, SHORTHANDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise layout_error(f"{where}: unknown rule {value!r}{hint}")
        rule = make(dim)
        if rule.phase != phase:
            raise layout_error(f"{where}: {value!r} is a {rule.phase} rule, not a {phase} rule")
        return rule
    if callable(value):
        factory = _factory_name(value)
        if factory is not None:
            made = SHORTHANDS[factory](dim)
            if made.phase == phase:
                use = (
                    f": write tg.{factory}() (a callable in a layout is taken as a custom gather "
                    "rule f(values, device))"
                )
            else:
                use = f", and tg.{factory}() is a {made.phase} rule, which {phase} cannot use"
            raise layout_error(f"{where}: tg.{factory} is a rule factory, not a rule{use}")
        if phase != "gather":
            raise layout_error(f"{where}: custom callables are gather rules, not scatter rules")
        return Custom(value)
    raise layout_error(
        f"{where}: {safe_repr(value)} is not a rule (expected a rule, int, None or string)"
    )
