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

from .._tree import Opaque, describe, held_tensor, one_row_of, rows_of, shape_text
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
        if isinstance(x, Tensor):
            return _split_cut(x, self.dim, self.sizes)
        rows = rows_of(x)
        if rows is not None:  # (a PackedSequence, a graph batch: by its rows, as the default)
            if self.dim != 0:
                return Problem(
                    f"{self.describe()} splits a {rows.kind.name} only by its rows, along dim "
                    "0: write split() (or no rule)",
                    True,
                )
            found = SPLIT_ROWS.shard(rows, dim)
            return found if isinstance(found, Problem) else found._replace(sizes=self.sizes)
        hint = (
            " (use split_items() on a list of per-sample items)"
            if isinstance(x, (str, bytes))
            else ""
        )
        return Problem(f"{self.describe()} needs a tensor, got {describe(x)}{hint}", True)

    def explain(
        self, x: Any, cut: Cut, sizes: Sequence[int] | None
    ) -> tuple[str, tuple[str, ...] | None]:
        if not isinstance(x, Tensor):  # (laid out by rows: shard() took no other)
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
    """The default rule of a value laid out by rows its own way (a ``PackedSequence``, a PyG
    graph batch: :func:`~treegather._tree.rows_of`): split by rows with its own function, like
    the batch."""

    def describe(self) -> str:
        return "split by rows"

    def shard(self, x: Any, dim: int) -> Cut | Problem:
        rows = rows_of(x)
        if rows is None:
            return Problem(f"{self.describe()} needs a value laid out by rows, got {describe(x)}")
        problem = rows.problem()
        if problem is not None:
            return Problem(problem, True)
        return Cut("items", rows=rows.rows)

    def explain(
        self, x: Any, cut: Cut, sizes: Sequence[int] | None
    ) -> tuple[str, tuple[str, ...] | None]:
        rows = rows_of(x)
        name = rows.kind.name if rows is not None else "value"
        result = f"{name} of {cut.rows} rows, cut like the batch"
        return result, None if sizes is None else tuple(f"{s} row(s)" for s in sizes)


SPLIT_ROWS = _SplitRows()

_PLAIN = frozenset([type(None), bool, int, float, complex, str, bytes])


def default_cut(x: Any, dim: int) -> Cut | Problem:
    """The default rule of a leaf: a tensor with dims is split along ``dim``, a value laid out
    by rows its own way (a ``PackedSequence``, a PyG graph batch) by its rows, like the batch;
    anything else is broadcast, except what would silently send the batch whole to every
    device.

    Refused, with a :class:`~treegather.LeafTypeError` saying how to fix it: an unregistered
    dataclass, dict or list subclass (their fields and items would be the tree's); an
    :class:`~treegather._tree.Opaque` value (a registered node that cannot be split, such as a
    transformers ``StaticCache``), with its reason; and any other value that holds a tensor of
    one or more dims, found in its own state (``__dict__``, ``__slots__`` and the dicts, lists
    and tuples among them, a few levels down: :func:`~treegather._tree.held_tensor`, which
    calls no code of the value's class): a container (``collections.UserDict``, the shape of
    transformers' ``BatchEncoding``; a tuple subclass) or any object (a single PyG ``Data``,
    one graph: the hint says how to batch graphs). A ``torch.nn.Module`` is broadcast, never
    refused nor looked into: its tensors are its parameters and buffers, the state of a
    computation rather than rows of the batch (a loss module passed along, as torch's own
    scatter passes it); every device gets the same object, neither copied nor moved (a module
    that must run on each device belongs in the model, which is replicated). numpy arrays of
    >= 1 dim are ``"array"`` cuts, refused next to split data. Strings, numbers and values that
    hold no tensor are broadcast; the walk costs nothing for tensors, numbers and strings.
    """
    if isinstance(x, Tensor):  # (an uninitialized parameter has no dims yet: split says so)
        if isinstance(x, UninitializedTensorMixin) or x.dim():
            return _split_cut(x, dim)
        return WHOLE
    if type(x) in _PLAIN:
        return WHOLE
    if isinstance(x, Opaque):  # a registered node that cannot be split: it says why
        return Problem(x.reason, True)
    rows = rows_of(x)
    if rows is not None:  # laid out by rows its own way (a PackedSequence, a graph batch)
        return SPLIT_ROWS.shard(rows, dim)
    if type(x).__module__ == "numpy" and getattr(x, "ndim", 0) >= 1:
        return Cut("array")
    refused = _sent_whole(x)
    return WHOLE if refused is None else Problem(refused, True)


def _sent_whole(x: Any) -> str | None:
    """Why ``x`` must not be broadcast by default (it would carry the batch whole to every
    device), or ``None``."""
    name = type(x).__qualname__
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (
            f"{name} is a dataclass treegather does not know, so it would be sent whole to "
            "every device; register it with treegather.register_dataclass (or mark it "
            "broadcast() in the layout)"
        )
    if isinstance(x, (dict, list)):
        # A dict/list subclass optree does not know is a leaf: without this check the whole
        # batch inside it would silently go to every device.
        base = "dict" if isinstance(x, dict) else "list"
        return (
            f"{name} is a {base} subclass treegather does not know, so it would be sent whole "
            "to every device; register it with treegather.register_node (or mark it "
            "broadcast() in the layout)"
        )
    if isinstance(x, torch.nn.Module):
        return None  # (state, not rows: sent as it is)
    found = held_tensor(x)
    if found is None:
        return None
    where, tensor = found
    what = "a container" if isinstance(x, (Mapping, Sequence)) else "an object"
    text = (
        f"{name} is {what} treegather does not know and it holds tensors (the first at "
        f"{where}: {describe(tensor)}), so it would be sent whole to every device; "
    )
    one = one_row_of(x)
    if one is not None:
        return text + (
            f"a {name} is one row of a {one.name}: "
            f"{one.batched}, or mark it broadcast() in the layout"
        )
    return text + (
        "register its class with treegather.register_node or treegather.register_dataclass, "
        "or mark it broadcast() in the layout"
    )


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
