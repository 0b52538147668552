"""The result of explain: :class:`Explanation`, a table of :class:`ExplainedLeaf` rows.

Owns the result classes and their rendering (plain text for ``print``, HTML for notebooks);
:func:`treegather.explain` (in :mod:`treegather._explain`) works out the rows.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Iterator
from typing import overload

import torch

from .text import _compress, _devices_text

__all__ = ["Explanation", "ExplainedLeaf"]


@dataclasses.dataclass(frozen=True)
class ExplainedLeaf:
    """One row of an :class:`Explanation`: a leaf (or a subtree a whole-value rule takes).

    >>> import torch, treegather as tg
    >>> row = tg.explain({"x": torch.zeros(4, 2)}, devices=["cpu"] * 2)[0]
    >>> row.path, row.rule, row.why, row.per_device
    ("inputs['x']", 'split()', 'default for a Tensor with dims', ('(2, 2)', '(2, 2)'))
    """

    path: str
    """The path as you would type it: ``inputs['x']``, ``outputs.hidden[2]``."""
    value: str
    """What is there: ``Tensor(4, 2) float32``, ``str 'train'``, ``list of 3 item(s)``."""
    rule: str
    """The rule that applies, defaults spelled out: ``split()``, ``cat()``, ``as_list()``."""
    why: str
    """Where the rule comes from: ``default for str``, ``by_path pattern 'meta.*'``, ..."""
    result: str
    """Scatter: what is done (``split along dim 0: 4 rows``); gather: what it becomes."""
    per_device: tuple[str, ...] | None = None
    """Scatter with ``devices``: what each device gets (a shape, ``3 item(s)``, ``whole``)."""
    problem: str | None = None
    """Why this leaf would make the call fail, if it would."""


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What :func:`explain` returns: one :class:`ExplainedLeaf` per row, printed as a table.

    Iterate over it, index it by position or by path (``explanation["inputs['x']"]``), or print
    it. In a notebook it renders as an HTML table.

    >>> import torch, treegather as tg
    >>> ex = tg.explain({"x": torch.zeros(4, 2)}, devices=["cpu"] * 2)
    >>> len(ex), ex["inputs['x']"].result, ex.sizes
    (1, 'split along dim 0: 4 rows', (2, 2))
    """

    way: str
    """``"scatter"`` or ``"gather"``."""
    rows: tuple[ExplainedLeaf, ...]
    """One row per leaf (or whole-value subtree), in leaf order."""
    devices: tuple[torch.device, ...] | None
    """Scatter: the devices given; gather: the replicas' devices (their number is what counts)."""
    sizes: tuple[int, ...] | None = None
    """Scatter: rows per shard, as ``Shards.sizes`` would be (``None``: nothing is split, no
    ``devices``, or the call would fail)."""
    error: str | None = None
    """Scatter: the error the call would raise (``"BatchSizeError: ..."``), if any."""
    notes: tuple[str, ...] = ()
    """What the layout has that this tree does not use: each ``optional`` :func:`by_path`
    pattern that matches nothing here."""

    def __iter__(self) -> Iterator[ExplainedLeaf]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, key: int) -> ExplainedLeaf: ...
    @overload
    def __getitem__(self, key: str) -> ExplainedLeaf: ...
    def __getitem__(self, key: int | str) -> ExplainedLeaf:
        if isinstance(key, str):
            for row in self.rows:
                if row.path == key:
                    return row
            raise KeyError(f"no row for {key!r}; the paths are: {[r.path for r in self.rows]}")
        return self.rows[key]

    def _header(self) -> str:
        if self.way == "scatter":
            if self.devices is None:
                head = "scatter (no devices given: per-device sizes not shown)"
            else:
                head = f"scatter over {_devices_text(self.devices)}"
                if self.sizes is not None:
                    head += f": shard sizes {self.sizes}"
                    if len(self.sizes) < len(self.devices):
                        head += f" ({len(self.sizes)} of {len(self.devices)} devices used)"
        else:
            k = "k" if self.devices is None else str(len(self.devices))
            head = f"gather of {k} replica(s) shaped like this one"
        return head

    def _columns(self) -> tuple[list[str], list[list[str]]]:
        last = "per device" if self.way == "scatter" and self.devices is not None else "result"
        names = ["path", "value", "rule", "why", last]
        body = []
        for row in self.rows:
            if last == "per device" and row.per_device is not None:
                outcome = _compress(row.per_device)
            else:
                outcome = row.result
            body.append([row.path, row.value, row.rule, row.why, outcome])
        return names, body

    def _problems(self) -> list[str]:
        lines = [f"{row.path}: {row.problem}" for row in self.rows if row.problem]
        if self.error:
            lines.append(f"scatter would raise {self.error}")
        return lines

    def __str__(self) -> str:
        names, body = self._columns()
        widths = [max(len(c) for c in col) for col in zip(names, *body)]
        lines = [self._header()]
        lines.append("  ".join(n.ljust(w) for n, w in zip(names, widths)).rstrip())
        lines.append("  ".join("-" * w for w in widths))
        lines.extend(
            "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in body
        )
        if not body:
            lines.append("(no leaves)")
        problems = self._problems()
        if problems:
            lines.append("problems:")
            lines.extend("  - " + p.replace("\n", "\n    ") for p in problems)
        if self.notes:
            lines.append("notes:")
            lines.extend("  - " + n for n in self.notes)
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        names, body = self._columns()
        esc = html.escape
        head = "".join(f"<th>{esc(n)}</th>" for n in names)
        rows = "".join(
            "<tr>" + "".join(f"<td><code>{esc(c)}</code></td>" for c in cells) + "</tr>"
            for cells in body
        )
        problems = "".join(f"<li>{esc(p)}</li>" for p in self._problems())
        notes = "".join(f"<li>{esc(n)}</li>" for n in self.notes)
        return (
            f"<p>{esc(self._header())}</p><table><tr>{head}</tr>{rows}</table>"
            + (f"<p>problems:</p><ul>{problems}</ul>" if problems else "")
            + (f"<p>notes:</p><ul>{notes}</ul>" if notes else "")
        )
