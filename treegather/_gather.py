"""gather: per-replica output trees -> one tree on one device, leaf by leaf, rule by rule.

This module is the definition (:func:`gather_reference`): flatten replica 0, resolve the plan,
take every replica's leaves (checking the structures agree), combine each position by its
rule, unflatten. The public :func:`gather` checks its arguments and asks the compiled layer
(:mod:`treegather._compiled`), which runs the same steps faster for structures it has seen.
"""

from __future__ import annotations

import builtins
import dataclasses
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from . import _compiled
from ._devices import DeviceLike, accelerator_tensors_possible, as_device
from ._errors import (
    ArgumentTypeError,
    BatchSizeError,
    LeafTypeError,
    ShapeMismatchError,
    StructureMismatchError,
    check_dim,
)
from ._layout import Plan, resolve
from ._mismatch import ROOT, diagnose, is_number, structure_error, where
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
from ._tree import describe, flatten, is_leaf, move_tree

__all__ = ["gather", "gather_reference", "gather_from", "combine", "ROOT"]

Tensor = torch.Tensor


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
        LeafTypeError: a rule does not apply to a leaf's type.
        LayoutError: the layout does not fit the outputs.

    >>> import torch, treegather as tg
    >>> outs = [{"logits": torch.zeros(2, 3), "loss": torch.tensor(0.5), "name": "a", "aux": None},
    ...         {"logits": torch.ones(1, 3), "loss": torch.tensor(1.5), "name": "b", "aux": None}]
    >>> out = tg.gather(outs, "cpu")
    >>> out["logits"].shape, out["loss"], out["name"], out["aux"]
    (torch.Size([3, 3]), tensor([0.5000, 1.5000]), ['a', 'b'], None)
    """
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
    target = target_device if type(target_device) is torch.device else as_device(target_device)
    if sizes is not None:
        sizes = _check_sizes(sizes, k)
    return _compiled.gather(outputs, target, layout, check_dim(dim, "gather"), sizes)


def _check_sizes(sizes: Sequence[int], k: int) -> tuple[int, ...]:
    """``sizes`` as a tuple of k non-negative ints (rows per replica), or a clear error."""
    try:
        items = list(sizes) if not isinstance(sizes, (str, bytes)) else None
    except TypeError:
        items = None
    if items is None:
        raise ArgumentTypeError(
            f"gather: sizes must be a sequence of ints (rows per replica), got {sizes!r}"
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
                f"got {type(s).__name__} {s!r}"
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
) -> Any:
    """The definition of :func:`gather` (arguments already checked). No cache."""
    leaves0, spec0 = flatten(outputs[0])
    plan = resolve(spec0, layout, "gather", dim, ROOT)
    return gather_from(outputs, leaves0, plan, target, dim, sizes)


def gather_from(
    outputs: list[Any],
    leaves0: list[Any],
    plan: Plan,
    target: torch.device,
    dim: int,
    sizes: tuple[int, ...] | None,
) -> Any:
    """Every replica's leaves for ``plan`` (replica 0's are ``leaves0``), then :func:`combine`."""
    return combine(outputs, replica_leaves(outputs, leaves0, plan), plan, target, dim, sizes)


def replica_leaves(outputs: list[Any], leaves0: list[Any], plan: Plan) -> list[list[Any]]:
    """Each replica flattened to the plan's positions; a :class:`StructureMismatchError` when
    any replica's structure differs from replica 0's (dict keys may come in another order)."""
    if plan.up_spec is plan.spec:
        per_replica = [leaves0]
        for out in outputs[1:]:
            leaves, spec = flatten(out)
            if spec != plan.spec:
                raise structure_error(outputs, plan)
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
    per_replica: list[list[Any]],
    plan: Plan,
    target: torch.device,
    dim: int,
    sizes: tuple[int, ...] | None,
) -> Any:
    """Combine each position across replicas by its rule and rebuild the tree on ``target``.

    Before moving tensors to another device every position is checked (copies are costly);
    on one device the combine itself finds problems, which are then explained, every problem
    listed, with nothing returned and no custom rule run.
    """
    moving = _needs_move(per_replica, target)
    cpu_only = target.type == "cpu" and not accelerator_tensors_possible()
    if moving:
        problem = diagnose(plan, list(zip(*per_replica)), dim, None, sizes)
        if problem is not None:
            raise problem
    try:
        if plan.default_only:
            results = _gather_default(zip(*per_replica), target, moving, dim, not cpu_only)
        else:
            results = _gather_planned(plan, zip(*per_replica), target, moving, sizes, dim)
    except (RuntimeError, TypeError, ValueError, IndexError, AttributeError) as exc:
        if isinstance(exc, (StructureMismatchError, ShapeMismatchError, LeafTypeError)):
            raise
        err = diagnose(plan, list(zip(*per_replica)), dim, exc, sizes)
        if err is None:  # nothing wrong with the data (e.g. a custom rule raised): keep its error
            raise
        raise err from exc
    return plan.up_spec.unflatten(results)


# ------------------------------------------------------------------------------- the rules


def _needs_move(per_replica: list[list[Any]], target: torch.device) -> bool:
    """Whether any replica's tensors live off ``target`` (sampled: first tensor of each).

    Only a hint for the fast path: a leaf elsewhere is still moved, just less cheaply.
    """
    for leaves in per_replica:
        for value in leaves:
            if type(value) is Tensor or isinstance(value, Tensor):
                if value.device != target:
                    return True
                break
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


def _gather_default(
    columns: Iterable[tuple[Any, ...]],
    target: torch.device,
    moving: bool,
    dim: int,
    check: bool = True,
) -> list[Any]:
    """The default rules (tensors: cat, others: as_list), leaf by leaf.

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
        first = col[0].dtype
        for v in col:
            if v.dtype != first:
                raise ValueError("per-replica tensors have different dtypes")
        if check and ((not r.is_cpu) if cpu else (r.get_device() != index)):
            r = r.to(target)
        append(r)
    return out


def _as_list(col: tuple[Any, ...]) -> list[Any]:
    """The default for non-tensors: the per-replica values; an unregistered dataclass is an
    error (``diagnose`` names the path and hints ``register_dataclass``)."""
    if dataclasses.is_dataclass(col[0]) and not isinstance(col[0], type):
        raise TypeError("an unregistered dataclass output")
    return list(col)


def _gather_planned(
    plan: Plan,
    columns: Iterable[tuple[Any, ...]],
    target: torch.device,
    moving: bool,
    sizes: tuple[int, ...] | None,
    dim: int,
) -> list[Any]:
    out: list[Any] = []
    default = _gather_default
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
        return builtins.sum(v * s for v, s in zip(col, sizes)) / builtins.sum(sizes)
    _one_dtype(col)
    stacked = torch.stack(_to(col, target))
    if isinstance(rule, Sum):
        return stacked.sum(0)
    if not (stacked.is_floating_point() or stacked.is_complex()):
        stacked = stacked.to(torch.get_default_dtype())
    if sizes is None:
        return stacked.mean(0)
    weights = torch.tensor(sizes, dtype=stacked.dtype, device=stacked.device)
    weights = weights.reshape((-1,) + (1,) * (stacked.dim() - 1))
    return (stacked * weights).sum(0) / weights.sum()


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
        elif not bool(x == y):
            return False
    return True
