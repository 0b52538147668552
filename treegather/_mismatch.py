"""Why a gather failed: structure differences between replicas, and leaves that do not fit.

Only the error paths come here (after a combine failed, or before moving tensors across
devices), so clarity wins over speed; nothing recurses on tree depth.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

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
from ._rules import HINTS, ROOT, Combining, GatherRule, default_rule
from ._tree import NAMESPACE, describe, differing, format_path, is_leaf
from ._tree.batch import Batched, rule_of

__all__ = ["ROOT", "structure_error", "diagnose"]

Tensor = torch.Tensor


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
        shown_a, shown_b = safe_repr(ma), safe_repr(mb)
        if shown_a == shown_b:  # (where they differ is past what is shown)
            full = [safe_repr(m.aux if type(m) is Batched else m, None) for m in (ma, mb)]
            if full[0] != full[1]:
                shown_a, shown_b = differing(full)
        rule = rule_of(type(a))
        note = f" ({rule.differs})" if rule is not None and rule.differs else ""
        return (
            f"{here}: replica {r}'s static fields/metadata {shown_b} differ from replica "
            f"0's {shown_a}{note}"
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


def structure_error(
    outputs: Sequence[Any], plan: Plan, lists: tuple[list[str], str] | None = None
) -> StructureMismatchError:
    """The differences between replica 0's tree and the others', as one error; ``lists``: the
    lines and hint for lists of per-sample items (:func:`treegather._misplaced.list_hint`)."""
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
    hint = (
        "every replica must return the same structure; for a node whose length varies by "
        "replica (per-sample lists) use cat_items() or as_list() in the layout"
    )
    if lists is not None:
        problems += lists[0]
        hint = lists[1]
    return StructureMismatchError(bullet_list(problems, hint))


def diagnose(
    plan: Plan,
    columns: list[tuple[Any, ...]],
    dim: int,
    exc: BaseException | None,
    sizes: tuple[int, ...] | None = None,
    target: torch.device | None = None,
) -> Exception | None:
    """Every position whose per-replica values do not fit its rule, as one error: each rule
    says what it finds wrong (:meth:`treegather._rules.GatherRule.problem`).

    Returns ``None`` when nothing is wrong with the data: before any work (``exc=None``) all is
    well; after a failure (``exc`` given) the caller re-raises ``exc`` unchanged. With
    ``target`` (not the meta device), meta tensors that a rule would move there are problems.
    """
    ctx = Combining(
        _NOWHERE if target is None else target, False, sizes, dim, failed=exc is not None
    )
    problems: list[str] = []
    hints: dict[str, None] = {}
    type_problem = False
    for pos, col in enumerate(columns):
        group = plan.groups[pos]
        if group is not None:
            node = group[1]
            found = cast(GatherRule, group[2]).problem(col, ctx._replace(node=node))
        else:
            node, given, shown = None, plan.rules[pos], ""
            rule = cast(GatherRule, given) if given is not None else None
            if rule is None:
                rule, shown = default_rule(col[0], dim)
            found = rule.problem(col, ctx, shown)
        if found is None:
            continue
        path = found.path or display_path(node if node is not None else plan.node_of(pos), ROOT)
        problems.append(f"{path}: {found.text}")
        if found.hint is not None:
            hints[found.hint] = None
        type_problem = type_problem or found.type_problem
    if not problems:
        # Nothing wrong with the data: the caller re-raises the original exception (a custom
        # rule's own ValueError stays a ValueError).
        return None
    hint = "; ".join(HINTS[h] for h in hints) or None
    cls = LeafTypeError if type_problem else ShapeMismatchError
    return cls(f"{bullet_list(problems, hint)}\n{EXPLAIN_POINTER}")


_NOWHERE = torch.device("meta")  # no target: nothing is moved, no meta tensor is a problem
