"""Why a gather failed: structure differences between replicas, and leaves that do not fit.

Only the error paths come here (after a combine failed, or before moving tensors across
devices), so clarity wins over speed; nothing recurses on tree depth.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

import optree
import torch

from ._errors import (
    EXPLAIN_POINTER,
    LeafTypeError,
    ShapeMismatchError,
    StructureMismatchError,
    bullet_list,
    safe_repr,
)
from ._layout import Plan, display_path
from ._rules import Cat, CatItems, First, Mean, Pad, Stack, Sum, fill_fits
from ._tree import NAMESPACE, describe, flatten, format_path, is_leaf, nodes

__all__ = ["ROOT", "structure_error", "diagnose", "is_number", "where"]

Tensor = torch.Tensor
ROOT = "outputs"


def is_number(x: Any) -> bool:
    """A Python/numpy number that is not a bool."""
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def where(node: Any) -> str:
    """``"outputs['x']: "`` for a plan node (``""`` without one), to start an error message."""
    return "" if node is None else f"{display_path(node, ROOT)}: "


def _describe_node(x: Any) -> str:
    if isinstance(x, Tensor):
        return describe(x)
    if x is None:
        return "None"
    try:
        children, _, _, _ = optree.tree_flatten_one_level(x, namespace=NAMESPACE)
    except ValueError:
        return describe(x)
    name = type(x).__qualname__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name} of {len(children)} item(s)"


def _diff(a: Any, b: Any, r: int, out: list[str]) -> None:
    """List the differences between replica 0's tree ``a`` and replica ``r``'s ``b`` (at most 20).

    Iterative: trees of any depth.
    """
    stack: list[tuple[Any, Any, tuple[tuple[Any, str], ...]]] = [(a, b, ())]
    while stack and len(out) < 20:
        x, y, path = stack.pop()
        found = _diff_node(x, y, path, r)
        if isinstance(found, str):
            out.append(found)
        elif found:
            stack.extend(reversed(found))


def _diff_node(
    a: Any, b: Any, path: tuple[tuple[Any, str], ...], r: int
) -> str | list[tuple[Any, Any, tuple[tuple[Any, str], ...]]]:
    """One node's difference (a message), or the child pairs to compare next."""
    here = format_path(ROOT, path)
    a_leaf = a is not None and is_leaf(a)
    b_leaf = b is not None and is_leaf(b)
    if a_leaf and b_leaf:
        return []
    if a_leaf != b_leaf or type(a) is not type(b) or (a is None) != (b is None):
        return f"{here}: replica 0 has {_describe_node(a)}, replica {r} has {_describe_node(b)}"
    if a is None:
        return []
    ca, ma, ea, _ = optree.tree_flatten_one_level(a, namespace=NAMESPACE)
    cb, mb, _, _ = optree.tree_flatten_one_level(b, namespace=NAMESPACE)
    if isinstance(a, dict):
        ka, kb = set(a), set(b)
        if ka != kb:
            missing = sorted(map(safe_repr, ka - kb))
            extra = sorted(map(safe_repr, kb - ka))
            parts = []
            if missing:
                parts.append(f"lacks key(s) {', '.join(missing)}")
            if extra:
                parts.append(f"has extra key(s) {', '.join(extra)}")
            return f"{here}: replica {r} {' and '.join(parts)} (compared with replica 0)"
        return [(a[key], b[key], (*path, (key, "key"))) for key in a]
    if len(ca) != len(cb):
        return f"{here}: replica 0 has {_describe_node(a)}, replica {r} has {_describe_node(b)}"
    if ma != mb:
        return (
            f"{here}: replica {r}'s static fields/metadata {safe_repr(mb)} differ from replica "
            f"0's {safe_repr(ma)}"
        )
    return [(x, y, (*path, e)) for e, x, y in zip(_styles_for(a, ea), ca, cb)]


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


def structure_error(outputs: Sequence[Any], plan: Plan) -> StructureMismatchError:
    """The differences between replica 0's tree and the others', as one error."""
    problems: list[str] = []
    groups = [g for g in plan.groups if g is not None]
    grouped = {g[1].raw for g in groups}
    for r in range(1, len(outputs)):
        found: list[str] = []
        _diff(outputs[0], outputs[r], r, found)
        problems.extend(found)
    if grouped:
        # Differences inside whole-value nodes are fine; drop them from the report.
        ok_prefixes = [format_path(ROOT, g[1].path) for g in groups]
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


_HINTS = {
    "shape": "pad() concatenates tensors whose other dims differ; as_list() keeps per-replica "
    "values",
    "dataclass": "register output dataclasses with treegather.register_dataclass(cls) (or "
    "@treegather.register_dataclass above @dataclass): they then come back whole",
    "dtype": "return one dtype from every replica (cast in the model, e.g. .float() or "
    ".long()); torch would promote them, and an int64 id does not survive float32",
    "meta": "a meta tensor has a shape and a dtype but no values (a model built or left on the "
    "meta device): materialise it first (e.g. module.to_empty(device=...) and load the "
    "weights), or keep it out of the outputs (as_list() leaves values untouched)",
}
MAX_PATHS = 10


def diagnose(
    plan: Plan,
    columns: list[tuple[Any, ...]],
    dim: int,
    exc: BaseException | None,
    sizes: tuple[int, ...] | None = None,
    target: torch.device | None = None,
) -> Exception | None:
    """Every leaf whose per-replica values do not fit its rule, as one error.

    Returns ``None`` when nothing is wrong with the data: before any work (``exc=None``) all is
    well; after a failure (``exc`` given) the caller re-raises ``exc`` unchanged. With
    ``target`` (not the meta device), meta tensors that a rule would move there are problems.
    """
    problems: list[str] = []
    hints: dict[str, None] = {}
    type_problem = False
    metas = target is not None and target.type != "meta"
    for pos, col in enumerate(columns):
        group = plan.groups[pos]
        if group is not None:
            if metas and isinstance(group[2], (First, CatItems)):
                found = _moved_metas(group[2], col, display_path(group[1], ROOT))
                if found:
                    problems.append(f"{found}: {_META.format(target=target)}")
                    hints["meta"] = None
                    type_problem = True
            continue
        rule = plan.rules[pos]
        where = display_path(plan.node_of(pos), ROOT)
        if metas and (rule is not None or isinstance(col[0], Tensor)):
            on_meta = [r for r, v in enumerate(col) if isinstance(v, Tensor) and v.is_meta]
            if on_meta:
                replicas = ", ".join(f"replica {r}: {describe(col[r])}" for r in on_meta)
                problems.append(f"{where}: {_META.format(target=target)} ({replicas})")
                hints["meta"] = None
                type_problem = True
                continue
        tensors = [isinstance(v, Tensor) for v in col]
        rule_name = (
            rule.describe()
            if rule is not None
            else (f"cat(dim={dim})" if tensors[0] else "as_list()")
        )
        classes = {type(v) for v in col if dataclasses.is_dataclass(v) and not isinstance(v, type)}
        if classes and (rule is None or not all(tensors)):
            names = ", ".join(sorted(c.__qualname__ for c in classes))
            problems.append(
                f"{where}: {names} is a dataclass treegather does not know, so {rule_name} "
                "cannot look inside it; register it with treegather.register_dataclass"
            )
            hints["dataclass"] = None
            type_problem = True
            continue
        if rule is None and not tensors[0]:
            continue
        if isinstance(rule, (Mean, Sum)) and all(is_number(v) for v in col):
            continue
        if not all(tensors):
            bad = next(i for i, t in enumerate(tensors) if not t)
            problems.append(
                f"{where}: {rule_name} needs tensors, replica {bad} holds {describe(col[bad])}"
            )
            hints["shape"] = None
            type_problem = True
            continue
        dtypes = [v.dtype for v in col]
        if len(set(dtypes)) > 1:
            problems.append(
                f"{where}: {rule_name} needs one dtype in every replica, got "
                + ", ".join(f"replica {i}: {d}" for i, d in enumerate(dtypes))
            )
            hints["dtype"] = None
            continue
        if isinstance(rule, Pad) and not fill_fits(rule.fill, dtypes[0]):
            problems.append(
                f"{where}: {rule_name}: fill {safe_repr(rule.fill)} cannot be stored in {dtypes[0]} "
                "(padding would look like data, or be cut); pick a fill the dtype holds"
            )
            type_problem = True
            continue
        if isinstance(rule, Mean) and sizes is not None and len(sizes) > 1 and not any(sizes):
            problems.append(
                f"{where}: {rule_name} is weighted by sizes {list(sizes)}, which add up to 0"
            )
            continue
        hints["shape"] = None
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
    hint = "; ".join(_HINTS[h] for h in hints) or None
    cls = LeafTypeError if type_problem else ShapeMismatchError
    return cls(f"{bullet_list(problems, hint)}\n{EXPLAIN_POINTER}")


_META = "a meta tensor holds no data to gather onto {target}"


def _moved_metas(rule: Any, col: tuple[Any, ...], root: str) -> str:
    """The paths of the meta tensors a whole-value rule would move (``first()``: replica 0's
    value; ``cat_items()``: every replica's items), joined; ``""`` for none."""
    values = col[:1] if isinstance(rule, First) else col
    found: list[str] = []
    for r, value in enumerate(values):
        leaves, spec = flatten(value)
        if not any(isinstance(x, Tensor) and x.is_meta for x in leaves):
            continue
        paths = [format_path(root, n.path) for n in nodes(spec) if n.spec.is_leaf()]
        found += [
            f"{p} (replica {r})"
            for p, x in zip(paths, leaves)
            if isinstance(x, Tensor) and x.is_meta
        ]
    return ", ".join(found[:MAX_PATHS]) + (" ..." if len(found) > MAX_PATHS else "")


def _by_replica(shapes: Sequence[tuple[int, ...]]) -> str:
    return ", ".join(f"replica {i}: {list(s)}" for i, s in enumerate(shapes))
