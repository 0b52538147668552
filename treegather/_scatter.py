"""scatter: one input tree -> one tree per device, split or broadcast leaf by leaf.

This module is the definition (:func:`scatter_reference`): flatten, resolve the plan, validate
every leaf, cut, place on devices. The public :func:`scatter` asks the compiled layer
(:mod:`treegather._compiled`), which runs the same steps faster for structures it has seen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, cast

import torch

from . import _compiled
from ._caches import FAST_PATHS
from ._devices import DeviceLike, as_devices
from ._errors import EXPLAIN_POINTER, BatchSizeError, LeafTypeError, bullet_list, check_dim
from ._layout import Plan, display_path, resolve
from ._rules import Cut, Problem, default_cut
from ._shards import Shards, balanced
from ._tree import (
    INPUT_AND_KWARGS,
    BatchNode,
    Rows,
    batch_nodes,
    describe,
    flatten,
    is_batched,
    move_tree,
    rebuild,
    rows_of,
)
from ._tree.batch import misclaim_text, misclaims

__all__ = [
    "Shards",
    "balanced",
    "place",
    "scatter",
    "call_tree",
    "scatter_call",
    "scatter_kwargs",
    "scatter_reference",
]

Tensor = torch.Tensor


def scatter(
    inputs: Any,
    devices: Sequence[DeviceLike] | DeviceLike,
    layout: Any = None,
    *,
    dim: int = 0,
) -> Shards:
    """Divide one input tree into one tree per device.

    Tensors of one or more dims are split along ``dim`` (balanced as ``torch.tensor_split``:
    10 rows on 4 devices give 3, 3, 2, 2); everything else (0-dim tensors, numbers, strings) is
    broadcast, tensors moved to each replica's device. When the batch has fewer rows than there
    are devices, only that many shards are made: never an empty shard. Every bad input is
    reported before anything is split or moved. Splits and moves are differentiable.

    Args:
        inputs: the tree to divide.
        devices: the target devices (ints are CUDA indices, ``-1`` the CPU; repeats allowed).
        layout: a rule, a prefix tree of rules, or :func:`by_path` patterns.
        dim: the dim tensors are split along by default.

    Returns:
        A :class:`Shards` list with one tree per used device, and the shard ``sizes``.

    Raises:
        BatchSizeError: split leaves disagree on the batch size, or a node holding a batch size
            claims other rows than the batch.
        LeafTypeError: a rule does not apply to a leaf (``split()`` on a string, an unregistered
            dataclass).
        LayoutError: the layout does not fit the inputs.

    >>> import torch, treegather as tg
    >>> shards = tg.scatter({"x": torch.arange(10), "scale": 2.0}, ["cpu"] * 4)
    >>> [s["x"].tolist() for s in shards], shards.sizes, shards[3]["scale"]
    ([[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]], (3, 3, 2, 2), 2.0)
    """
    return _scatter(inputs, as_devices(devices), layout, check_dim(dim, "scatter"), "inputs")


def scatter_kwargs(
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    devices: Sequence[DeviceLike] | DeviceLike,
    layout: Any = None,
    *,
    dim: int = 0,
) -> tuple[Shards, Shards]:
    """Scatter positional and keyword arguments together, torch-style.

    A prefix-tree ``layout`` mirrors ``(args, kwargs)``; :func:`by_path` paths start at the
    positional index or the keyword name (``"0.ids"``, ``"labels"``).

    Returns:
        ``(args_shards, kwargs_shards)``: per device a tuple of positional arguments and a dict of
        keyword arguments, the same number of each.

    >>> import torch, treegather as tg
    >>> a, kw = tg.scatter_kwargs((torch.zeros(4, 2),), {"labels": torch.arange(4)}, ["cpu"] * 2)
    >>> [x[0].shape[0] for x in a], [k["labels"].tolist() for k in kw]
    ([2, 2], [[0, 1], [2, 3]])
    """
    if not isinstance(args, tuple):
        args = tuple(args)
    kw = {} if kwargs is None else dict(kwargs)
    dim = check_dim(dim, "scatter_kwargs")
    shards = _scatter((args, kw), as_devices(devices), layout, dim, None)
    return (
        Shards([s[0] for s in shards], shards.sizes, shards.devices),
        Shards([s[1] for s in shards], shards.sizes, shards.devices),
    )


def scatter_call(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    devs: tuple[torch.device, ...],
    layout: Any,
    dim: int,
) -> tuple[Shards, Shards]:
    """:func:`scatter_kwargs` for :func:`treegather.data_parallel`'s ``inputs``, as passed.

    A tuple (not a namedtuple) is the positional arguments, laid out as in
    :func:`scatter_kwargs` (``"0.names"``); anything else is the single argument, and the
    layout's paths start at it, as in :func:`scatter` (``"names"``, ``inputs['names']`` in
    messages), next to the keyword arguments' names.

    >>> import torch
    >>> from treegather import by_path, split_items
    >>> a, kw = scatter_call({"x": torch.zeros(4), "ids": list("abcd")}, None,
    ...                      (torch.device("cpu"),) * 2, by_path({"ids": split_items()}), 0)
    >>> [s[0]["ids"] for s in a], kw
    ([['a', 'b'], ['c', 'd']], Shards([{}, {}], sizes=(2, 2), devices=['cpu', 'cpu']))
    """
    tree, root = call_tree(inputs, kwargs)
    shards = _scatter(tree, devs, layout, dim, root)
    if root is None:
        return (
            Shards([s[0] for s in shards], shards.sizes, shards.devices),
            Shards([s[1] for s in shards], shards.sizes, shards.devices),
        )
    return (
        Shards([(s[0],) for s in shards], shards.sizes, shards.devices),
        Shards([s[1] for s in shards], shards.sizes, shards.devices),
    )


def call_tree(inputs: Any, kwargs: Mapping[str, Any] | None) -> tuple[Any, str | None]:
    """The tree a call scatters, and its root: ``(args, kwargs)`` for a tuple of positional
    arguments (root ``None``), else ``(input, kwargs)`` (root :data:`INPUT_AND_KWARGS`)."""
    kw = {} if kwargs is None else dict(kwargs)
    if isinstance(inputs, tuple) and not hasattr(inputs, "_fields"):
        return (inputs, kw), None
    return (inputs, kw), INPUT_AND_KWARGS


def _scatter(
    inputs: Any, devs: tuple[torch.device, ...], layout: Any, dim: int, root: str | None
) -> Shards:
    """The scatter step (arguments checked): the compiled layer does it, for a structure it
    has seen, or declines with what it found (the leaves and the plan), and :func:`place`
    does the rest; with every fast path off (:func:`treegather._caches.reference_only`), the
    reference steps alone."""
    if not FAST_PATHS.on:
        return scatter_reference(inputs, devs, layout, dim, root)
    done = _compiled.scatter(inputs, devs, layout, dim, root)
    if type(done) is Shards:
        return done
    known = cast(_compiled.Known, done)
    return place(inputs, cast(list, known.leaves), cast(Plan, known.plan), devs, dim, root)


def scatter_reference(
    inputs: Any, devs: tuple[torch.device, ...], layout: Any, dim: int, root: str | None
) -> Shards:
    """The definition of :func:`scatter`: flatten, resolve, then :func:`place`. No cache."""
    leaves, spec = flatten(inputs, root)
    return place(inputs, leaves, resolve(spec, layout, "scatter", dim, root), devs, dim, root)


def place(
    inputs: Any,
    leaves: list[Any],
    plan: Plan,
    devs: tuple[torch.device, ...],
    dim: int,
    root: str | None,
) -> Shards:
    """Validate every position of ``plan``, then cut and place it on the devices.

    ``leaves`` are ``inputs``' leaves for ``plan.spec``; whole-value groups are taken from
    ``inputs`` again. Nothing is split or moved unless every position is valid.
    """
    up = leaves if plan.up_spec is plan.spec else plan.up_spec.flatten_up_to(inputs)
    cuts = _validate(up, plan, dim, root, devs)
    follow = None
    if is_batched(plan.up_spec):  # nodes whose metadata holds a batch size
        follow = following(up, cuts, plan, dim, root)
    sizes = _shard_sizes(cuts, len(devs), None if follow is None else follow.rows)
    k = len(devs) if sizes is None else len(sizes)
    columns = _cut(up, cuts, sizes, k)
    shard_sizes = None
    if follow is not None and sizes is not None and follow.dims:
        shard_sizes = follow.shards(sizes)
    trees = _on_devices(columns, cuts, plan, devs[:k], shard_sizes, root)
    return Shards(trees, sizes, devs[:k])


class _Cuts(NamedTuple):
    """What pass 1 found: positions to split (with their dim), per-sample item positions, the
    batch size each was seen with, and explicit ``split(sizes=...)``."""

    splits: list[tuple[int, int]]
    items: list[int]
    lengths: dict[int, list[int]]
    explicit: dict[tuple[int, ...], list[int]]


def survey(
    up: list[Any], plan: Plan, dim: int, devs: tuple[torch.device, ...]
) -> tuple[_Cuts, list[Cut | Problem]]:
    """Pass 1: how every position is cut, as its rule says (:meth:`shard`), or what is wrong
    with it; nothing is touched."""
    cuts = _Cuts([], [], {}, {})
    found: list[Cut | Problem] = []
    meta_ok = all(d.type == "meta" for d in devs)
    for pos, x in enumerate(up):
        cut = classify(pos, x, plan, dim, meta_ok)
        found.append(cut)
        if isinstance(cut, Problem):
            continue
        if cut.kind == "split":
            cuts.splits.append((pos, cut.dim))
        elif cut.kind == "items":
            cuts.items.append(pos)
        else:
            continue
        if cut.sizes is not None:  # (split(sizes=...), of a tensor or of a PackedSequence)
            cuts.explicit.setdefault(cut.sizes, []).append(pos)
        cuts.lengths.setdefault(cut.rows, []).append(pos)
    return cuts, found


def _validate(
    up: list[Any], plan: Plan, dim: int, root: str | None, devs: tuple[torch.device, ...]
) -> _Cuts:
    """Pass 1, checked: every problem is reported, before any tensor is touched."""
    cuts, found = survey(up, plan, dim, devs)
    problems = [
        f"{display_path(plan.node_of(pos), root)}: {p.text}"
        for pos, p in enumerate(found)
        if isinstance(p, Problem)
    ]
    type_problem = any(isinstance(p, Problem) and p.type_problem for p in found)
    arrays = [pos for pos, c in enumerate(found) if isinstance(c, Cut) and c.kind == "array"]
    if cuts.lengths and arrays:
        type_problem = True
        problems.extend(
            f"{display_path(plan.node_of(pos), root)}: {describe(up[pos])} would be sent whole "
            "to every device while the batch is split; convert it with torch.as_tensor (then it "
            "is split too) or mark it broadcast() in the layout"
            for pos in arrays
        )

    def where(positions: list[int]) -> str:
        shown = ", ".join(display_path(plan.node_of(p), root) for p in positions[:3])
        return shown + (f" and {len(positions) - 3} more" if len(positions) > 3 else "")

    if len(cuts.lengths) > 1:
        problems.append(
            "split leaves disagree on the batch size: "
            + "; ".join(
                f"{n} at {where(ps)}"
                for n, ps in sorted(cuts.lengths.items(), key=lambda kv: kv[1][0])
            )
        )
    if len(cuts.explicit) > 1:
        problems.append(
            "split rules give different sizes: "
            + "; ".join(f"{list(s)} at {where(ps)}" for s, ps in cuts.explicit.items())
        )
    if problems:
        hint = "use broadcast() for leaves every device needs whole" if cuts.lengths else None
        raise (LeafTypeError if type_problem else BatchSizeError)(
            f"{bullet_list(problems, hint)}\n{EXPLAIN_POINTER}"
        )
    return cuts


def classify(pos: int, x: Any, plan: Plan, dim: int, meta_ok: bool) -> Cut | Problem:
    """How position ``pos`` (value ``x``) is cut: its rule's :meth:`shard`, or the default's;
    a meta tensor that would be placed on a device (unless every device is the meta device)
    is a problem, naming the rule."""
    group = plan.groups[pos]
    rule = group[2] if group is not None else plan.rules[pos]
    if meta_ok:
        meta = None
    elif group is None:
        meta = x if isinstance(x, Tensor) and x.is_meta else None
    else:  # (split_items(): its items go to the devices)
        meta = next((v for v in flatten(x)[0] if isinstance(v, Tensor) and v.is_meta), None)
    if meta is not None:
        shown = "the default rule" if rule is None else rule.describe()
        return Problem(
            f"{describe(meta)} is a meta tensor: it holds no data to place on a device ({shown})",
            True,
        )
    if rule is None:
        return default_cut(x, dim)
    return rule.shard(x, dim)  # type: ignore[attr-defined]


def _shard_sizes(cuts: _Cuts, k: int, claimed: int | None = None) -> tuple[int, ...] | None:
    """Rows per shard (``None`` when nothing is split); never an empty shard but for n = 0.
    ``claimed``: the rows of batch nodes without split leaves, when no leaf is split."""
    if not cuts.lengths and claimed is None:
        return None
    n = next(iter(cuts.lengths)) if cuts.lengths else claimed
    assert n is not None
    if cuts.explicit:
        sizes = next(iter(cuts.explicit))
        if sum(sizes) != n or len(sizes) > k:
            raise BatchSizeError(
                f"split sizes {list(sizes)} must add up to the batch size {n} and name at "
                f"most {k} shards (one per device)\n{EXPLAIN_POINTER}"
            )
        return sizes
    if n == 0:
        return (0,)  # an empty batch stays one (empty) shard rather than vanishing
    return balanced(n, min(n, k))


def _cut(up: list[Any], cuts: _Cuts, sizes: tuple[int, ...] | None, k: int) -> list[Any]:
    """Pass 2: one column (k values) per position: split, item runs, or the value k times."""
    columns: list[Any] = [None] * len(up)
    even = sizes is not None and not cuts.explicit and sizes == balanced(sum(sizes), k)
    for pos, d in cuts.splits:
        x = up[pos]
        columns[pos] = x.tensor_split(k, d) if even else x.split(list(sizes or ()), d)
    if cuts.items:
        offsets = [0]
        for s in sizes or ():
            offsets.append(offsets[-1] + s)
        for pos in cuts.items:
            seq = up[pos]
            rows = rows_of(seq)
            if rows is not None:  # (laid out by rows its own way: its own split)
                columns[pos] = tuple(rows.split(sizes or ()))
                continue
            columns[pos] = tuple(seq[offsets[r] : offsets[r + 1]] for r in range(k))
    for pos, col in enumerate(columns):
        if col is None:
            columns[pos] = (up[pos],) * k
    return columns


def _on_devices(
    columns: list[Any],
    cuts: _Cuts,
    plan: Plan,
    used: tuple[torch.device, ...],
    shard_sizes: list[dict[int, tuple[int, ...]]] | None = None,
    root: str | None = "inputs",
) -> list[Any]:
    """Pass 3: each device's values moved where needed, rebuilt into its tree (its batch
    nodes with ``shard_sizes[r]``)."""
    k = len(used)
    per_replica = list(zip(*columns)) if columns else [()] * k
    src = {v.device for v in (c[0] for c in columns) if isinstance(v, Tensor)}
    rows = [pos for pos in cuts.items if type(columns[pos][0]) is Rows]
    items = [pos for pos in cuts.items if type(columns[pos][0]) is not Rows]
    item_tensors = any(isinstance(v, Tensor) for pos in items for c in columns[pos] for v in c)
    trees = []
    for r, dev in enumerate(used):
        leaves_r: list[Any] = list(per_replica[r])
        if src and src != {dev}:
            nb = dev.type == "cuda"
            leaves_r = [
                v.to(dev, non_blocking=nb) if isinstance(v, Tensor) and v.device != dev else v
                for v in leaves_r
            ]
        if item_tensors:
            for pos in items:
                leaves_r[pos] = move_tree(leaves_r[pos], dev)
        for pos in rows:  # (the form the tree holds: a node's child, or the leaf itself)
            leaves_r[pos] = leaves_r[pos].to(dev).held
        if shard_sizes is None:
            trees.append(plan.up_spec.unflatten(leaves_r))
        else:
            trees.append(rebuild(plan.up_spec, leaves_r, shard_sizes[r], root))
    return trees


class Following(NamedTuple):
    """The batch nodes whose batch size follows the rows of a scatter."""

    nodes: tuple[BatchNode, ...]
    dims: dict[int, tuple[int, ...]]
    """Node index -> the dims of its batch size that hold the batch's rows."""
    rows: int | None
    """The rows the batch nodes without split leaves claim, when no leaf is split."""

    def shards(self, sizes: tuple[int, ...]) -> list[dict[int, tuple[int, ...]]]:
        """Per shard, the batch size of every following node: its rows along those dims."""
        out: list[dict[int, tuple[int, ...]]] = []
        for rows in sizes:
            per: dict[int, tuple[int, ...]] = {}
            for i, dims in self.dims.items():
                size = list(self.nodes[i].meta.size)
                for d in dims:
                    size[d] = rows
                per[i] = tuple(size)
            out.append(per)
        return out


def following(up: list[Any], cuts: _Cuts, plan: Plan, dim: int, root: str | None) -> Following:
    """Which dims of each batch node's batch size follow the rows, checked against the batch.

    A node follows along the dims its leaves are split along (a per-sample list: dim 0); a node
    with no tensor leaf (none at all, or strings) along ``dim``, when the batch is split; a
    node whose tensors are all sent whole keeps its batch size. A node that holds another number
    of rows than the batch along such a dim is a :class:`BatchSizeError` naming its path
    (:func:`treegather._tree.batch.misclaims`, the check gather makes of every replica too).
    """
    found = batch_nodes(plan.up_spec)
    n = next(iter(cuts.lengths), None)  # (one batch size: _validate refused several)
    along: dict[int, tuple[int, int]] = {}  # every split leaf holds the batch's rows
    for pos, d in cuts.splits:
        along[pos] = (d % up[pos].dim(), cast(int, n))
    for pos in cuts.items:
        along[pos] = (0, cast(int, n))
    held: dict[int, tuple[int, ...]] = {}
    rows = None  # the rows the first node without split leaves claims
    for i, bn in enumerate(found):
        size = bn.meta.size
        start, stop = bn.node.start, bn.node.stop
        mine = {along[p][0] for p in range(start, stop) if p in along}
        if not mine and not any(isinstance(up[p], Tensor) for p in range(start, stop)):
            mine = {dim if dim >= 0 else dim + len(size)}
            alone = True
        else:
            alone = False
        dims = tuple(sorted(d for d in mine if 0 <= d < len(size)))
        if dims:
            held[i] = dims
            if alone and rows is None:
                rows = size[dims[0]]
    wrong = misclaims(found, [bn.meta.size for bn in found], held, along, rows if n is None else n)
    if wrong:
        problems = [misclaim_text(m, found, root, "its") for m in wrong]
        raise BatchSizeError(
            f"{bullet_list(problems, 'a node holding a batch size must hold the rows it is split with')}\n"
            f"{EXPLAIN_POINTER}"
        )
    return Following(found, held, None if cuts.lengths else rows)
