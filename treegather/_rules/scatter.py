"""The scatter rules: how one input is divided over the devices.

:class:`Split` cuts a tensor along a dim (the default for tensors with dims), :class:`Broadcast`
sends the value whole to every device (the default for everything else), :class:`SplitItems`
cuts a list of per-sample items like the batch. Each says how a value is cut
(:meth:`~treegather._rules.base.ScatterRule.shard`), what is wrong with it, and what each device
gets (:meth:`~treegather._rules.base.ScatterRule.explain`). :func:`default_cut` is the rule a
leaf gets when the layout names none.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]

from .._tree import Opaque, Rows, describe, shape_text
from .base import WHOLE, Cut, Problem, ScatterRule, constructor

__all__ = [
    "SPLIT_ROWS",
    "Broadcast",
    "Split",
    "SplitItems",
    "broadcast",
    "default_cut",
    "split",
    "split_items",
]

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Split(ScatterRule, name="split"):
    """Split a tensor along ``dim`` (``torch.tensor_split`` order, or explicit ``sizes``); a
    value laid out by rows, under dim 0: by its rows, as its default rule does."""

    dim: int = 0
    sizes: tuple[int, ...] | None = None

    @classmethod
    def named(cls, dim: int) -> Split:
        return cls(dim)

    def shard(self, x: Any, dim: int) -> Cut | Problem:
        if isinstance(x, Rows):  # (a PackedSequence: by its rows, as the default splits it)
            if self.dim != 0:
                return Problem(
                    f"{self.describe()} splits a {x.kind.name} only by its rows, along dim 0: "
                    "write split() (or no rule)",
                    True,
                )
            return Cut("items", rows=x.rows, sizes=self.sizes)
        if not isinstance(x, Tensor):
            hint = (
                " (use split_items() on a list of per-sample items)"
                if isinstance(x, (str, bytes))
                else ""
            )
            return Problem(f"{self.describe()} needs a tensor, got {describe(x)}{hint}", True)
        return _split_cut(x, self.dim, self.sizes)

    def explain(
        self, x: Any, cut: Cut, sizes: Sequence[int] | None
    ) -> tuple[str, tuple[str, ...] | None]:
        if isinstance(x, Rows):
            return SPLIT_ROWS.explain(x, cut, sizes)
        result = f"split along dim {cut.dim}: {x.shape[cut.dim]} rows"
        if sizes is None:
            return result, None
        shapes = [list(x.shape) for _ in sizes]
        for shape, s in zip(shapes, sizes):
            shape[cut.dim] = s
        return result, tuple(shape_text(s) for s in shapes)


def _split_cut(x: Tensor, d: int, sizes: tuple[int, ...] | None = None) -> Cut | Problem:
    if isinstance(x, UninitializedTensorMixin):  # (no shape to split yet)
        return Problem(
            f"split needs a tensor with data, got an {describe(x)}, which a lazy module has not "
            "initialized yet: run one forward first, or mark it broadcast() in the layout",
            True,
        )
    if x.layout != torch.strided or x.is_nested:
        kind = "nested" if x.is_nested else str(x.layout).replace("torch.", "")
        return Problem(
            f"split needs a dense (strided) tensor, got a {kind} tensor {describe(x)}; convert "
            "it with .to_dense() (or torch.nested.to_padded_tensor), or mark it broadcast() in "
            "the layout",
            True,
        )
    nd = x.dim()
    if not -nd <= d < nd or nd == 0:
        return Problem(f"cannot split along dim {d}: {describe(x)}")
    return Cut("split", d, x.shape[d], sizes)


@dataclasses.dataclass(frozen=True)
class Broadcast(ScatterRule, name="broadcast"):
    """Every device gets the whole value (tensors moved there)."""

    def shard(self, x: Any, dim: int) -> Cut | Problem:
        return WHOLE

    def explain(
        self, x: Any, cut: Cut, sizes: Sequence[int] | None
    ) -> tuple[str, tuple[str, ...] | None]:
        return "whole, to every device", None


@dataclasses.dataclass(frozen=True)
class SplitItems(ScatterRule, name="split_items"):
    """A list or tuple of per-sample items, cut into runs matching the tensor split."""

    whole = True

    def describe(self) -> str:
        return "split_items()"

    def shard(self, x: Any, dim: int) -> Cut | Problem:
        if not isinstance(x, (list, tuple)):
            return Problem(f"split_items() needs a list or tuple, got {describe(x)}", True)
        return Cut("items", rows=len(x))

    def explain(
        self, x: Any, cut: Cut, sizes: Sequence[int] | None
    ) -> tuple[str, tuple[str, ...] | None]:
        result = f"split_items: {len(x)} item(s) cut like the batch"
        return result, None if sizes is None else tuple(f"{s} item(s)" for s in sizes)


class _SplitRows(ScatterRule):
    """The default rule of a :class:`~treegather._tree.Rows` value (a ``PackedSequence``):
    split by rows with its own function, like the batch."""

    def describe(self) -> str:
        return "split by rows"

    def shard(self, x: Any, dim: int) -> Cut | Problem:
        if not isinstance(x, Rows):
            return Problem(f"{self.describe()} needs a value laid out by rows, got {describe(x)}")
        return Cut("items", rows=x.rows)

    def explain(
        self, x: Any, cut: Cut, sizes: Sequence[int] | None
    ) -> tuple[str, tuple[str, ...] | None]:
        result = f"{x.kind.name} of {x.rows} rows, cut like the batch"
        return result, None if sizes is None else tuple(f"{s} row(s)" for s in sizes)


SPLIT_ROWS = _SplitRows()


def default_cut(x: Any, dim: int) -> Cut | Problem:
    """The default rule of a leaf: a tensor with dims is split along ``dim``, anything else is
    broadcast, except what would silently send the batch whole to every device.

    Unregistered dataclasses, dict/list subclasses, and any other mapping or sequence holding
    tensors (``collections.UserDict`` -- the shape of transformers' ``BatchEncoding`` --, a
    tuple subclass) are refused; numpy arrays of >= 1 dim are ``"array"`` cuts, refused next to
    split data; so is an :class:`~treegather._tree.Opaque` value (a registered node that cannot
    be split, such as a transformers ``StaticCache``), with its reason. A
    :class:`~treegather._tree.Rows` value (a ``PackedSequence``) is split by rows, like the
    batch. Strings, numbers and containers of plain values are broadcast.
    """
    if isinstance(x, Tensor):  # (an uninitialized parameter has no dims yet: split says so)
        if isinstance(x, UninitializedTensorMixin) or x.dim():
            return _split_cut(x, dim)
        return WHOLE
    if isinstance(x, Opaque):  # a registered node that cannot be split: it says why
        return Problem(x.reason, True)
    if isinstance(x, Rows):  # a value laid out by rows its own way (a PackedSequence)
        return SPLIT_ROWS.shard(x, dim)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return Problem(
            f"{type(x).__qualname__} is a dataclass treegather does not know, so it would be "
            "sent whole to every device; register it with treegather.register_dataclass (or "
            "mark it broadcast() in the layout)",
            True,
        )
    if isinstance(x, (dict, list)):
        # A dict/list subclass optree does not know is a leaf: without this check the whole
        # batch inside it would silently go to every device.
        base = "dict" if isinstance(x, dict) else "list"
        return Problem(
            f"{type(x).__qualname__} is a {base} subclass treegather does not know, so it would "
            "be sent whole to every device; register it with treegather.register_node (or mark "
            "it broadcast() in the layout)",
            True,
        )
    if isinstance(x, (Mapping, Sequence)) and not isinstance(x, (str, bytes)):
        values = x.values() if isinstance(x, Mapping) else x
        if any(isinstance(v, Tensor) for v in values):
            return Problem(
                f"{type(x).__qualname__} is a container treegather does not know and it holds "
                "tensors, so it would be sent whole to every device; register it with "
                "treegather.register_node (or mark it broadcast() in the layout)",
                True,
            )
    if type(x).__module__ == "numpy" and getattr(x, "ndim", 0) >= 1:
        return Cut("array")
    return WHOLE


# --------------------------------------------------------------------------- constructors


@constructor(Split)
def split(dim: int = 0, sizes: Sequence[int] | None = None) -> Split:
    """Scatter rule: split a tensor along ``dim`` over the devices.

    The default for tensors of one or more dims (along the call's ``dim``). Shards follow
    ``torch.tensor_split`` (10 rows on 4 devices: 3, 3, 2, 2) unless ``sizes`` gives the rows of
    each shard; every split leaf must agree on the batch size. ``sizes`` names the shards: it
    must add up to the batch size and may name fewer shards than there are devices (then only
    the first ``len(sizes)`` devices get one, as with a batch smaller than the device count);
    more shards than devices is an error. A value laid out by rows its own way (a
    ``PackedSequence``, a ``LazyStackedTensorDict`` stacked along dim 0) is split by its rows
    under ``split()`` (dim 0, with or without ``sizes``), as the default splits it: ``split()``
    in a prefix layout says "by rows" for every leaf below it; another dim is refused naming
    the value's kind.

    >>> import torch, treegather as tg
    >>> [s.shape[1] for s in tg.scatter(torch.zeros(2, 5), ["cpu"] * 2, tg.split(1, sizes=[4, 1]))]
    [4, 1]
    """
    if sizes is not None:
        sizes = tuple(int(s) for s in sizes)
        if not sizes or builtins.min(sizes) <= 0:
            raise ValueError(f"split(sizes=...) needs positive shard sizes, got {list(sizes)}")
    return Split(int(dim), sizes)


@constructor(Broadcast)
def broadcast() -> Broadcast:
    """Scatter rule: every replica gets the whole value (tensors moved to the replica's device).

    The default for non-tensors and 0-dim tensors.

    >>> import torch, treegather as tg
    >>> [s["w"].tolist() for s in tg.scatter({"w": torch.ones(2)}, ["cpu"] * 2, tg.broadcast())]
    [[1.0, 1.0], [1.0, 1.0]]
    """
    return Broadcast()


@constructor(SplitItems)
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
