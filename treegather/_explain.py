"""explain: what a layout does to every leaf of a tree, shown before any data is moved.

:func:`explain` resolves the layout with the same resolver scatter and gather use
(:func:`treegather._layout.resolve_sources`, which also says *why* each leaf got its rule),
classifies each scatter position with scatter's own first pass (nothing is split or moved), and
works out the per-device sizes and gathered shapes arithmetically.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Iterator, Sequence
from typing import Any, overload

import optree
import torch

from ._devices import DeviceLike, as_devices
from ._errors import BatchSizeError, LayoutError, LeafTypeError
from ._layout import EXPLAIN_POINTER, Plan, RuleSource, describe_source, display_path
from ._layout import resolve_sources as _resolve_sources
from ._rules import AsList, Cat, CatItems, Custom, First, Mean, Pad, Rule, Stack, Sum
from ._scatter import _ARRAY, _classify, _Cuts, _shard_sizes, _validate
from ._tree import NAMESPACE, flatten

__all__ = ["explain", "Explanation", "ExplainedLeaf"]

Tensor = torch.Tensor
_ROOTS = {"scatter": "inputs", "gather": "outputs"}


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
        return f"<p>{esc(self._header())}</p><table><tr>{head}</tr>{rows}</table>" + (
            f"<p>problems:</p><ul>{problems}</ul>" if problems else ""
        )


def explain(
    tree: Any,
    layout: Any = None,
    devices: Sequence[DeviceLike] | DeviceLike | None = None,
    way: str = "scatter",
    *,
    dim: int = 0,
) -> Explanation:
    """Show, leaf by leaf, what ``layout`` does to ``tree``, without moving or splitting anything.

    Each row gives the leaf's path as you would type it, its type/shape/dtype, the rule that
    applies (defaults spelled out) and why: the default for its type, a single rule, a
    prefix-tree layout (and at which node), or which :func:`by_path` pattern or exact path
    matched. For ``way="scatter"`` with ``devices`` it also gives what each device would get
    and the shard sizes, and lists the problems :func:`scatter` would raise. For
    ``way="gather"``, ``tree`` is one replica's output (the others are taken to be alike) and
    each row says what the leaf becomes; ``devices`` (the replicas' devices) sets how many
    replicas there are, else the sizes are written in terms of ``k``.

    A layout that does not fit the tree raises the :class:`LayoutError` scatter or gather
    would; everything else is reported in the result, not raised.

    Args:
        tree: for scatter the input tree, for gather one replica's output tree.
        layout: a rule, a prefix tree of rules, or :func:`by_path` patterns.
        devices: scatter: the devices to split over; gather: the replicas' devices.
        way: ``"scatter"`` or ``"gather"``.
        dim: the call's ``dim``.

    Returns:
        An :class:`Explanation`: a table when printed, a sequence of :class:`ExplainedLeaf`.

    Raises:
        LayoutError: the layout does not fit the tree.
        ValueError: ``way`` is neither ``"scatter"`` nor ``"gather"``.

    >>> import torch, treegather as tg
    >>> batch = {"x": torch.zeros(10, 4), "ids": list("abcdefghij"), "lr": 0.1}
    >>> tg.explain(batch, tg.by_path({"ids": tg.split_items()}), ["cpu"] * 4)
    scatter over 4 devices (cpu x4): shard sizes (3, 3, 2, 2)
    path           value                  rule           why                             per device
    -------------  ---------------------  -------------  ------------------------------  ------------------------------------------
    inputs['ids']  list of 10 item(s)     split_items()  by_path pattern 'ids'           3 item(s), 3 item(s), 2 item(s), 2 item(s)
    inputs['lr']   float 0.1              broadcast()    default for float               whole x4
    inputs['x']    Tensor(10, 4) float32  split()        default for a Tensor with dims  (3, 4), (3, 4), (2, 4), (2, 4)
    >>> outs = {"loss": torch.tensor(0.5), "logits": torch.zeros(4, 3), "tag": "t"}
    >>> print(tg.explain(outs, {"loss": "mean", "logits": 0, "tag": None}, ["cpu"] * 2, "gather"))
    gather of 2 replica(s) shaped like this one
    path               value                 rule     why                                 result
    -----------------  --------------------  -------  ----------------------------------  ------------------------------------------------
    outputs['logits']  Tensor(4, 3) float32  cat()    prefix layout at outputs['logits']  Tensor(8, 3) float32 (if every replica is alike)
    outputs['loss']    Tensor() float32      mean()   prefix layout at outputs['loss']    Tensor() float32 (weighted by sizes when given)
    outputs['tag']     str 't'               first()  prefix layout at outputs['tag']     replica 0's value
    """
    if way not in _ROOTS:
        raise ValueError(f"explain(way={way!r}): way is 'scatter' or 'gather'")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"explain(dim={dim!r}): dim is an int")
    devs = None if devices is None else as_devices(devices)
    root = _ROOTS[way]
    leaves, spec = flatten(tree)
    try:
        plan, sources = _resolve_sources(spec, layout, way, dim, root)
    except LayoutError as exc:  # the pointer to explain would point here
        text = str(exc)
        if text.endswith("\n" + EXPLAIN_POINTER):
            raise LayoutError(text[: -len(EXPLAIN_POINTER) - 1]) from None
        raise
    up = leaves if plan.up_spec is plan.spec else plan.up_spec.flatten_up_to(tree)
    if way == "scatter":
        return _explain_scatter(up, plan, sources, devs, dim, root)
    return _explain_gather(up, plan, sources, devs, dim, root)


# ---------------------------------------------------------------------------------- scatter


def _explain_scatter(
    up: list[Any],
    plan: Plan,
    sources: list[RuleSource],
    devs: tuple[torch.device, ...] | None,
    dim: int,
    root: str,
) -> Explanation:
    cuts = _Cuts([], [], {}, {})
    problems: list[str | None] = []
    targets = devs if devs is not None else (torch.device("cpu"),)
    meta_ok = all(d.type == "meta" for d in targets)
    arrays: list[int] = []
    for pos, x in enumerate(up):
        found = _classify(pos, x, plan, dim, root, cuts, meta_ok)
        if found is _ARRAY:
            arrays.append(pos)
            problems.append(None)
        elif found is not None:
            # scatter's messages start with the path, which the row already shows
            path = display_path(plan.node_of(pos), root)
            problems.append(found[0].removeprefix(f"{path}: "))
        else:
            problems.append(None)
    if cuts.lengths:
        for pos in arrays:
            problems[pos] = (
                "would be sent whole to every device while the batch is split; convert it with "
                "torch.as_tensor or mark it broadcast()"
            )
    error = None
    try:
        _validate(up, plan, dim, root, targets)
    except (BatchSizeError, LeafTypeError) as exc:
        error = f"{type(exc).__name__}: {_strip(str(exc))}"
    sizes = None
    if error is None and devs is not None:
        try:
            sizes = _shard_sizes(cuts, len(devs))
        except BatchSizeError as exc:
            error = f"{type(exc).__name__}: {_strip(str(exc))}"
    if len(cuts.lengths) > 1:
        common = max(cuts.lengths.items(), key=lambda kv: len(kv[1]))[0]
        for n, positions in cuts.lengths.items():
            if n != common:
                for p in positions:
                    problems[p] = problems[p] or (
                        f"batch size {n}, where the other split leaves have {common}"
                    )
    split_dim = dict(cuts.splits)
    items = set(cuts.items)
    # Shards made: one per size, or one per device when nothing is split.
    k = None if devs is None else (len(devs) if sizes is None else len(sizes))
    rows = []
    for pos, x in enumerate(up):
        node = plan.node_of(pos)
        group = plan.groups[pos]
        rule: Rule | None = group[2] if group is not None else plan.rules[pos]
        shown = _scatter_rule(rule, x, dim)
        per_device: tuple[str, ...] | None = None
        if pos in items:
            result = f"split_items: {len(x)} item(s) cut like the batch"
            if sizes is not None:
                per_device = tuple(f"{s} item(s)" for s in sizes)
        elif pos in split_dim:
            d = split_dim[pos]
            result = f"split along dim {d}: {x.shape[d]} rows"
            if sizes is not None:
                shapes = [list(x.shape) for _ in sizes]
                for shape, s in zip(shapes, sizes):
                    shape[d] = s
                per_device = tuple(_shape_text(s) for s in shapes)
        elif problems[pos] is not None:
            result = "fails (see problems)"
        else:
            result = "whole, to every device"
            if k is not None and error is None:
                per_device = ("whole",) * k
        rows.append(
            ExplainedLeaf(
                display_path(node, root),
                _value_text(x, group is not None),
                shown,
                _why(sources[pos], x, root),
                result,
                per_device,
                problems[pos],
            )
        )
    return Explanation("scatter", tuple(rows), devs, sizes, error)


def _scatter_rule(rule: Rule | None, x: Any, dim: int) -> str:
    if rule is not None:
        return rule.describe()
    if isinstance(x, Tensor) and x.dim() > 0:
        return "split()" if dim == 0 else f"split(dim={dim})"
    return "broadcast()"


# ----------------------------------------------------------------------------------- gather


def _explain_gather(
    up: list[Any],
    plan: Plan,
    sources: list[RuleSource],
    devs: tuple[torch.device, ...] | None,
    dim: int,
    root: str,
) -> Explanation:
    k: int | None = None if devs is None else len(devs)
    rows = []
    for pos, x in enumerate(up):
        group = plan.groups[pos]
        rule: Rule | None = group[2] if group is not None else plan.rules[pos]
        if rule is None:
            rule = Cat(dim) if isinstance(x, Tensor) else AsList()
        result, problem = _becomes(rule, x, k)
        rows.append(
            ExplainedLeaf(
                display_path(plan.node_of(pos), root),
                _value_text(x, group is not None),
                rule.describe(),
                _why(sources[pos], x, root),
                result,
                None,
                problem,
            )
        )
    return Explanation("gather", tuple(rows), devs)


def _becomes(rule: Rule, x: Any, k: int | None) -> tuple[str, str | None]:
    """What ``k`` replicas' values like ``x`` become under ``rule`` (text), and a problem."""
    kk = "k" if k is None else str(k)
    name = rule.describe()
    if isinstance(rule, AsList):
        return f"list of {kk} per-replica values", None
    if isinstance(rule, First):
        return "replica 0's value" + (
            " (checked equal in every replica)" if rule.check else ""
        ), None
    if isinstance(rule, CatItems):
        if not isinstance(x, (list, tuple)):
            return "-", f"{name} needs a list or tuple, got {type(x).__qualname__}"
        n = f"{k * len(x)}" if k is not None else f"k*{len(x)}"
        return f"{type(x).__qualname__} of {n} item(s) (if every replica has {len(x)})", None
    if isinstance(rule, Custom):
        return f"what {getattr(rule.fn, '__qualname__', rule.fn)!s} returns", None
    if isinstance(rule, (Mean, Sum)):
        if isinstance(x, Tensor):
            dtype = x.dtype
            if isinstance(rule, Mean) and not (x.is_floating_point() or x.is_complex()):
                dtype = torch.get_default_dtype()
            weighted = " (weighted by sizes when given)" if isinstance(rule, Mean) else ""
            return f"Tensor{_shape_text(list(x.shape))} {_dtype(dtype)}{weighted}", None
        if isinstance(x, (int, float, complex)) and not isinstance(x, bool):
            return ("float" if isinstance(rule, Mean) else type(x).__qualname__), None
        return "-", f"{name} needs a tensor or a number, got {type(x).__qualname__}"
    if not isinstance(x, Tensor):
        return "-", f"{name} needs a tensor, got {type(x).__qualname__}"
    shape: list[Any] = list(x.shape)
    nd = len(shape)
    if isinstance(rule, Cat):
        if nd == 0:
            return f"Tensor({kk},) {_dtype(x.dtype)} (0-dim values stacked)", None
        if not -nd <= rule.dim < nd:
            return "-", f"{name}: dim {rule.dim} is out of range for {nd}-dim tensors"
        d = rule.dim % nd
        shape[d] = _times(shape[d], k)
        return f"Tensor{_shape_text(shape)} {_dtype(x.dtype)} (if every replica is alike)", None
    if isinstance(rule, Stack):
        if not -(nd + 1) <= rule.dim <= nd:
            return "-", f"{name}: dim {rule.dim} is out of range for {nd}-dim tensors"
        shape.insert(rule.dim % (nd + 1), kk)
        return f"Tensor{_shape_text(shape)} {_dtype(x.dtype)}", None
    if isinstance(rule, Pad):
        if nd == 0 or not -nd <= rule.dim < nd:
            return "-", f"{name} needs tensors of at least {max(1, rule.dim + 1)} dim(s)"
        d = rule.dim % nd
        shape[d] = _times(shape[d], k)
        data = f"Tensor{_shape_text(shape)} {_dtype(x.dtype)}"
        others = " (other dims padded to the largest replica)"
        if rule.lengths:
            return f"Padded(data={data}, lengths=Tensor({kk}, {nd}) int64){others}", None
        return data + others, None
    return "-", f"{name} is not a gather rule"


# ---------------------------------------------------------------------------------- helpers


def _strip(text: str) -> str:
    """A message without the trailing pointer to explain (we are in it)."""
    return text.removesuffix("\n" + EXPLAIN_POINTER)


def _times(n: int, k: int | None) -> int | str:
    return n * k if k is not None else f"k*{n}"


def _shape_text(shape: Sequence[Any]) -> str:
    if len(shape) == 1:
        return f"({shape[0]},)"
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _value_text(x: Any, whole: bool) -> str:
    if isinstance(x, Tensor):
        where = "" if x.device.type == "cpu" else f" on {x.device}"
        return f"Tensor{_shape_text(list(x.shape))} {_dtype(x.dtype)}{where}"
    if whole and x is not None:
        try:
            children = optree.tree_flatten_one_level(x, namespace=NAMESPACE)[0]
        except ValueError:
            children = None
        if children is not None:
            return f"{type(x).__qualname__} of {len(children)} item(s)"
    text = repr(x)
    if len(text) > 30:
        text = text[:27] + "..."
    return f"{type(x).__qualname__} {text}"


def _why(source: RuleSource, x: Any, root: str) -> str:
    if source.kind != "default":
        return describe_source(source, root)
    if isinstance(x, Tensor):
        return "default for a 0-dim Tensor" if x.dim() == 0 else "default for a Tensor with dims"
    return f"default for {type(x).__qualname__}"


def _devices_text(devs: tuple[torch.device, ...]) -> str:
    names = [str(d) for d in devs]
    if len(set(names)) == 1:
        return f"{len(names)} devices ({names[0]} x{len(names)})"
    return f"{len(names)} devices ({', '.join(names)})"


def _compress(cells: tuple[str, ...]) -> str:
    if cells and all(c == cells[0] for c in cells) and cells[0] == "whole":
        return f"whole x{len(cells)}"
    return ", ".join(cells)
