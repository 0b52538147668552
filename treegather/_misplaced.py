"""Rows the default gather rules would join in the wrong place: a leaf whose rows are in
another dim, a list that holds one item per sample.

The default rules join every tensor along the call's ``dim`` and a list item by item. When the
gather knows the shard sizes (the rows each replica got: :func:`treegather.data_parallel`,
``DataParallel``, :func:`treegather.patch`, ``gather(..., sizes=...)``), some outputs show
decisively that their rows are elsewhere; the gather then refuses them before anything is
combined, naming each path, the shard sizes, what it saw and the rule to write. A position with
a rule in the layout (even ``cat(0)``) is taken as written and never checked.

**A tensor** (:func:`rows_dims`) is refused when there are two replicas or more, one of them
with two rows or more, and on every replica its size along the gather dim differs from that
replica's shard rows while another dim holds exactly them on every replica: an LSTM's
``(h_n, c_n)``, ``(layers, batch, hidden)``, gathered along dim 0. What the rule cannot tell
apart:

- With even shards (the usual case) the rows are one number ``s`` on every replica: a leaf of a
  fixed size ``s`` in another dim (a ``(C, s)`` matrix that does not depend on the batch) is
  refused, and ``cat(0)`` in the layout says it is meant; with uneven shards such a leaf
  cannot be joined along the gather dim either (its other dims differ), and the error that
  gives says the same.
- A leaf that holds its shard's rows along the gather dim on some replica is never refused,
  even when another dim holds them too (a ``(s, s)`` matrix, a time-major ``(T, B, H)`` whose
  ``T`` equals ``B``): nothing in its shape says the gather dim is wrong.
- With one row per replica every size-1 dim would hold the rows, so shards that all have one
  row (or none) decide nothing; a replica with 0 rows takes part like any other.
- A 0-dim or 1-dim tensor has no other dim to hold the rows, and a nested tensor no shape to
  read: never refused.

**A list** (:func:`sample_lists`; a ``list``, not a tuple, whose leaves all take the default
rules) is refused when on every replica it holds as many items as that replica's shard rows
(two or more), its items have one structure, down to the number of dims of each tensor, at
least one of those tensors has dims, and none is batched (a leaf that holds its replica's shard
rows along the gather dim in every item of every replica): detection outputs, one dict per
image, which the default would join item by item (image 0 of every replica into one dict).
What it cannot tell apart:

- A list of batched tensors (per-layer features, two heads' logits) is never refused, even
  when its length equals the shard rows; nor is a list of per-sample items whose every tensor
  happens to hold as many rows as the shard (each image's two boxes, in shards of two images):
  theirs are the shapes of a list of batched tensors. One item of the shard's rows is not
  enough to be a batch.
- A list of items without a tensor of dims (strings, numbers, 0-dim tensors) has the shapes of
  two names or two loss terms as much as of per-sample values: never refused.
- With uneven shards its replicas' lists differ in length, and the structure error that gives
  says to gather it with ``cat_items()`` (:func:`list_hint`).

The cost on every step: :func:`refused` reads one size of replica 0's leaves (one C call per
leaf for the compiled layer's trees of tensors), and the list nodes of a plan are found once
per plan; nothing when the sizes are not known, uneven (a refused leaf cannot be concatenated
then: the failure path checks it) or all 1.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from optree import PyTreeKind

from ._errors import EXPLAIN_POINTER, ShapeMismatchError, StructureMismatchError, bullet_list
from ._layout import Plan, display_path, writable_path
from ._rules import ROOT
from ._rules.base import by_replica
from ._tree import Node, alike, flatten, nodes

__all__ = ["check", "even_rows", "list_hint", "refused", "rows_dims", "sample_lists"]

Tensor = torch.Tensor
# len() of a tensor without the Python-level Tensor.__len__ wrapper (0 for a 0-dim tensor).
_TENSOR_LEN = getattr(getattr(torch._C, "TensorBase", None), "__len__", None) or Tensor.__len__
_FIRST = operator.itemgetter(0)
_LIST = PyTreeKind.LIST


def even_rows(sizes: tuple[int, ...] | None) -> int:
    """The rows of every shard when there are two shards or more with the same rows, two or
    more (the case checked before combining); else 0.

    >>> even_rows((4, 4)), even_rows((4, 3)), even_rows((1, 1)), even_rows((4,)), even_rows(None)
    (4, 0, 0, 0, 0)
    """
    if sizes is None or len(sizes) < 2:
        return 0
    s = sizes[0]
    return s if s > 1 and sizes.count(s) == len(sizes) else 0


def worth(sizes: tuple[int, ...] | None) -> bool:
    """Whether shards of ``sizes`` can show where a leaf's rows are: two or more, one of them
    with two rows or more."""
    return sizes is not None and len(sizes) > 1 and max(sizes) > 1


def rows_dims(col: Sequence[Any], sizes: Sequence[int], dim: int) -> tuple[int, ...]:
    """The dims other than ``dim`` along which every replica's tensor in ``col`` holds its
    shard's rows, when none holds them along ``dim`` (see the module's text); ``()``: nothing
    decisive.

    >>> import torch
    >>> rows_dims([torch.zeros(1, 4, 5), torch.zeros(1, 4, 5)], (4, 4), 0)
    (1,)
    >>> rows_dims([torch.zeros(4, 4), torch.zeros(4, 4)], (4, 4), 0)
    ()
    """
    first = col[0]
    if not isinstance(first, Tensor):
        return ()
    n = first.dim()
    if n < 2 or not -n <= dim < n:
        return ()
    dd = dim % n
    shapes = []
    for v in col:
        if not isinstance(v, Tensor) or v.is_nested or v.dim() != n:
            return ()
        shapes.append(tuple(v.shape))
    rows = list(sizes)
    if any(sh[dd] == s for sh, s in zip(shapes, rows, strict=True)):
        return ()
    return tuple(
        d
        for d in range(n)
        if d != dd and all(sh[d] == s for sh, s in zip(shapes, rows, strict=True))
    )


def _defaults(plan: Plan) -> list[int] | None:
    """The positions the default rules combine (``None``: every one)."""
    if plan.default_only:
        return None
    rules, groups = plan.rules, plan.groups
    return [
        p for p, (r, g) in enumerate(zip(rules, groups, strict=True)) if r is None and g is None
    ]


def _suspects(
    columns: list[tuple[Any, ...]], positions: list[int] | None, s: int, dim: int
) -> list[int]:
    """The positions whose replica-0 value does not hold ``s`` rows along ``dim`` (a necessary
    condition of :func:`rows_dims`, found cheaply: one C call per leaf for tensors, a 0-dim one
    giving 0)."""
    cols = columns if positions is None else [columns[p] for p in positions]
    try:
        if dim == 0:
            found = list(map(_TENSOR_LEN, map(_FIRST, cols)))
        else:
            found = [c[0].shape[dim] for c in cols]
    except (TypeError, RuntimeError, AttributeError, IndexError):  # not all tensors of dims
        found = [_size(c[0], dim, s) for c in cols]
    if found.count(s) == len(found):
        return []
    at = range(len(cols)) if positions is None else positions
    return [p for p, n in zip(at, found, strict=True) if n != s]


def _size(v: Any, dim: int, s: int) -> Any:
    """``v``'s size along ``dim``, or ``s`` (never a suspect) where it has none to read."""
    if not isinstance(v, Tensor):
        return s
    try:
        return v.shape[dim]
    except (IndexError, RuntimeError):
        return None  # (a 0-dim or nested tensor: rows_dims decides, cheaply)


_NOTHING: tuple[list[Any], list[Node]] = ([], [])


def refused(
    plan: Plan, columns: list[tuple[Any, ...]], sizes: tuple[int, ...], dim: int
) -> tuple[list[tuple[int, tuple[int, ...]]], list[Node]]:
    """What :func:`check` refuses: the tensor positions with the dims their rows are along, and
    the per-sample list nodes. Under shards of even sizes (:func:`even_rows`: checked before
    combining) it costs one size read per leaf and a look at the plan's lists when nothing is
    refused; after a failure, any sizes are checked."""
    if not worth(sizes):
        return _NOTHING
    positions = None if plan.default_only else _defaults(plan)
    s = even_rows(sizes)
    if s:
        suspects = _suspects(columns, positions, s, dim)
        lists = plan.lists()
        if not suspects and (not lists or all(n != s for _, _, n in lists)):
            return _NOTHING
    else:
        suspects = list(range(len(columns))) if positions is None else positions
    tensors = [(p, found) for p in suspects if (found := rows_dims(columns[p], sizes, dim))]
    samples = sample_lists(plan, columns, sizes, dim) if s else []
    if samples:
        inside = [(nd.start, nd.stop) for nd in samples]
        tensors = [t for t in tensors if not any(a <= t[0] < b for a, b in inside)]
    return tensors, samples


def sample_lists(
    plan: Plan, columns: list[tuple[Any, ...]], sizes: tuple[int, ...], dim: int
) -> list[Node]:
    """The list nodes of ``plan`` that hold one item per sample of even shards (see the
    module's text), outermost only."""
    s = sizes[0]
    found: list[tuple[int, int, int]] = []
    for start, stop, length in plan.lists():
        if length != s or any(a <= start and stop <= b for a, b, _ in found):
            continue
        per_replica = [[col[r] for col in columns[start:stop]] for r in range(len(sizes))]
        if _samples(per_replica, (stop - start) // length, sizes, dim):
            found.append((start, stop, length))
    if not found:
        return []
    out: list[Node] = []
    for nd in nodes(plan.up_spec):  # (pre-order: a list before the lists inside it)
        if nd.spec.kind == _LIST and (nd.start, nd.stop, nd.spec.num_children) in found:
            if not any(o.start <= nd.start and nd.stop <= o.stop for o in out):
                out.append(nd)
    return out


def _samples(per_replica: list[list[Any]], width: int, sizes: Sequence[int], dim: int) -> bool:
    """Whether lists whose leaves are ``per_replica`` (item by item, ``width`` leaves an item,
    as many items as the replica's shard has rows) hold one item per sample: the ``j``-th
    leaf of every item is a tensor of one number of dims (or never one), one of them at least
    has dims, and none holds its replica's shard rows along ``dim`` in every item of every
    replica (a list of batched tensors: per-layer features, two heads' logits)."""
    dims = False
    for j in range(width):
        values = [
            (leaves[i], s)
            for leaves, s in zip(per_replica, sizes)
            for i in range(j, len(leaves), width)
        ]
        tensors = [isinstance(v, Tensor) and not v.is_nested for v, _ in values]
        if not any(tensors):
            continue
        if not all(tensors) or len({v.dim() for v, _ in values}) > 1:
            return False  # (a tensor in one item and not in another: two structures)
        n = values[0][0].dim()
        if n == 0:
            continue
        if not -n <= dim < n:
            return False
        dims = True
        if all(v.shape[dim] == s for v, s in values):
            return False  # batched
    return dims


def check(
    plan: Plan, columns: list[tuple[Any, ...]], sizes: tuple[int, ...] | None, dim: int
) -> None:
    """Refuse the positions whose rows are not where the default rules join them (see the
    module's text): a :class:`~treegather.ShapeMismatchError` naming each tensor's path, the
    shard sizes, its shapes and the ``cat(d)`` to write, or a
    :class:`~treegather.StructureMismatchError` for a list of per-sample items (every problem
    listed in one error, the lists' class when there are any)."""
    if sizes is None:
        return
    tensors, lists = refused(plan, columns, sizes, dim)
    if not tensors and not lists:
        return
    problems: list[tuple[int, str]] = []
    fixes: list[tuple[int, Node, str]] = []
    shown = list(sizes)
    for nd in lists:
        problems.append((nd.start, _list_text(display_path(nd, ROOT), shown)))
        fixes.append((nd.start, nd, "tg.cat_items()"))
    for pos, dims in tensors:
        nd = plan.node_of(pos)
        col = columns[pos]
        n = col[0].dim()
        problems.append((pos, _tensor_text(display_path(nd, ROOT), dims, dim % n, dim, shown, col)))
        fixes.append((pos, nd, f"tg.cat({dims[0]})"))
    problems.sort(key=_FIRST)
    fixes.sort(key=_FIRST)
    hint = (
        "say where the rows are with a rule in the gather layout (out_layout= of data_parallel, "
        f"DataParallel and patch): {_spelled([(nd, r) for _, nd, r in fixes])}"
        + ("; cat_items() gives every replica's items, in order" if lists else "")
        + "; a rule given in the layout, even cat(0), is taken as written"
    )
    cls = StructureMismatchError if lists else ShapeMismatchError
    raise cls(f"{bullet_list([t for _, t in problems], hint)}\n{EXPLAIN_POINTER}")


def _tensor_text(
    path: str, dims: tuple[int, ...], dd: int, dim: int, sizes: list[int], col: Sequence[Any]
) -> str:
    where = f"dim {dims[0]}" + "".join(f" (or {d})" for d in dims[1:])
    shapes = [tuple(v.shape) for v in col]
    return (
        f"{path}: its rows are along {where}, not dim {dd}: on every replica it holds that "
        f"replica's shard rows ({sizes}) along {where} and not along dim {dd}, where the "
        f"default rule cat(dim={dim}) would join it ({by_replica(shapes)})"
    )


def _list_text(path: str, sizes: list[int]) -> str:
    return (
        f"{path}: a list of one item per sample: on every replica it holds as many items as that "
        f"replica's shard has rows ({sizes}) and no batched tensor, and the default rules would "
        "join the replicas' items position by position (item 0 of every replica into one "
        "item), mixing samples"
    )


def _spelled(fixes: list[tuple[Node, str]]) -> str:
    """The layout that gives each node its rule: the rule alone for the root, else
    ``tg.by_path({...})``."""
    if len(fixes) == 1 and not fixes[0][0].path:
        return f"{fixes[0][1]} (the rule of the whole output)"
    items = ", ".join(f"{writable_path(nd, ROOT)!r}: {rule}" for nd, rule in fixes)
    return f"tg.by_path({{{items}}})"


def list_hint(
    outputs: Sequence[Any], plan: Plan, sizes: tuple[int, ...] | None, dim: int
) -> tuple[list[str], str] | None:
    """For a structure error: the lists of replica 0's tree (combined by the default rules)
    whose replicas hold as many items as their shards' rows, items of one structure, none of
    their leaves batched (see the module's text), with the ``cat_items()`` to write; ``None``
    where there is none (nor where finding them fails: the structure error is said as it is)."""
    if not worth(sizes) or plan.up_spec is not plan.spec:
        return None
    assert sizes is not None
    try:
        return _list_hint(outputs, plan, sizes, dim)
    except Exception:  # (an error path: a hint that cannot be made is left out)
        return None


def _list_hint(
    outputs: Sequence[Any], plan: Plan, sizes: tuple[int, ...], dim: int
) -> tuple[list[str], str] | None:
    k = len(sizes)
    if len(outputs) != k:
        return None
    rules = plan.rules
    flat = [flatten(out, ROOT) for out in outputs]
    by_raw = [{nd.raw: nd for nd in nodes(spec)} for _, spec in flat]
    found: list[Node] = []
    for nd in nodes(flat[0][1]):
        if nd.spec.kind != _LIST or any(f.start <= nd.start and nd.stop <= f.stop for f in found):
            continue
        if any(rules[p] is not None for p in range(nd.start, nd.stop)):
            continue
        per = [table.get(nd.raw) for table in by_raw]
        if any(
            other is None or other.spec.kind != _LIST or other.spec.num_children != s
            for other, s in zip(per, sizes, strict=True)
        ):
            continue
        items = [child for other in per for child in other.spec.children()]  # type: ignore[union-attr]
        if not items or not alike(items) or not items[0].num_leaves:
            continue
        per_replica = [
            flat[r][0][other.start : other.stop]  # type: ignore[union-attr]
            for r, other in enumerate(per)
        ]
        if not _samples(per_replica, items[0].num_leaves, sizes, dim):
            continue
        found.append(nd)
    if not found:
        return None
    shown = list(sizes)
    lines = [
        f"{display_path(nd, ROOT)}: every replica's list holds one item per sample of its "
        f"shard ({shown} rows)"
        for nd in found
    ]
    hint = (
        "gather a per-sample list with cat_items() (every replica's items, in order): "
        f"{_spelled([(nd, 'tg.cat_items()') for nd in found])}"
    )
    return lines, hint
