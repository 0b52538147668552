"""Layouts: how a whole tree is divided or combined, resolved once per structure into a plan.

A layout is a single rule, a prefix tree of rules in the vmap/pmap convention, or
:func:`by_path` patterns. :func:`resolve` turns (structure, layout) into an immutable
:class:`Plan`: which rule each leaf gets, and which subtrees a whole-value rule takes as one.
This module is the plain definition and caches nothing; the compiled layer
(:mod:`treegather._compiled`) keeps plans per structure, keyed by :func:`layout_key`, so that
equal layouts (an inline ``by_path({...})`` each step) share one plan.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Mapping
from typing import Any, cast

import optree
from optree import PyTreeSpec

from ._caches import typed_key
from ._errors import LayoutError, bullet_list
from ._rules import SHORTHANDS, Broadcast, Cat, Custom, First, Rule, Split
from ._tree import NAMESPACE, Node, child_styles, format_path, leaf_nodes, nodes

__all__ = ["ByPath", "by_path", "Plan", "resolve", "display_path", "layout_key"]

_AUTO: Any = object()


class ByPath:
    """A layout written as dotted path patterns; build it with :func:`by_path`."""

    __slots__ = ("_key", "default", "patterns")

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
        # Equal layouts are equal values (rules by value, callables by identity; True is not 1),
        # so an inline by_path({...}) finds the plan of an equal one written last step.
        self._key = typed_key((tuple((p, r) for p, _, r in items), default))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByPath) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self, "_key"):
            raise AttributeError("a by_path layout is immutable; build a new one")
        object.__setattr__(self, name, value)

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

    __slots__ = ("default_only", "groups", "node_of", "rules", "spec", "up_spec")

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


def layout_key(layout: Any) -> Any:
    """A hashable, type-aware value key for ``layout``: equal layouts, equal keys.

    Rules compare by value, callables by identity, ``True``/``1``/``1.0`` never match.

    >>> layout_key({"a": 1}) == layout_key({"a": 1}), layout_key({"a": 1}) == layout_key({"a": True})
    (True, False)
    """
    if isinstance(layout, ByPath):
        return (ByPath, layout._key)
    return typed_key(layout)


def resolve(spec: PyTreeSpec, layout: Any, phase: str, dim: int, root: str | None) -> Plan:
    """The plan for data of structure ``spec`` under ``layout`` (the definition; no cache).

    >>> import optree
    >>> plan = resolve(optree.tree_structure({"a": 1, "b": 2}), {"a": 0, "b": None}, "scatter",
    ...                0, "inputs")
    >>> [r.describe() for r in plan.rules]
    ['split()', 'broadcast()']
    """
    return _build(spec, layout, phase, dim, root)


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
    """``node_of`` for a default plan: the leaves' nodes are walked only if an error needs a
    path, and then once (a pure function of the spec, computed on first use)."""
    found: list[list[Node]] = []

    def node_of(i: int) -> Node:
        if not found:
            found.append(leaf_nodes(spec))
        return found[0][i]

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
    # Bottom-up over the nodes (reverse pre-order), no recursion: each node's skeleton value is
    # a _Group marker, its leaf index, or its container rebuilt around its children's values.
    values: dict[tuple[Any, ...], Any] = {}
    for nd in reversed(all_nodes):
        if nd.raw in by_raw:
            values[nd.raw] = _Group(by_raw[nd.raw])
        elif nd.spec.is_leaf():
            values[nd.raw] = nd.start
        else:
            children = [values[(*nd.raw, e)] for e in nd.spec.entries()]
            values[nd.raw] = nd.spec.one_level().unflatten(children)
    skeleton = values[()]
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
                styled = dict(zip(data_entries, child_styles(node)))
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
        styled = dict(zip(data_entries, child_styles(node)))
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
