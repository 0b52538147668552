"""gather: per-replica output trees -> one tree on one device, leaf by leaf, rule by rule.

This module is the definition (:func:`gather_reference`): flatten replica 0, resolve the plan,
take every replica's leaves (checking the structures agree), combine each position by its
rule, unflatten. The public :func:`gather` checks its arguments and asks the compiled layer
(:mod:`treegather._compiled`), which runs the same steps faster for structures it has seen.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from . import _compiled, _misplaced
from ._caches import FAST_PATHS
from ._combine import Inputs, combine_default, combine_planned, needs_move
from ._devices import DeviceLike, as_device
from ._errors import (
    ArgumentTypeError,
    BatchSizeError,
    LayoutError,
    LeafTypeError,
    ShapeMismatchError,
    StructureMismatchError,
    bullet_list,
    check_dim,
    safe_repr,
)
from ._layout import Plan, display_path, resolve
from ._mismatch import ROOT, diagnose, structure_error
from ._rules import Cat, CatItems, Pad, Stack
from ._tree import BatchNode, batch_nodes, flatten, is_batched, is_leaf, rebuild, rows_of
from ._tree.batch import misclaim_text, misclaims, sizes_by_path

__all__ = ["gather", "gather_call", "gather_reference", "gather_from", "combine", "ROOT"]

Tensor = torch.Tensor
# Typed errors a rule raises with its position's path (the others are explained by diagnose).
_RAISED = (
    StructureMismatchError,
    ShapeMismatchError,
    LeafTypeError,
    LayoutError,
    ArgumentTypeError,
    BatchSizeError,
)


def gather(
    outputs: Sequence[Any],
    target_device: DeviceLike,
    layout: Any = None,
    *,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
) -> Any:
    """Combine per-replica output trees into one tree on ``target_device``.

    Every replica's tree must have the structure of replica 0's (dict keys may come in another
    order; the result keeps replica 0's). Tensors are concatenated along ``dim`` by default (a
    vector when every replica holds a 0-dim tensor); any other leaf becomes the list of
    per-replica values; ``None`` stays ``None``; registered dataclasses come back whole.
    ``layout`` changes the rule per leaf (see :func:`by_path` and the rules). All operations are
    differentiable, so gradients flow back to every replica. CPU tensors are fine.

    Args:
        outputs: one tree per replica.
        target_device: where the result goes (an int is a CUDA index, ``-1`` is the CPU).
        layout: a rule, a prefix tree of rules, or :func:`by_path` patterns.
        dim: the dim tensors are concatenated along by default.
        sizes: rows per replica (the shard sizes), used to weight :func:`mean`.

    Returns:
        The gathered tree.

    Raises:
        StructureMismatchError: replicas' trees differ (a key, a length, ``None`` vs a value).
        ShapeMismatchError: tensors cannot be combined under their rule.
        BatchSizeError: a node holding a batch size (a TensorDict, a ``register_dataclass(
            batch_size=)`` class) claims other rows than its leaves hold in a replica.
        LeafTypeError: a rule does not apply to a leaf's type.
        LayoutError: the layout does not fit the outputs.

    >>> import torch, treegather as tg
    >>> outs = [{"logits": torch.zeros(2, 3), "loss": torch.tensor(0.5), "name": "a", "aux": None},
    ...         {"logits": torch.ones(1, 3), "loss": torch.tensor(1.5), "name": "b", "aux": None}]
    >>> out = tg.gather(outs, "cpu")
    >>> out["logits"].shape, out["loss"], out["name"], out["aux"]
    (torch.Size([3, 3]), tensor([0.5000, 1.5000]), ['a', 'b'], None)
    """
    return gather_call(outputs, target_device, layout, dim, sizes, None)


def gather_call(
    outputs: Sequence[Any],
    target_device: DeviceLike,
    layout: Any,
    dim: int,
    sizes: Sequence[int] | None,
    inputs: Inputs | None,
) -> Any:
    """:func:`gather` of the outputs of a call whose per-replica ``inputs`` (``(args, kwargs)``
    each) are known: the entry points' gather (``mean(weight=f)`` reads them)."""
    if type(outputs) is not list:
        if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Sequence):
            raise TypeError(
                "gather expects a sequence with one output tree per replica, got "
                f"{type(outputs).__name__}"
            )
        outputs = list(outputs)
    k = len(outputs)
    if k == 0:
        raise ValueError("gather needs at least one replica's output, got an empty sequence")
    if type(target_device) is torch.device and target_device.index is None:
        target = target_device  # (an index to check: "cuda:0" is available, "cpu:1" is no device)
    else:
        target = as_device(target_device)
    if sizes is not None:
        sizes = _check_sizes(sizes, k)
    dim = check_dim(dim, "gather")
    if inputs is not None and len(inputs) != k:
        inputs = None  # (not one call per output: nothing to weigh by)
    if not FAST_PATHS.on:
        return gather_reference(outputs, target, layout, dim, sizes, inputs)
    done = _compiled.gather(outputs, target, layout, dim, sizes)
    if type(done) is not _compiled.Known:
        return done  # the compiled layer did the whole step
    if done.plan is None:  # it declined with nothing to go on
        return gather_reference(outputs, target, layout, dim, sizes, inputs)
    if done.columns is not None:  # every replica read, by position
        return combine(outputs, done.columns, done.plan, target, dim, sizes, inputs)
    assert done.leaves is not None
    return gather_from(outputs, done.leaves, done.plan, target, dim, sizes, inputs)


def _check_sizes(sizes: Sequence[int], k: int) -> tuple[int, ...]:
    """``sizes`` as a tuple of k non-negative ints (rows per replica), or a clear error."""
    try:
        items = list(sizes) if not isinstance(sizes, (str, bytes)) else None
    except TypeError:
        items = None
    if items is None:
        raise ArgumentTypeError(
            f"gather: sizes must be a sequence of ints (rows per replica), got {safe_repr(sizes)}"
        )
    out: list[int] = []
    for r, s in enumerate(items):
        try:
            if isinstance(s, bool):
                raise TypeError
            n = operator.index(s)  # ints, numpy ints, 0-dim integer tensors; never 1.9
        except TypeError:
            raise ArgumentTypeError(
                f"gather: sizes[{r}] must be an int (the rows replica {r} got), "
                f"got {type(s).__name__} {safe_repr(s)}"
            ) from None
        if n < 0:
            raise ValueError(f"gather: sizes[{r}] must be >= 0 (rows of replica {r}), got {n}")
        out.append(n)
    if len(out) != k:
        raise ValueError(f"gather got {len(out)} sizes for {k} replicas: {out}")
    return tuple(out)


def gather_reference(
    outputs: list[Any],
    target: torch.device,
    layout: Any,
    dim: int,
    sizes: tuple[int, ...] | None,
    inputs: Inputs | None = None,
) -> Any:
    """The definition of :func:`gather` (arguments already checked). No cache."""
    leaves0, spec0 = flatten(outputs[0], ROOT)
    plan = resolve(spec0, layout, "gather", dim, ROOT)
    return gather_from(outputs, leaves0, plan, target, dim, sizes, inputs)


def gather_from(
    outputs: list[Any],
    leaves0: list[Any],
    plan: Plan,
    target: torch.device,
    dim: int,
    sizes: tuple[int, ...] | None,
    inputs: Inputs | None = None,
) -> Any:
    """Every replica's leaves for ``plan`` (replica 0's are ``leaves0``), then :func:`combine`."""
    columns = list(zip(*replica_leaves(outputs, leaves0, plan, sizes, dim)))
    return combine(outputs, columns, plan, target, dim, sizes, inputs)


def replica_leaves(
    outputs: list[Any],
    leaves0: list[Any],
    plan: Plan,
    sizes: tuple[int, ...] | None = None,
    dim: int = 0,
) -> list[list[Any]]:
    """Each replica flattened to the plan's positions; a :class:`StructureMismatchError` when
    any replica's structure differs from replica 0's (dict keys may come in another order),
    which says to gather a list with ``cat_items()`` where every replica's holds one item per
    sample of its shard (``sizes``: the rows of each)."""
    if plan.up_spec is plan.spec:
        per_replica = [leaves0]
        for r, out in enumerate(outputs[1:], start=1):
            leaves, spec = flatten(out, ROOT, f"replica {r}: ")
            if spec != plan.spec:
                raise structure_error(
                    outputs, plan, _misplaced.list_hint(outputs, plan, sizes, dim)
                )
            per_replica.append(leaves)
        return per_replica
    # Whole-value groups may differ inside (per-sample lists): flatten down to the groups only.
    try:
        per_replica = [plan.up_spec.flatten_up_to(out) for out in outputs]
    except Exception:  # optree's mismatch message is replaced by one naming the paths
        raise structure_error(outputs, plan) from None
    groups = plan.groups
    for leaves in per_replica:
        for pos, value in enumerate(leaves):
            if groups[pos] is None and type(value) is not Tensor and not is_leaf(value):
                raise structure_error(outputs, plan)
    return per_replica


def combine(
    outputs: list[Any],
    columns: list[tuple[Any, ...]],
    plan: Plan,
    target: torch.device,
    dim: int,
    sizes: tuple[int, ...] | None,
    inputs: Inputs | None = None,
) -> Any:
    """Combine each position across replicas by its rule and rebuild the tree on ``target``.

    ``columns[i]`` holds position ``i`` of every replica; ``inputs`` their calls, if known.

    Before moving tensors to another device every position is checked (copies are costly);
    on one device the combine itself finds problems, which are then explained, every problem
    listed, with nothing returned and no custom rule run. With the shard ``sizes`` known, a
    position the default rules combine whose rows are elsewhere (:mod:`treegather._misplaced`)
    is refused first: with shards of even sizes before anything is combined, with uneven ones
    (where such a leaf cannot be concatenated) when the combine fails.
    """
    if sizes is not None and _misplaced.even_rows(sizes):
        _misplaced.check(plan, columns, sizes, dim)
    sizes_joined = None
    if is_batched(plan.up_spec):  # nodes whose metadata holds a batch size: checked, joined
        sizes_joined = joined_sizes(outputs, columns, plan, dim)
    moving = needs_move(columns, target)
    if moving:
        problem = diagnose(plan, columns, dim, None, sizes, target)
        if problem is not None:
            _misplaced.check(plan, columns, sizes, dim)
            raise problem
    try:
        if plan.default_only:
            results = combine_default(columns, target, moving, dim)
        else:
            results = combine_planned(plan, columns, target, moving, sizes, dim, inputs)
    except (RuntimeError, TypeError, ValueError, IndexError, AttributeError) as exc:
        if isinstance(exc, _RAISED):
            raise
        _misplaced.check(plan, columns, sizes, dim)
        err = diagnose(plan, columns, dim, exc, sizes, target)
        if err is None:  # nothing wrong with the data (e.g. a custom rule raised): keep its error
            raise
        raise err from exc
    if sizes_joined is not None:  # the batch nodes rebuilt with the rows joined
        return rebuild(plan.up_spec, results, sizes_joined, ROOT)
    return plan.up_spec.unflatten(results)


def joined_sizes(
    outputs: list[Any], columns: list[tuple[Any, ...]], plan: Plan, dim: int
) -> dict[int, tuple[int, ...]]:
    """The batch size of every batch node of ``plan.up_spec`` in the gathered tree, each
    replica's checked against its leaves first (read from ``columns``: nothing is combined yet).

    Along the dims its leaves are concatenated along (``cat``, ``pad``; a per-sample list under
    ``cat_items()`` and a value laid out by rows: dim 0), the replicas' rows added up: each
    replica's node must hold, along such a dim, the rows its leaves hold there (a
    :class:`BatchSizeError` naming its path, the replica, its batch size and the leaf: the
    check scatter makes, :func:`treegather._tree.batch.misclaims`). A node without tensor
    leaves follows ``dim``; its other dims must agree between the replicas (a
    :class:`ShapeMismatchError` naming its path). A node whose tensors are all stacked along one
    new dim within its batch dims (``stack(d)``) holds the number of replicas there, as
    ``torch.stack`` of tensordicts gives. A node whose tensors are combined otherwise keeps
    replica 0's batch size. A node without tensors inside another batch node does as that node
    did.
    """
    found = batch_nodes(plan.up_spec)
    per_replica = [_sizes_by_path(out) for out in outputs]
    replica_sizes = [
        [found_r.get(bn.node.raw, bn.meta.size) for bn in found] for found_r in per_replica
    ]
    joins = _join_dims(columns, plan, dim)
    out: dict[int, tuple[int, ...]] = {}
    held_by: dict[int, tuple[int, ...]] = {}
    # node -> the dim its tensors were stacked along, or -1: joined; absent: its size kept
    outcome: dict[int, int] = {}
    for i, bn in enumerate(found):
        start, stop = bn.node.start, bn.node.stop
        dims: set[int] = set()
        stacked: set[int] = set()  # the new dims of tensors under stack()
        tensors = unstacked = False
        for pos in range(start, stop):
            first = columns[pos][0]
            joined = joins.get(pos)
            if isinstance(first, Tensor):
                tensors = True
                group = plan.groups[pos]
                rule = group[2] if group is not None else plan.rules[pos]
                if isinstance(rule, Stack):
                    stacked.add(rule.dim % (first.dim() + 1))
                else:
                    unstacked = True
            elif joined is not None and rows_of(first) is not None:
                tensors = unstacked = True  # (its rows joined, as a tensor's along dim 0)
            if joined is not None:
                dims.add(joined)
        size0 = bn.meta.size
        sizes = [rs[i] for rs in replica_sizes]
        if not tensors:  # (a node without tensors follows the node it is in, if any)
            raw = bn.node.raw
            outer = [j for j in range(i) if raw[: len(found[j].node.raw)] == found[j].node.raw]
            if outer:
                how = outcome.get(outer[-1])
                if how is None:  # (its batch size kept)
                    continue
                if how >= 0:
                    stacked, unstacked = {how}, False
        if not dims and not tensors and not stacked:
            dims = {dim if dim >= 0 else dim + len(size0)}
        held = {d for d in dims if 0 <= d < len(size0)}
        if not held:
            # every tensor stacked along one new dim within the batch dims (torch.stack of
            # tensordicts): the replicas' count inserted there, where their batch sizes agree
            if len(stacked) == 1 and not unstacked and all(s == size0 for s in sizes):
                (d,) = stacked
                if d <= len(size0):
                    out[i] = (*size0[:d], len(outputs), *size0[d:])
                    outcome[i] = d
            continue
        other = [j for j in range(len(size0)) if j not in held]
        if any(len(s) != len(size0) or any(s[j] != size0[j] for j in other) for s in sizes):
            shown = "; ".join(f"replica {r}: {list(s)}" for r, s in enumerate(sizes[:4]))
            raise ShapeMismatchError(
                f"{display_path(bn.node, ROOT)}: the replicas' {bn.meta.rule.cls.__qualname__} "
                f"batch sizes differ in dims the gather does not join ({shown})\n"
                f"Hint: only the dims its leaves are concatenated along ({sorted(held)}) may differ"
            )
        held_by[i] = tuple(sorted(held))
        out[i] = tuple(
            sum(s[j] for s in sizes) if j in held else size0[j] for j in range(len(size0))
        )
        outcome[i] = -1
    _check_claims(found, replica_sizes, held_by, joins, columns, plan)
    return out


def _join_dims(columns: list[tuple[Any, ...]], plan: Plan, dim: int) -> dict[int, int]:
    """The dim each position's values are joined along, as replica 0's value and its rule say
    (``cat``, ``pad``, the default ``cat``: that dim; ``cat_items()``, and a value laid out by
    rows under the default rule or ``cat()``: 0); positions combined otherwise are absent."""
    joins: dict[int, int] = {}
    for pos, col in enumerate(columns):
        first = col[0]
        group = plan.groups[pos]
        rule = group[2] if group is not None else plan.rules[pos]
        by_rows = rule is None or (isinstance(rule, Cat) and rule.dim == 0)
        if isinstance(rule, CatItems) or (by_rows and rows_of(first) is not None):
            joins[pos] = 0
        elif isinstance(first, Tensor) and first.dim() > 0:
            if rule is None:
                joins[pos] = dim % first.dim()
            elif isinstance(rule, (Cat, Pad)):
                joins[pos] = rule.dim % first.dim()
    return joins


def _check_claims(
    found: Sequence[BatchNode],
    replica_sizes: list[list[tuple[int, ...]]],
    held: dict[int, tuple[int, ...]],
    joins: dict[int, int],
    columns: list[tuple[Any, ...]],
    plan: Plan,
) -> None:
    """Each replica's batch nodes against the rows of their leaves along the dims joined
    (a value the rule cannot join is left to the rule, which names it)."""
    problems: list[str] = []
    for r, sizes in enumerate(replica_sizes):
        along: dict[int, tuple[int, int]] = {}
        for pos, d in joins.items():
            rows = _rows_along(columns[pos][r], d)
            if rows is not None:
                along[pos] = (d, rows)
        for m in misclaims(found, sizes, held, along):
            assert m.leaf is not None
            leaf = display_path(plan.node_of(m.leaf), ROOT)
            problems.append(misclaim_text(m, found, ROOT, f"replica {r}'s", leaf))
    if problems:
        raise BatchSizeError(
            bullet_list(
                problems,
                "a node holding a batch size must hold the rows of its leaves, in every replica",
            )
        )


def _rows_along(value: Any, d: int) -> int | None:
    """The rows ``value`` holds along dim ``d`` (a tensor's, a list's length, a value laid out
    by rows), ``None`` when it has no such dim."""
    if isinstance(value, Tensor):
        return value.shape[d] if d < value.dim() else None
    held = rows_of(value)
    if held is not None:
        return held.rows
    if isinstance(value, (list, tuple)):
        return len(value)
    return None


def _sizes_by_path(tree: Any) -> dict[tuple[Any, ...], tuple[int, ...]]:
    """Every batch node's batch size in ``tree``, by its raw path."""
    return sizes_by_path(flatten(tree, ROOT)[1])
