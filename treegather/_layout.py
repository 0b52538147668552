"""Layouts: how a whole tree is divided or combined, resolved once per structure into a plan.

A layout is a single rule, a prefix tree of rules in the vmap/pmap convention, or
:func:`by_path` patterns. :func:`resolve` turns (structure, layout) into a :class:`Plan`: which
rule each leaf gets, and which subtrees a whole-value rule takes as one. Plans are cached, so a
training loop pays for resolution once.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Mapping
from typing import Any, cast

import optree
from optree import PyTreeSpec

from ._errors import LayoutError, bullet_list
from ._rules import SHORTHANDS, Broadcast, Cat, Custom, First, Rule, Split
from ._tree import NAMESPACE, Node, _child_styles, format_path, nodes

__all__ = ["ByPath", "by_path", "Plan", "resolve", "display_path"]

_AUTO: Any = object()


class ByPath:
    """A layout written as dotted path patterns; build it with :func:`by_path`."""

    __slots__ = ("default", "patterns")

    def __init__(self, patterns: Mapping[str, Any], default: Any = None) -> None:
        if not isinstance(patterns, Mapping):
            raise TypeError(f"by_path expects a mapping of patterns to rules, got {patterns!r}")
        items = []
        for pattern, rule in patterns.items():
            if not isinstance(pattern, str):
                raise LayoutError(f"by_path pattern {pattern!r} is not a string")
            segments = tuple(pattern.split(".")) if pattern else ()
            if any(not s for s in segments):
                raise LayoutError(f"by_path pattern {pattern!r} has an empty segment")
            items.append((pattern, segments, rule))
        self.patterns: tuple[tuple[str, tuple[str, ...], Any], ...] = tuple(items)
        self.default = default

    def __repr__(self) -> str:
        inner = ", ".join(f"{p!r}: {r!r}" for p, _, r in self.patterns)
        return f"by_path({{{inner}}}, default={self.default!r})"


def by_path(patterns: Mapping[str, Any], default: Any = None) -> ByPath:
    """A layout given as dotted path patterns mapped to rules.

    Each segment of a pattern is a dict key, an attribute/field name or an index, matched with
    :mod:`fnmatch` (``*``, ``?``, ``[ab]``); ``**`` matches any number of segments. A pattern may
    name an inner node: a leaf-wise rule there applies to every leaf below, a whole-value rule
    takes the subtree. When several patterns match, the one with more literal segments wins
    (then the deeper one); an exact tie is an error, and so is a pattern that matches nothing.
    Leaves no pattern matches get ``default`` (``None``: the built-in default for their type).

    Args:
        patterns: ``{"pattern": rule}``; a rule is a rule object, an int dim, ``None``, a
            rule-name string or (for gather) a callable ``f(values, device)``.
        default: the rule for unmatched leaves.

    Returns:
        A layout for :func:`scatter`, :func:`scatter_kwargs` or :func:`gather`.

    >>> import torch, treegather as tg
    >>> outs = [{"loss": torch.tensor(1.0), "meta": {"id": 1}},
    ...         {"loss": torch.tensor(2.0), "meta": {"id": 2}}]
    >>> tg.gather(outs, "cpu", tg.by_path({"loss": "mean", "meta.*": "first"}))
    {'loss': tensor(1.5000), 'meta': {'id': 1}}
    """
    return ByPath(patterns, default)


class Plan:
    """What to do with each leaf of one structure under one layout."""

    __slots__ = ("all_cat", "default_only", "groups", "node_of", "rules", "spec", "up_spec")

    def __init__(
        self,
        spec: PyTreeSpec,
        up_spec: PyTreeSpec,
        rules: list[Rule | None],
        groups: list[tuple[int, Node, Rule] | None],
        node_of: Callable[[int], Node],
    ) -> None:
        self.spec = spec
        self.up_spec = up_spec
        # Per position of ``up_spec``'s leaves: the leaf-wise rule (None: the default by type),
        # or for a whole-value group, ``groups[pos] = (pos, node, rule)``.
        self.rules = rules
        self.groups = groups
        self.node_of = node_of
        self.default_only = up_spec is spec and all(r is None for r in rules)
        # Learned by gather: every leaf concatenates with one torch.cat (its fast path).
        self.all_cat = True


def to_rule(value: Any, phase: str, dim: int, where: str) -> Rule | None:
    """Normalise one layout entry to a rule (``None`` result: the default for the leaf's type)."""
    if isinstance(value, Rule):
        if value.phase != phase:
            raise LayoutError(
                f"{where}: {value.describe()} is a {value.phase} rule and cannot be used in {phase}"
            )
        return value
    if value is None:
        return Broadcast() if phase == "scatter" else First()
    if isinstance(value, bool):
        raise LayoutError(f"{where}: {value!r} is not a rule")
    if isinstance(value, int):
        return Split(value) if phase == "scatter" else Cat(value)
    if isinstance(value, str):
        make = SHORTHANDS.get(value)
        if make is None:
            close = difflib.get_close_matches(value, SHORTHANDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise LayoutError(f"{where}: unknown rule {value!r}{hint}")
        rule = make(dim)
        if rule.phase != phase:
            raise LayoutError(f"{where}: {value!r} is a {rule.phase} rule, not a {phase} rule")
        return rule
    if callable(value):
        if phase != "gather":
            raise LayoutError(f"{where}: custom callables are gather rules, not scatter rules")
        return Custom(value)
    raise LayoutError(f"{where}: {value!r} is not a rule (expected a rule, int, None or string)")


def display_path(node: Node, root: str | None) -> str:
    """A node's path for messages; ``root=None`` means an ``(args, kwargs)`` pair."""
    if root is not None:
        return format_path(root, node.path)
    if not node.path:
        return "(args, kwargs)"
    head = "args" if node.raw[0] == 0 else "kwargs"
    return format_path(head, node.path[1:])


# ------------------------------------------------------------------------------ resolution

_PLANS: dict[Any, Plan] = {}


def _layout_key(layout: Any) -> Any:
    if layout is None or isinstance(layout, (Rule, ByPath, str, int)) or callable(layout):
        return layout
    leaves, lspec = optree.tree_flatten(layout, none_is_leaf=True, namespace=NAMESPACE)
    return (lspec, tuple(leaves))


_RECENT: dict[tuple[int, int, str, int, str | None], tuple[PyTreeSpec, Any, Plan]] = {}


def resolve(spec: PyTreeSpec, layout: Any, phase: str, dim: int, root: str | None) -> Plan:
    """The plan for data of structure ``spec`` under ``layout`` (cached)."""
    # Identity fast path: the structure cache hands back the same spec object each step, and
    # immutable layouts are the same object too; no hashing of a large spec then.
    quick = (id(spec), id(layout), phase, dim, root)
    hit = _RECENT.get(quick)
    if hit is not None and hit[0] is spec and hit[1] is layout:
        return hit[2]
    try:
        key = (spec, _layout_key(layout), phase, dim, root)
        plan = _PLANS.get(key)
    except TypeError:  # something unhashable (static metadata, a layout leaf): no cache
        key, plan = None, None
    if plan is not None and (plan.spec is spec or _key_orders(plan.spec) == _key_orders(spec)):
        return plan
    plan = _build(spec, layout, phase, dim, root)
    if key is not None:
        if len(_PLANS) > 512:
            _PLANS.clear()
        _PLANS[key] = plan
    if layout is None or isinstance(layout, (Rule, ByPath, str, int)):
        if len(_RECENT) > 64:
            _RECENT.clear()
        _RECENT[quick] = (spec, layout, plan)
    return plan


_MAPPINGS = (optree.PyTreeKind.DICT, optree.PyTreeKind.ORDEREDDICT, optree.PyTreeKind.DEFAULTDICT)


def _key_orders(spec: PyTreeSpec) -> list[tuple[Any, ...]]:
    """The insertion order of every mapping's keys in ``spec``, pre-order.

    PyTreeSpec equality (and hash) ignores dict insertion order, so a plan cached for
    ``{'a', 'b'}`` would otherwise rebuild ``{'b', 'a'}`` data in the order ``a, b``.
    """
    out: list[tuple[Any, ...]] = []

    def visit(node: PyTreeSpec) -> None:
        level = node.one_level() if node.kind in _MAPPINGS and node.num_children > 1 else None
        if level is not None:
            out.append(tuple(level.unflatten([None] * node.num_children)))
        for child in node.children():
            visit(child)

    visit(spec)
    return out


def _build(spec: PyTreeSpec, layout: Any, phase: str, dim: int, root: str | None) -> Plan:
    n = spec.num_leaves
    if layout is None:
        return Plan(spec, spec, [None] * n, [None] * n, _lazy_leaf_nodes(spec))
    all_nodes = nodes(spec)
    if isinstance(layout, ByPath):
        assigned = _assign_by_path(all_nodes, layout, phase, dim, root)
    else:
        assigned = _assign_prefix(spec, all_nodes, layout, phase, dim, root)
    leaf_rules: list[Rule | None] = [None] * n
    whole: list[tuple[Node, Rule]] = []
    for node, rule in assigned:
        if rule is not None and rule.whole:
            whole.append((node, rule))
        else:
            leaf_rules[node.start : node.stop] = [rule] * (node.stop - node.start)
    leaf_nodes = [nd for nd in all_nodes if nd.spec.is_leaf()]
    if not whole:
        return Plan(spec, spec, leaf_rules, [None] * n, leaf_nodes.__getitem__)
    return _with_groups(spec, all_nodes, leaf_nodes, leaf_rules, whole)


def _lazy_leaf_nodes(spec: PyTreeSpec) -> Callable[[int], Node]:
    def node_of(i: int) -> Node:
        return [nd for nd in nodes(spec) if nd.spec.is_leaf()][i]

    return node_of


class _Group:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _with_groups(
    spec: PyTreeSpec,
    all_nodes: list[Node],
    leaf_nodes: list[Node],
    leaf_rules: list[Rule | None],
    whole: list[tuple[Node, Rule]],
) -> Plan:
    """Replace each whole-value node by a single leaf position in a coarser structure."""
    by_raw = {nd.raw: i for i, (nd, _) in enumerate(whole)}
    counter = iter(range(spec.num_leaves))

    def build(node: PyTreeSpec, raw: tuple[Any, ...]) -> Any:
        if raw in by_raw:
            for _ in range(node.num_leaves):
                next(counter)
            return _Group(by_raw[raw])
        if node.is_leaf():
            return next(counter)
        children = [build(c, (*raw, e)) for e, c in zip(node.entries(), node.children())]
        return node.one_level().unflatten(children)  # type: ignore[union-attr]

    skeleton = build(spec, ())
    up_leaves, up_spec = optree.tree_flatten(skeleton, namespace=NAMESPACE)
    rules: list[Rule | None] = []
    groups: list[tuple[int, Node, Rule] | None] = []
    positions: list[Node] = []
    for pos, item in enumerate(up_leaves):
        if isinstance(item, _Group):
            node, rule = whole[item.index]
            rules.append(None)
            groups.append((pos, node, rule))
            positions.append(node)
        else:
            rules.append(leaf_rules[item])
            groups.append(None)
            positions.append(leaf_nodes[item])
    return Plan(spec, up_spec, rules, groups, positions.__getitem__)


def _assign_prefix(
    spec: PyTreeSpec,
    all_nodes: list[Node],
    layout: Any,
    phase: str,
    dim: int,
    root: str | None,
) -> list[tuple[Node, Rule | None]]:
    lleaves, lspec = optree.tree_flatten(layout, none_is_leaf=True, namespace=NAMESPACE)
    if root is None and lspec.is_leaf():
        # One rule for an (args, kwargs) pair applies to each argument: a whole-value rule
        # (split_items) takes each argument whole, never the synthetic pair itself.
        rule = to_rule(lleaves[0], phase, dim, "layout")
        return [(nd, rule) for nd in all_nodes if len(nd.path) == 2]
    skeleton = spec.unflatten(range(spec.num_leaves))
    try:
        lspec.flatten_up_to(skeleton)
    except (ValueError, TypeError) as exc:
        problems = _prefix_problems(layout, spec, root) or [str(exc)]
        name = "(args, kwargs)" if root is None else root
        raise LayoutError(
            f"the layout is not a prefix of the structure of {name}:\n"
            + bullet_list(
                problems if len(problems) > 1 else [f"  - {problems[0]}"],
                "a prefix-tree layout mirrors the data's containers down to where it puts a rule "
                "(every key of a dict, every item of a list); use by_path({...}) for a partial "
                "layout",
            )
        ) from None
    by_raw = {nd.raw: nd for nd in all_nodes}
    out: list[tuple[Node, Rule | None]] = []
    for path, value in zip(lspec.paths(), lleaves):
        node = by_raw[tuple(path)]
        out.append((node, to_rule(value, phase, dim, f"layout at {display_path(node, root)}")))
    return out


def _prefix_problems(layout: Any, spec: PyTreeSpec, root: str | None) -> list[str]:
    """Where a prefix-tree layout departs from the data's structure, as the user would read it."""
    problems: list[str] = []

    def is_rule(x: Any) -> bool:
        return optree.tree_structure(x, none_is_leaf=True, namespace=NAMESPACE).is_leaf()

    def name(t: Any) -> str:
        return "None" if t is type(None) else f"a {t.__qualname__}"

    def walk(
        lay: Any, node: PyTreeSpec, path: tuple[tuple[Any, str], ...], raw: tuple[Any, ...]
    ) -> None:
        if len(problems) >= 20 or is_rule(lay):
            return
        where = display_path(Node(path, raw, 0, 0, node), root)
        if node.is_leaf():
            problems.append(f"{where}: the layout has {name(type(lay))} where the data has a leaf")
            return
        if type(lay) is not node.type:
            problems.append(
                f"{where}: the layout has {name(type(lay))} where the data has {name(node.type)}"
            )
            return
        children, _, entries, _ = optree.tree_flatten_one_level(
            cast(Any, lay), none_is_leaf=True, namespace=NAMESPACE
        )
        data_entries = list(node.entries())
        if list(entries) != data_entries:
            if isinstance(lay, Mapping):
                common = [k for k in entries if k in data_entries]
                lacks = [k for k in data_entries if k not in entries]
                extra = [k for k in entries if k not in data_entries]
                parts = []
                if lacks:
                    parts.append(f"lacks key(s) {', '.join(map(repr, lacks))}")
                if extra:
                    parts.append(f"has key(s) {', '.join(map(repr, extra))} the data does not")
                problems.append(f"{where}: the layout {' and '.join(parts)}")
                styled = dict(zip(data_entries, _child_styles(node)))
                for key in common:
                    walk(
                        lay[key],
                        node.children()[data_entries.index(key)],
                        (*path, styled[key]),
                        (*raw, key),
                    )
            else:
                problems.append(
                    f"{where}: the layout has {len(entries)} item(s) where the data has "
                    f"{len(data_entries)}"
                )
            return
        styled = dict(zip(data_entries, _child_styles(node)))
        for entry, child_lay, child in zip(entries, children, node.children()):
            walk(child_lay, child, (*path, styled[entry]), (*raw, entry))

    walk(layout, spec, (), ())
    return problems


def _segments(node: Node, root: str | None) -> tuple[tuple[str, ...], ...]:
    segs = []
    for (entry, _), raw in zip(node.path, node.raw):
        names = (str(entry),) if str(entry) == str(raw) else (str(entry), str(raw))
        segs.append(names)
    return tuple(segs[1:]) if root is None else tuple(segs)


def _match(pattern: tuple[str, ...], segs: tuple[tuple[str, ...], ...]) -> bool:
    if not pattern:
        return not segs
    head = pattern[0]
    if head == "**":
        return any(_match(pattern[1:], segs[i:]) for i in range(len(segs) + 1))
    if not segs:
        return False
    return any(fnmatch.fnmatchcase(s, head) for s in segs[0]) and _match(pattern[1:], segs[1:])


def _score(pattern: tuple[str, ...]) -> tuple[int, int]:
    literal = sum(1 for s in pattern if not any(c in s for c in "*?["))
    return literal, sum(1 for s in pattern if s != "**")


def _assign_by_path(
    all_nodes: list[Node], layout: ByPath, phase: str, dim: int, root: str | None
) -> list[tuple[Node, Rule | None]]:
    candidates = [nd for nd in all_nodes if len(nd.path) >= (2 if root is None else 1)]
    seg_of = [(nd, _segments(nd, root)) for nd in candidates]
    problems: list[str] = []
    matches: list[tuple[tuple[int, int], str, Node, Rule | None]] = []
    for pattern, pat_segs, value in layout.patterns:
        hit = [nd for nd, segs in seg_of if _match(pat_segs, segs)]
        if not hit:
            names = [".".join(s[0] for s in segs) for _, segs in seg_of]
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5)
            hint = f"; close paths: {', '.join(close)}" if close else ""
            problems.append(f"by_path pattern {pattern!r} matches nothing{hint}")
            continue
        rule = to_rule(value, phase, dim, f"by_path pattern {pattern!r}")
        score = _score(pat_segs)
        matches.extend((score, pattern, nd, rule) for nd in hit)
    if problems:
        raise LayoutError(
            bullet_list(
                problems,
                "patterns are dotted paths from the root: "
                "'loss', 'meta.*', 'hidden.0', '**.logits'",
            )
        )
    default = (
        None if layout.default is None else to_rule(layout.default, phase, dim, "by_path default")
    )
    # Per leaf: the best match among the nodes on its path.
    n = all_nodes[0].stop if all_nodes else 0
    best: list[tuple[tuple[int, int], str, Node, Rule | None] | None] = [None] * n
    ties: dict[int, list[str]] = {}
    for match in sorted(matches, key=lambda m: m[0], reverse=True):
        score, pattern, node, _ = match
        for i in range(node.start, node.stop):
            cur = best[i]
            if cur is None:
                best[i] = match
            elif cur[0] == score and cur[1] != pattern:
                ties.setdefault(i, [cur[1]]).append(pattern)
    leaf_nodes = [nd for nd in all_nodes if nd.spec.is_leaf()]
    if ties:
        problems = [
            f"{display_path(leaf_nodes[i], root)} is matched equally well by "
            + " and ".join(repr(p) for p in dict.fromkeys(pats))
            for i, pats in sorted(ties.items())
        ]
        raise LayoutError(bullet_list(problems, "make one pattern more specific"))
    out: list[tuple[Node, Rule | None]] = []
    seen_groups: set[int] = set()
    for i in range(n):
        cur = best[i]
        if cur is None:
            out.append((leaf_nodes[i], default))
            continue
        _, pattern, node, rule = cur
        if rule is not None and rule.whole:
            if id(node) in seen_groups:
                continue
            inside = [best[j] for j in range(node.start, node.stop)]
            stray = [m for m in inside if m is None or m[2] is not node]
            if stray:
                other = next(m for m in stray if m is not None) if any(stray) else None
                where = display_path(node, root)
                raise LayoutError(
                    f"{rule.describe()} on {where} (pattern {pattern!r}) takes the subtree whole, "
                    + (
                        f"but pattern {other[1]!r} sets a rule inside it"
                        if other
                        else "but part of it is matched elsewhere"
                    )
                )
            seen_groups.add(id(node))
            out.append((node, rule))
        else:
            out.append((leaf_nodes[i], rule))
    # Whole-value rules on empty nodes (None, {}) still apply: as_list on None gives [None, ...].
    for _, _, node, rule in matches:
        if node.start == node.stop and rule is not None and rule.whole:
            enclosing = [
                m
                for m in matches
                if m[2] is not node
                and m[3] is not None
                and m[3].whole
                and m[2].raw == node.raw[: len(m[2].raw)]
            ]
            if not enclosing:
                out.append((node, rule))
    return out
