"""gather: per-replica output trees -> one tree on one device, leaf by leaf, rule by rule."""

from __future__ import annotations

import builtins
import itertools
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import optree
import torch

from ._devices import DeviceLike, accelerator_tensors_possible, as_device
from ._errors import LeafTypeError, ShapeMismatchError, StructureMismatchError, bullet_list
from ._layout import ByPath, Plan, display_path, resolve
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
)
from ._tree import (
    _KNOWN_LEAF_TYPES,
    NAMESPACE,
    describe,
    flatten,
    flatten_replicas,
    format_path,
    leaves_are_leaves,
    remember_replicas,
)

__all__ = ["gather"]

Tensor = torch.Tensor
_ROOT = "outputs"


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
    if type(outputs) is not list and type(outputs) is not tuple:
        if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Sequence):
            raise TypeError(
                "gather expects a sequence with one output tree per replica, got "
                f"{type(outputs).__name__}"
            )
    k = len(outputs)
    if k == 0:
        raise ValueError("gather needs at least one replica's output, got an empty sequence")
    target = target_device if type(target_device) is torch.device else as_device(target_device)
    if sizes is not None:
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) != k:
            raise ValueError(f"gather got {len(sizes)} sizes for {k} replicas: {list(sizes)}")
    # Hot path: the replicas have the structure seen last for this many replicas; one C call
    # flattens them all (replica 0's key order checked).
    fast = flatten_replicas(outputs if type(outputs) is list else list(outputs))
    checked = False  # whether flat is known to hold leaves only (no subtree, no None)
    if fast is not None:
        flat, spec0, entry = fast
        last = entry[3]  # (layout, dim, plan) of the previous call with this structure
        if last is not None and last[0] is layout and last[1] == dim:
            plan = last[2]
        elif not leaves_are_leaves(flat):
            fast = None  # not spec0's structure after all: resolve nothing against it
        else:
            checked = True
            plan = resolve(spec0, layout, "gather", dim, _ROOT)
            if layout is None or isinstance(layout, (Rule, ByPath, str, int)):  # immutable
                entry[3] = (layout, dim, plan)
    if fast is not None:
        n = spec0.num_leaves
        # Replica r's leaves are flat[r * n : (r + 1) * n]; zipping the k slices gives the
        # columns (one leaf across replicas) in C.
        rows = [flat[i : i + n] for i in range(0, k * n, n)] if n else [[] for _ in range(k)]
        if (
            plan.all_cat
            and plan.default_only
            and target.type == "cpu"
            and n
            and not accelerator_tensors_possible()
        ):
            # The per-step case: every leaf a tensor that concatenates, all on the CPU (no
            # accelerator initialised; a tensor on another device, meta say, makes torch.cat
            # fail and the general combine below takes over). torch.cat also fails on anything
            # but tensors, which is the leaf check here: a subtree or a None where the structure
            # has a leaf cannot slip through.
            try:
                if flat[0].is_cpu:
                    if dim:
                        return spec0.unflatten([torch.cat(c, dim) for c in zip(*rows)])
                    return spec0.unflatten(list(map(torch.cat, zip(*rows))))
            except (TypeError, RuntimeError, AttributeError):
                checked = checked or leaves_are_leaves(flat)
                if checked:
                    plan.all_cat = False  # a 0-dim or non-tensor leaf: the general combine below
        if not (checked or leaves_are_leaves(flat)):
            fast = None  # a subtree or None where the structure has a leaf: the general path
        elif plan.up_spec is not spec0:
            per_replica: list[Any] = _flatten_up_to_each(outputs, plan)
        else:
            per_replica = rows
    if fast is None:
        leaves0, spec0 = flatten(outputs[0])
        plan = resolve(spec0, layout, "gather", dim, _ROOT)
        if plan.up_spec is spec0:
            try:
                per_replica = [leaves0, *[spec0.flatten_up_to(outputs[r]) for r in range(1, k)]]
            except (ValueError, TypeError):
                raise _structure_error(outputs, plan) from None
            # Replicas 1.. must hold leaves where replica 0 does (flatten_up_to lets a subtree
            # or a None stand in for a leaf): checked before any tensor is touched.
            if not all(map(leaves_are_leaves, per_replica[1:])) and not _all_leaves(
                plan, per_replica
            ):
                raise _structure_error(outputs, plan)
            remember_replicas(outputs if type(outputs) is list else list(outputs), spec0)
        else:
            per_replica = _flatten_up_to_each(outputs, plan)
    moving = _needs_move(per_replica, target)
    # With no accelerator initialised, tensors are on the CPU (or meta, caught by the sample
    # above): no per-leaf device check on the results then.
    cpu_only = target.type == "cpu" and not accelerator_tensors_possible()
    if moving:
        # Copies to another device are costly: check every leaf before the first one. On one
        # device the combine pass itself finds shape problems (a per-leaf check up front would
        # cost more than the step's Python budget); the failure is then explained with every
        # problem listed, nothing is returned, and no custom rule has run.
        problem = _diagnose(plan, list(zip(*per_replica)), dim, None)
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
        if not _all_leaves(plan, per_replica):
            raise _structure_error(outputs, plan) from None
        err = _diagnose(plan, list(zip(*per_replica)), dim, exc)
        if err is None:  # nothing wrong with the data (e.g. a custom rule raised): keep its error
            raise
        raise err from exc
    return plan.up_spec.unflatten(results)


# ------------------------------------------------------------------------------- hot paths


def _flatten_up_to_each(outputs: Sequence[Any], plan: Plan) -> list[list[Any]]:
    """Each replica flattened down to the plan's positions (whole-value nodes stay whole)."""
    try:
        per_replica = [plan.up_spec.flatten_up_to(out) for out in outputs]
    except (ValueError, TypeError):
        raise _structure_error(outputs, plan) from None
    if len(outputs) > 1 and not _all_leaves(plan, per_replica):
        raise _structure_error(outputs, plan)
    return per_replica


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


def _to(values: Sequence[Tensor], target: torch.device) -> list[Tensor]:
    nb = target.type == "cuda"
    return [v if v.device == target else v.to(target, non_blocking=nb) for v in values]


def _cat(col: Sequence[Tensor], target: torch.device, moving: bool, dim: int) -> Tensor:
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
            _cat(col, target, True, dim) if isinstance(col[0], Tensor) else list(col)
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
                append(list(col))
            continue
        if check and ((not r.is_cpu) if cpu else (r.get_device() != index)):
            r = r.to(target)
        append(r)
    return out


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
        out[pos] = _whole(group[2], col, target, group[1])
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
        return torch.stack(_to(col, target), rule.dim)
    if isinstance(rule, Pad):
        return _pad(rule, col, target)
    raise LeafTypeError(f"{rule.describe()} is not a gather rule")


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def _reduce(
    rule: Rule, col: tuple[Any, ...], target: torch.device, sizes: tuple[int, ...] | None
) -> Any:
    if sizes is not None and builtins.sum(sizes) == 0:
        sizes = None  # an empty batch (one empty shard): nothing to weight by
    if all(_is_number(v) for v in col):
        if isinstance(rule, Sum):
            return builtins.sum(col)
        if sizes is None:
            return builtins.sum(col) / len(col)
        return builtins.sum(v * s for v, s in zip(col, sizes)) / builtins.sum(sizes)
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
    values = _to(col, target)
    ndim = values[0].dim()
    if ndim == 0 or any(v.dim() != ndim for v in values):
        # A plain ValueError: gather's _diagnose turns it into a message naming the leaf's path.
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


def _move_tree(tree: Any, target: torch.device) -> Any:
    return optree.tree_map(
        lambda x: x.to(target) if isinstance(x, Tensor) and x.device != target else x,
        tree,
        namespace=NAMESPACE,
    )


def _whole(rule: Rule, col: tuple[Any, ...], target: torch.device, node: Any = None) -> Any:
    if isinstance(rule, AsList):
        return list(col)
    if isinstance(rule, First):
        if rule.check:
            for r, other in enumerate(col[1:], start=1):
                if not _tree_equal(col[0], other):
                    raise ShapeMismatchError(
                        f"{_where(node)}first(check=True): replica {r} differs from replica 0"
                        f" ({describe(other)} vs {describe(col[0])})"
                    )
        return _move_tree(col[0], target)
    if isinstance(rule, CatItems):
        for r, v in enumerate(col):
            if not isinstance(v, (list, tuple)):
                raise LeafTypeError(
                    f"{_where(node)}cat_items() needs a list or tuple in every replica; replica {r} holds "
                    f"{describe(v)}"
                )
        items = _move_tree(list(itertools.chain.from_iterable(col)), target)
        return tuple(items) if isinstance(col[0], tuple) else items
    if isinstance(rule, Custom):
        return rule.fn(list(col), target)
    raise LeafTypeError(f"{rule.describe()} is not a gather rule")


def _where(node: Any) -> str:
    """``"outputs['x']: "`` for a plan node (``""`` without one), to start an error message."""
    return "" if node is None else f"{display_path(node, _ROOT)}: "


def _tree_equal(a: Any, b: Any) -> bool:
    la, sa = optree.tree_flatten(a, namespace=NAMESPACE)
    lb, sb = optree.tree_flatten(b, namespace=NAMESPACE)
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


# ------------------------------------------------------------------------ validation / errors


def _all_leaves(plan: Plan, per_replica: list[list[Any]]) -> bool:
    """Check replicas 1.. hold leaves (not subtrees) where replica 0 does; fast when they do."""
    groups = plan.groups
    has_groups = plan.up_spec is not plan.spec
    for r, leaves in enumerate(per_replica):
        if r == 0 and not has_groups:
            continue
        if not has_groups and set(map(type, leaves)) <= _KNOWN_LEAF_TYPES:
            continue
        for pos, value in enumerate(leaves):
            if groups[pos] is not None or type(value) in _KNOWN_LEAF_TYPES:
                continue
            if optree.tree_structure(value, namespace=NAMESPACE).is_leaf():
                _KNOWN_LEAF_TYPES.add(type(value))
            else:
                return False
    return True


def _describe_node(x: Any) -> str:
    if isinstance(x, Tensor):
        return describe(x)
    if x is None:
        return "None"
    try:
        children, _, _, _ = optree.tree_flatten_one_level(x, namespace=NAMESPACE)
    except ValueError:
        return describe(x)
    return f"a {type(x).__qualname__} of {len(children)} item(s)"


def _diff(a: Any, b: Any, path: tuple[tuple[Any, str], ...], r: int, out: list[str]) -> None:
    """List the differences between replica 0's subtree ``a`` and replica ``r``'s ``b``."""
    if len(out) >= 20:
        return
    where = format_path(_ROOT, path)
    ta, tb = type(a), type(b)
    a_leaf = a is not None and optree.tree_structure(a, namespace=NAMESPACE).is_leaf()
    b_leaf = b is not None and optree.tree_structure(b, namespace=NAMESPACE).is_leaf()
    if a_leaf and b_leaf:
        return
    if a_leaf != b_leaf or ta is not tb or (a is None) != (b is None):
        out.append(
            f"{where}: replica 0 has {_describe_node(a)}, replica {r} has {_describe_node(b)}"
        )
        return
    if a is None:
        return
    ca, ma, ea, _ = optree.tree_flatten_one_level(a, namespace=NAMESPACE)
    cb, mb, _, _ = optree.tree_flatten_one_level(b, namespace=NAMESPACE)
    if isinstance(a, dict):
        ka, kb = set(a), set(b)
        if ka != kb:
            missing = sorted(map(repr, ka - kb))
            extra = sorted(map(repr, kb - ka))
            parts = []
            if missing:
                parts.append(f"lacks key(s) {', '.join(missing)}")
            if extra:
                parts.append(f"has extra key(s) {', '.join(extra)}")
            out.append(f"{where}: replica {r} {' and '.join(parts)} (compared with replica 0)")
            return
        for key in a:
            _diff(a[key], b[key], (*path, (key, "key")), r, out)
        return
    if len(ca) != len(cb):
        out.append(
            f"{where}: replica 0 has {_describe_node(a)}, replica {r} has {_describe_node(b)}"
        )
        return
    if ma != mb:
        out.append(
            f"{where}: replica {r}'s static fields/metadata {mb!r} differ from replica 0's {ma!r}"
        )
        return
    styled = _styles_for(a, ea)
    for entry, x, y in zip(styled, ca, cb):
        _diff(x, y, (*path, entry), r, out)


def _styles_for(x: Any, entries: Sequence[Any]) -> list[tuple[Any, str]]:
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return [(f, "attr") for f in x._fields]
    if isinstance(x, (list, tuple)):
        return [(i, "index") for i in range(len(entries))]
    return [
        (e, "attr")
        if isinstance(e, str) and e.isidentifier()
        else (e, "index" if isinstance(e, int) else "key")
        for e in entries
    ]


def _structure_error(outputs: Sequence[Any], plan: Plan) -> StructureMismatchError:
    problems: list[str] = []
    groups = [g for g in plan.groups if g is not None]
    grouped = {g[1].raw for g in groups}
    for r in range(1, len(outputs)):
        found: list[str] = []
        _diff(outputs[0], outputs[r], (), r, found)
        problems.extend(found)
    if grouped:
        # Differences inside whole-value nodes are fine; drop them from the report.
        ok_prefixes = [format_path(_ROOT, g[1].path) for g in groups]
        problems = [p for p in problems if not any(p.startswith(o) for o in ok_prefixes)]
    if not problems:
        problems = ["the replicas' trees do not have the same structure"]
    return StructureMismatchError(
        bullet_list(
            problems,
            "every replica must return the same structure; for a node whose length varies by "
            "replica (per-sample lists) use cat_items() or as_list() in the layout",
        )
    )


def _diagnose(
    plan: Plan, columns: list[tuple[Any, ...]], dim: int, exc: BaseException | None
) -> Exception | None:
    """Every leaf whose per-replica values do not fit its rule, as one error.

    Returns ``None`` when nothing is wrong with the data: before any work (``exc=None``) all is
    well; after a failure (``exc`` given) the caller re-raises ``exc`` unchanged.
    """
    problems: list[str] = []
    type_problem = False
    for pos, col in enumerate(columns):
        if plan.groups[pos] is not None:
            continue
        rule = plan.rules[pos]
        where = display_path(plan.node_of(pos), _ROOT)
        tensors = [isinstance(v, Tensor) for v in col]
        rule_name = (
            rule.describe()
            if rule is not None
            else (f"cat(dim={dim})" if tensors[0] else "as_list()")
        )
        if rule is None and not tensors[0]:
            continue
        if isinstance(rule, (Mean, Sum)) and all(_is_number(v) for v in col):
            continue
        if not all(tensors):
            bad = next(i for i, t in enumerate(tensors) if not t)
            problems.append(
                f"{where}: {rule_name} needs tensors, replica {bad} holds {describe(col[bad])}"
            )
            type_problem = True
            continue
        shapes = [tuple(v.shape) for v in col]
        d = rule.dim if isinstance(rule, (Cat, Pad)) else dim
        if isinstance(rule, (Stack, Mean, Sum)):
            if len(set(shapes)) > 1:
                problems.append(
                    f"{where}: {rule_name} needs equal shapes, got {_by_replica(shapes)}"
                )
            elif isinstance(rule, Stack) and not -len(shapes[0]) - 1 <= rule.dim <= len(shapes[0]):
                problems.append(
                    f"{where}: {rule_name} is out of range for {len(shapes[0])}-dim tensors"
                )
        elif isinstance(rule, Pad):
            if len({len(s) for s in shapes}) > 1 or len(shapes[0]) == 0:
                problems.append(
                    f"{where}: {rule_name} needs tensors with the same number of dims (>= 1), got {_by_replica(shapes)}"
                )
            elif not -len(shapes[0]) <= d < len(shapes[0]):
                problems.append(
                    f"{where}: {rule_name} is out of range for {len(shapes[0])}-dim tensors"
                )
        else:
            ndims = {len(s) for s in shapes}
            if ndims == {0}:
                continue
            if len(ndims) > 1:
                problems.append(
                    f"{where}: {rule_name} cannot mix 0-dim and n-dim tensors: {_by_replica(shapes)}"
                    if 0 in ndims
                    else f"{where}: {rule_name} needs tensors with the same number of dims, "
                    f"got {_by_replica(shapes)}"
                )
                continue
            nd = ndims.pop()
            if not -nd <= d < nd:
                problems.append(f"{where}: {rule_name} is out of range for {nd}-dim tensors")
                continue
            others = {tuple(s[: d % nd] + s[d % nd + 1 :]) for s in shapes}
            if len(others) > 1:
                problems.append(
                    f"{where}: {rule_name} needs equal sizes in every dim but {d}, got {_by_replica(shapes)}"
                )
    if not problems:
        # Nothing wrong with the data: the caller re-raises the original exception (a custom
        # rule's own ValueError stays a ValueError).
        return None
    hint = "pad() concatenates tensors whose other dims differ; as_list() keeps per-replica values"
    cls = LeafTypeError if type_problem else ShapeMismatchError
    return cls(bullet_list(problems, hint))


def _by_replica(shapes: Sequence[tuple[int, ...]]) -> str:
    return ", ".join(f"replica {i}: {list(s)}" for i, s in enumerate(shapes))
