"""A Collector's adds kept as columns while they come: the local half of its fast layer.

Most evaluations add a dict of tensors and per-sample lists, with the same keys at every batch.
:class:`Columns` keeps each key's values in a list as they are added and learns, in the same
step, what the exchange would otherwise work out again over every add: that a key holds tensors
of one dtype, device and shape past the first dim (and their rows), or lists of strings
(``str`` exactly, and how many). At the exchange
:meth:`Columns.joined` gives what the definition
(:meth:`~treegather.distributed.collector.Collector._local`: each add flattened by the plan,
then :func:`~treegather.distributed.samples.join`) gives for the same adds, or ``None`` when
anything is unusual (outputs that are not a dict, or whose keys change, or whose plan reaches
inside a value; a key whose values differ in kind, dtype, device or trailing shape; ``pad``;
rows that disagree), and then the definition runs. An add costs a few attribute reads per key.

>>> import torch
>>> cols = Columns()
>>> cols.add({"x": torch.ones(2, 3), "names": ["a", "b"]})
>>> cols.add({"x": torch.zeros(1, 3), "names": ["c"]})
>>> [(c.kind, c.rows) for c in cols.columns]
[('tensors', [2, 1]), ('texts', [2, 1])]
"""

from __future__ import annotations

import operator
from itertools import chain
from typing import Any, NamedTuple

import torch

from .._layout import Plan
from .._rules import Pad, Rule
from .samples import ITEMS, PER_ADD, SAMPLES, travelling

__all__ = ["Column", "Columns", "Joined"]

Tensor = torch.Tensor
TENSORS, TEXTS, OTHER = "tensors", "texts", "other"
_ROWS = operator.methodcaller("size", 0)


class Column:
    """One key's values, one per add, and what they all are."""

    __slots__ = ("device", "dtype", "kind", "rows", "tail", "values")

    def __init__(self, value: Any) -> None:
        self.values: list[Any] = []
        self.rows: list[int] = []  # tensors: each add's rows; texts: each add's strings
        self.kind = OTHER
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self.tail: tuple[int, ...] = ()
        if type(value) is Tensor and value.dim() > 0:
            self.kind, self.dtype, self.device = TENSORS, value.dtype, value.device
            self.tail = tuple(value.shape[1:])
        elif type(value) is list:
            self.kind = TEXTS

    def add(self, value: Any) -> None:
        self.values.append(value)
        kind = self.kind
        if kind is TENSORS:
            if (
                type(value) is Tensor
                and value.dtype == self.dtype
                and value.device == self.device
                and value.dim() == len(self.tail) + 1
                and value.shape[1:] == self.tail
            ):
                self.rows.append(value.shape[0])
                return
        elif kind is TEXTS:
            if type(value) is list and set(map(type, value)) <= {str}:
                self.rows.append(len(value))
                return
        else:
            return
        self.kind = OTHER  # another kind of value than the earlier adds': nothing learned


class Joined(NamedTuple):
    """This rank's adds joined per plan position (what the definition's join gives)."""

    rows: list[int]  # each add's rows
    combined: list[Any]  # per position: a tensor of every row, a list of items, a list per add
    travelling: tuple[Any, ...]  # per position: as it travels (the tensor, Texts, Opaque)


class Columns:
    """The adds of a Collector as one :class:`Column` per key (see the module)."""

    __slots__ = ("columns", "keys", "ok")

    def __init__(self) -> None:
        self.keys: tuple[Any, ...] | None = None
        self.columns: list[Column] = []
        self.ok = True

    def add(self, outputs: Any) -> None:
        """Keep one add's ``outputs`` (a dict; anything else turns the columns off)."""
        if not self.ok:
            return
        if type(outputs) is not dict:
            self.ok = False
            return
        keys = tuple(outputs)
        if self.keys is None:
            self.keys = keys
            self.columns = [Column(v) for v in outputs.values()]
        elif keys != self.keys:
            self.ok = False
            return
        for column, value in zip(self.columns, outputs.values()):
            column.add(value)

    def joined(
        self,
        plan: Plan,
        kinds: list[int],
        rules: list[Rule | None],
        first: Any,
        device: torch.device | None,
    ) -> Joined | None:
        """The adds joined by ``plan`` (the plan of the first add, ``first``; ``kinds`` and
        ``rules`` its positions'), as the definition joins them; ``None`` when the columns
        cannot tell (see the module). ``device``: the Collector's, if it has one."""
        if not self.ok or self.keys is None or not self.columns[0].values:
            return None
        leaves: list[Any] = plan.up_spec.flatten_up_to(first)
        if len(leaves) != len(self.keys):  # the plan reaches inside a value
            return None
        where = {id(v): j for j, v in enumerate(first.values())}
        if len(where) != len(self.keys):  # one object under two keys: positions are ambiguous
            return None
        at = [where.get(id(leaf)) for leaf in leaves]
        if None in at:
            return None
        if device is None:
            tensors = [x for x in leaves if isinstance(x, Tensor)]
            device = tensors[0].device if tensors else torch.device("cpu")
        target: torch.device = device
        rows: list[int] | None = None
        combined: list[Any] = []
        moving: list[Any] = []
        for j, kind, rule in zip(at, kinds, rules):
            assert j is not None
            column = self.columns[j]
            if kind == PER_ADD:
                value = list(column.values)
                combined.append(value)
                moving.append(travelling(value))
                continue
            if kind == SAMPLES:
                if column.kind is not TENSORS or isinstance(rule, Pad) or column.device != target:
                    return None
                parts = column.values
                try:
                    with torch.no_grad():
                        tensor = torch.cat(parts) if len(parts) > 1 else parts[0]
                except RuntimeError:  # (a tensor resized after it was added): the definition
                    return None
                if tensor.shape[1:] != column.tail or list(map(_ROWS, parts)) != column.rows:
                    return None  # (resized since it was added: read as the definition reads)
                combined.append(tensor)
                moving.append(tensor)
            else:
                assert kind == ITEMS
                if column.kind is not TEXTS:
                    return None
                if list(map(len, column.values)) != column.rows:  # (changed since added)
                    return None
                items = list(chain.from_iterable(column.values))
                combined.append(items)
                moving.append(travelling(items, {str} if items else set()))
            if rows is None:
                rows = column.rows
            elif column.rows != rows:
                return None
        if rows is None:  # no per-sample leaf: the definition says so
            return None
        return Joined(rows, combined, tuple(moving))
