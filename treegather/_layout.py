"""Layouts: how a whole tree is divided or combined, resolved once per structure into a plan.

A layout is a single rule, a prefix tree of rules in the vmap/pmap convention, or
:func:`by_path` patterns (dotted fnmatch strings, and tuples for exact paths).
:func:`resolve` turns (structure, layout) into an immutable :class:`Plan`: which rule each leaf
gets, and which subtrees a whole-value rule takes as one; :func:`resolve_sources` also says where
each rule came from (for :func:`treegather.explain`). Errors about fitting a layout to data end
with :data:`EXPLAIN_POINTER`. This module is the plain definition and caches nothing; the
compiled layer (:mod:`treegather._compiled`) keeps plans per structure, keyed by
:func:`layout_key`, so that equal layouts (an inline ``by_path({...})`` each step) share one
plan.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import optree
from optree import PyTreeSpec

from ._caches import typed_key
from ._errors import LayoutError, bullet_list
from ._rules import SHORTHANDS, Broadcast, Cat, Custom, First, Rule, Split
from ._tree import NAMESPACE, Node, child_styles, format_path, leaf_nodes, nodes

__all__ = [
    "ByPath",
    "by_path",
    "Plan",
    "resolve",
    "resolve_sources",
    "RuleSource",
    "describe_source",
    "display_path",
    "layout_key",
    "writable_path",
    "EXPLAIN_POINTER",
]

_AUTO: Any = object()

EXPLAIN_POINTER = "(treegather.explain(tree, layout) shows the rule of every leaf)"
"""The line every layout error ends with: where to see what a layout does to each leaf."""


def _error(message: str) -> LayoutError:
    """A :class:`LayoutError` about fitting a layout to data, ending with the explain pointer."""
    return LayoutError(f"{message}\n{EXPLAIN_POINTER}")


_SPECIALS = "*?["

Patterns = Mapping[str, Any] | Mapping[tuple[Any, ...], Any] | Mapping[str | tuple[Any, ...], Any]
"""What :func:`by_path` takes: dotted patterns and/or exact tuple paths, mapped to rules."""


class ByPath:
    """A layout written as path patterns and exact paths; build it with :func:`by_path`.

    Immutable and compared by value: two ``by_path`` layouts with equal patterns, rules and
    default are equal (``True`` is not ``1``; a tuple path is not the dotted string that spells
    the same path), so an inline ``by_path({...})`` written each step shares one cached plan.
    """

    __slots__ = ("_key", "default", "patterns")

    def __init__(self, patterns: Patterns, default: Any = None) -> None:
        if not isinstance(patterns, Mapping):
            raise TypeError(f"by_path expects a mapping of patterns to rules, got {patterns!r}")
        items = []
        for pattern, rule in patterns.items():
            segments: tuple[Any, ...]
            if isinstance(pattern, str):
                segments = tuple(pattern.split(".")) if pattern else ()
                if any(not s for s in segments):
                    raise LayoutError(
                        f"by_path pattern {pattern!r} has an empty segment (for a key that "
                        f"contains a '.', write the exact path as a tuple: "
                        f"{(pattern,)!r})"
                    )
            elif isinstance(pattern, tuple):
                if not pattern:
                    raise LayoutError("by_path path () is empty: an exact path names a key")
                segments = pattern
            else:
                raise LayoutError(
                    f"by_path pattern {pattern!r} is not a string (a dotted pattern) or a tuple "
                    f"(an exact path such as {(pattern,)!r})"
                )
            items.append((pattern, segments, rule))
        self.patterns: tuple[tuple[str | tuple[Any, ...], tuple[Any, ...], Any], ...] = tuple(items)
        self.default = default
        # Equal layouts are equal values (rules by value, callables by identity; True is not 1,
        # a tuple path is not a string), so an inline by_path({...}) finds the plan of an equal
        # one written last step.
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


def by_path(patterns: Patterns, default: Any = None) -> ByPath:
    """A layout given as dotted path patterns (or exact tuple paths) mapped to rules.

    A **string** is a dotted pattern: each segment is a dict key, an attribute/field name or an
    index, matched with :mod:`fnmatch` (``*``, ``?``, ``[ab]``), and ``**`` matches any number
    of segments. A segment spelled exactly like a key at its level means that key only
    (``"loss[0]"`` names the key ``'loss[0]'`` when there is one, not ``'loss0'``).

    A **tuple** is an exact path: one item per step, each compared literally with ``==`` to
    the dict key, field name or index (type-aware: ``1`` is not ``'1'`` or ``True``; an index
    may also be written as its decimal string). Use it for keys no dotted pattern can spell,
    such as ``named_parameters()`` names: ``("encoder.layer.0.weight",)``, ``("meta", "[x]")``.

    A pattern may name an inner node: a leaf-wise rule there applies to every leaf below, a
    whole-value rule takes the subtree. When several patterns match, the one with more literal
    segments wins (every step of a tuple path is literal), then the deeper one; an exact tie is
    an error, and so is a pattern that matches nothing (the error lists close paths, written as
    you would type them). Leaves no pattern matches get ``default`` (``None``: the built-in
    default for their type).

    Args:
        patterns: ``{"pattern": rule}`` or ``{("exact", "path"): rule}``; a rule is a rule
            object, an int dim, ``None``, a rule-name string or (for gather) a callable
            ``f(values, device)``.
        default: the rule for unmatched leaves.

    Returns:
        A layout for :func:`scatter`, :func:`scatter_kwargs` or :func:`gather`.

    >>> import torch, treegather as tg
    >>> outs = [{"loss": torch.tensor(1.0), "meta": {"id": 1}},
    ...         {"loss": torch.tensor(2.0), "meta": {"id": 2}}]
    >>> tg.gather(outs, "cpu", tg.by_path({"loss": "mean", "meta.*": "first"}))
    {'loss': tensor(1.5000), 'meta': {'id': 1}}
    >>> grads = [{"encoder.layer.0.weight": torch.ones(2), "step": 1},
    ...          {"encoder.layer.0.weight": torch.ones(2), "step": 1}]
    >>> tg.gather(grads, "cpu", tg.by_path({("encoder.layer.0.weight",): "sum", ("step",): "first"}))
    {'encoder.layer.0.weight': tensor([2., 2.]), 'step': 1}
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
            raise _error(
                f"{where}: {value.describe()} is a {value.phase} rule and cannot be used in {phase}"
            )
        return value
    if value is None:
        return Broadcast() if phase == "scatter" else First()
    if isinstance(value, bool):
        raise _error(f"{where}: {value!r} is not a rule")
    if isinstance(value, int):
        return Split(value) if phase == "scatter" else Cat(value)
    if isinstance(value, str):
        make = SHORTHANDS.get(value)
        if make is None:
            close = difflib.get_close_matches(value, SHORTHANDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _error(f"{where}: unknown rule {value!r}{hint}")
        rule = make(dim)
        if rule.phase != phase:
            raise _error(f"{where}: {value!r} is a {rule.phase} rule, not a {phase} rule")
        return rule
    if callable(value):
        if phase != "gather":
            raise _error(f"{where}: custom callables are gather rules, not scatter rules")
        return Custom(value)
    raise _error(f"{where}: {value!r} is not a rule (expected a rule, int, None or string)")


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
    return _build(spec, layout, phase, dim, root, None)


class RuleSource(NamedTuple):
    """Where the rule of one plan position comes from (see :func:`resolve_sources`)."""

    kind: str
    """``"default"`` (the built-in default for the leaf's type), ``"layout"`` (a single rule
    for every leaf), ``"prefix"`` (a prefix-tree layout), ``"pattern"`` (a :func:`by_path`
    pattern or exact path) or ``"by_path default"``."""
    pattern: str | tuple[Any, ...] | None = None
    """The :func:`by_path` pattern or exact path that matched (``"pattern"`` only)."""
    node: Node | None = None
    """The node the prefix layout put the rule on (``"prefix"`` only)."""


def resolve_sources(
    spec: PyTreeSpec, layout: Any, phase: str, dim: int, root: str | None
) -> tuple[Plan, list[RuleSource]]:
    """:func:`resolve`, and for each position of the plan where its rule came from.

    The plan is the one :func:`resolve` returns (same rules, same groups); the sources are
    only recorded, for :func:`treegather.explain`.

    >>> import optree
    >>> spec = optree.tree_structure({"a": 1, "meta": {"b": 2}})
    >>> plan, sources = resolve_sources(spec, by_path({"meta": "first"}), "gather", 0, "outputs")
    >>> [describe_source(s, "outputs") for s in sources]
    ['default for its type', "by_path pattern 'meta'"]
    """
    found: dict[Any, Any] = {}
    plan = _build(spec, layout, phase, dim, root, found)
    leaf_sources: list[RuleSource] = found["leaves"]
    whole_sources: dict[tuple[Any, ...], RuleSource] = found["whole"]
    sources = []
    for pos, group in enumerate(plan.groups):
        if group is not None:
            sources.append(whole_sources[group[1].raw])
        else:
            sources.append(leaf_sources[plan.node_of(pos).start])
    return plan, sources


def describe_source(source: RuleSource, root: str | None) -> str:
    """Say where a rule came from, as :func:`treegather.explain` shows it.

    >>> describe_source(RuleSource("pattern", ("encoder.weight",)), "inputs")
    "by_path path ('encoder.weight',)"
    """
    if source.kind == "pattern":
        kind = "path" if isinstance(source.pattern, tuple) else "pattern"
        return f"by_path {kind} {source.pattern!r}"
    if source.kind == "prefix" and source.node is not None:
        return f"prefix layout at {display_path(source.node, root)}"
    return {
        "default": "default for its type",
        "layout": "the layout (one rule for every leaf)",
        "by_path default": "by_path default",
    }.get(source.kind, source.kind)


_DEFAULT = RuleSource("default")


def _build(
    spec: PyTreeSpec,
    layout: Any,
    phase: str,
    dim: int,
    root: str | None,
    found: dict[str, Any] | None,
) -> Plan:
    """The plan; with ``found`` (a dict) also record each leaf's and group's rule source."""
    n = spec.num_leaves
    if layout is None:
        if found is not None:
            found["leaves"], found["whole"] = [_DEFAULT] * n, {}
        return Plan(spec, spec, [None] * n, [None] * n, _lazy_leaf_nodes(spec))
    all_nodes = nodes(spec)
    if isinstance(layout, ByPath):
        assigned = _assign_by_path(all_nodes, layout, phase, dim, root)
    else:
        assigned = _assign_prefix(spec, all_nodes, layout, phase, dim, root)
    leaf_rules: list[Rule | None] = [None] * n
    whole: list[tuple[Node, Rule]] = []
    for node, rule, _ in assigned:
        if rule is not None and rule.whole:
            whole.append((node, rule))
        else:
            leaf_rules[node.start : node.stop] = [rule] * (node.stop - node.start)
    if found is not None:
        leaf_sources = [_DEFAULT] * n
        whole_sources = {}
        for node, rule, source in assigned:
            if rule is not None and rule.whole:
                whole_sources[node.raw] = source
            else:
                leaf_sources[node.start : node.stop] = [source] * (node.stop - node.start)
        found["leaves"], found["whole"] = leaf_sources, whole_sources
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
) -> list[tuple[Node, Rule | None, RuleSource]]:
    lleaves, lspec = optree.tree_flatten(layout, none_is_leaf=True, namespace=NAMESPACE)
    if root is None and lspec.is_leaf():
        # One rule for an (args, kwargs) pair applies to each argument: a whole-value rule
        # (split_items) takes each argument whole, never the synthetic pair itself.
        rule = to_rule(lleaves[0], phase, dim, "layout")
        single = RuleSource("layout")
        return [(nd, rule, single) for nd in all_nodes if len(nd.path) == 2]
    skeleton = spec.unflatten(range(spec.num_leaves))
    try:
        lspec.flatten_up_to(skeleton)
    except (ValueError, TypeError) as exc:
        problems = _prefix_problems(layout, spec, root) or [str(exc)]
        name = "(args, kwargs)" if root is None else root
        raise _error(
            f"the layout is not a prefix of the structure of {name}:\n"
            + bullet_list(
                problems if len(problems) > 1 else [f"  - {problems[0]}"],
                "a prefix-tree layout mirrors the data's containers down to where it puts a rule "
                "(every key of a dict, every item of a list); use by_path({...}) for a partial "
                "layout",
            )
        ) from None
    by_raw = {nd.raw: nd for nd in all_nodes}
    out: list[tuple[Node, Rule | None, RuleSource]] = []
    for path, value in zip(lspec.paths(), lleaves):
        node = by_raw[tuple(path)]
        rule = to_rule(value, phase, dim, f"layout at {display_path(node, root)}")
        out.append(
            (node, rule, RuleSource("layout") if not path else RuleSource("prefix", None, node))
        )
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


class _Level(NamedTuple):
    """One step of a node's path, as by_path patterns see it."""

    names: tuple[str, ...]
    """How a dotted pattern spells the step: the entry's text (and the raw index's, if other)."""
    keys: tuple[Any, ...]
    """The values an exact (tuple) path compares with: the entry and the raw optree entry."""
    is_index: bool
    """A sequence index: an exact path may also write it as its decimal string."""
    siblings: frozenset[str]
    """The names of every child of the parent: a segment equal to one is taken literally."""


def _levels(all_nodes: list[Node], root: str | None) -> list[tuple[Node, tuple[_Level, ...]]]:
    """Every candidate node (root excluded) with its path's levels, in pre-order."""
    children: dict[tuple[Any, ...], set[str]] = {}
    own: dict[tuple[Any, ...], tuple[tuple[str, ...], tuple[Any, ...], bool]] = {}
    for nd in all_nodes:
        if not nd.raw:
            continue
        (entry, style), raw = nd.path[-1], nd.raw[-1]
        names: tuple[str, ...] = (str(entry),) if str(entry) == str(raw) else (str(entry), str(raw))
        keys = (entry,) if type(entry) is type(raw) and entry == raw else (entry, raw)
        index = style == "index" and isinstance(entry, int) and not isinstance(entry, bool)
        own[nd.raw] = (names, keys, index)
        children.setdefault(nd.raw[:-1], set()).update(names)
    frozen = {raw: frozenset(names) for raw, names in children.items()}
    made: dict[tuple[Any, ...], tuple[_Level, ...]] = {(): ()}
    out = []
    for nd in all_nodes:
        if not nd.raw:
            continue
        names, keys, index = own[nd.raw]
        levels: tuple[_Level, ...] = (
            *made[nd.raw[:-1]],
            _Level(names, keys, index, frozen[nd.raw[:-1]]),
        )
        made[nd.raw] = levels
        if root is None:
            if len(levels) < 2:
                continue
            levels = levels[1:]
        out.append((nd, levels))
    return out


def _step(head: str, level: _Level) -> int | None:
    """1: the segment names the step literally; 0: as a wildcard; None: no match."""
    if head in level.names:
        return 1
    if not any(c in head for c in _SPECIALS):
        return None
    if head in level.siblings:  # spelled exactly like a sibling's key: that key only
        return None
    return 0 if any(fnmatch.fnmatchcase(s, head) for s in level.names) else None


def _match(pattern: tuple[str, ...], levels: tuple[_Level, ...]) -> int | None:
    """How many segments of a dotted pattern matched literally (the best way), None: no match."""
    if not pattern:
        return 0 if not levels else None
    head = pattern[0]
    if head == "**":
        counts = [_match(pattern[1:], levels[i:]) for i in range(len(levels) + 1)]
        hits = [c for c in counts if c is not None]
        return max(hits) if hits else None
    if not levels:
        return None
    here = _step(head, levels[0])
    if here is None:
        return None
    rest = _match(pattern[1:], levels[1:])
    return None if rest is None else here + rest


def _same(segment: Any, key: Any) -> bool:
    """``segment == key`` with types that count: ``1`` is not ``'1'``, ``True`` or ``1.0``."""
    if type(segment) is not type(key):
        kinds = (bool, int, float, complex, str, bytes)
        a = next((k for k in kinds if isinstance(segment, k)), None)
        b = next((k for k in kinds if isinstance(key, k)), None)
        if a is not b:
            return False
    try:
        return bool(segment == key)
    except Exception:  # an exotic key whose == raises or is ambiguous: not this one
        return False


def _match_exact(path: tuple[Any, ...], levels: tuple[_Level, ...]) -> bool:
    if len(path) != len(levels):
        return False
    for segment, level in zip(path, levels):
        if any(_same(segment, key) for key in level.keys):
            continue
        if level.is_index and isinstance(segment, str) and segment == level.names[0]:
            continue
        return False
    return True


def _spellable(name: str) -> bool:
    """Whether a dotted pattern segment can name this step without matching others."""
    return bool(name) and name != "**" and "." not in name and not any(c in name for c in "*?[]")


def writable_path(node: Node, root: str | None) -> str:
    """How to write ``node``'s path in :func:`by_path`: dotted when it can be, else a tuple.

    >>> import optree
    >>> from treegather._tree import nodes
    >>> [writable_path(n, "x") for n in nodes(optree.tree_structure({"a.b": 1, "c": [2]}))[1:]]
    ["('a.b',)", 'c', 'c.0']
    """
    steps = node.path[1:] if root is None else node.path
    if all(_spellable(str(entry)) for entry, _ in steps):
        return ".".join(str(entry) for entry, _ in steps)
    return repr(tuple(entry for entry, _ in steps))


def _score(
    pattern: str | tuple[Any, ...], segments: tuple[Any, ...], literal: int
) -> tuple[int, int]:
    if isinstance(pattern, tuple):
        return len(segments), len(segments)
    return literal, sum(1 for s in segments if s != "**")


def _close_paths(
    pattern: str | tuple[Any, ...], seg_of: list[tuple[Node, tuple[_Level, ...]]], root: str | None
) -> list[str]:
    """Up to three paths close to ``pattern``, each written as by_path would take it."""
    typed = pattern if isinstance(pattern, str) else ".".join(str(s) for s in pattern)
    spelled: dict[str, list[Node]] = {}
    for nd, levels in seg_of:
        spelled.setdefault(".".join(lv.names[0] for lv in levels), []).append(nd)
    out: list[str] = []
    for close in difflib.get_close_matches(typed, list(spelled), n=3, cutoff=0.5):
        for nd in spelled[close]:
            text = writable_path(nd, root)
            if text not in out and text != pattern:
                out.append(text)
    return out[:3]


def _assign_by_path(
    all_nodes: list[Node], layout: ByPath, phase: str, dim: int, root: str | None
) -> list[tuple[Node, Rule | None, RuleSource]]:
    seg_of = _levels(all_nodes, root)
    problems: list[str] = []
    matches: list[tuple[tuple[int, int], str | tuple[Any, ...], Node, Rule | None]] = []
    for pattern, pat_segs, value in layout.patterns:
        if isinstance(pattern, tuple):
            hit = [(nd, len(pat_segs)) for nd, levels in seg_of if _match_exact(pat_segs, levels)]
        else:
            found = [(nd, _match(pat_segs, levels)) for nd, levels in seg_of]
            hit = [(nd, c) for nd, c in found if c is not None]
        if not hit:
            close = _close_paths(pattern, seg_of, root)
            hint = f"; close paths: {', '.join(close)}" if close else ""
            kind = "path" if isinstance(pattern, tuple) else "pattern"
            problems.append(f"by_path {kind} {pattern!r} matches nothing{hint}")
            continue
        rule = to_rule(value, phase, dim, f"by_path pattern {pattern!r}")
        matches.extend((_score(pattern, pat_segs, c), pattern, nd, rule) for nd, c in hit)
    if problems:
        raise _error(
            bullet_list(
                problems,
                "patterns are dotted paths from the root: "
                "'loss', 'meta.*', 'hidden.0', '**.logits'; a tuple is an exact path, for keys "
                "with a '.', '*', '?' or '[' in them: ('encoder.layer.0.weight',)",
            )
        )
    if layout.default is None:
        default, default_source = None, _DEFAULT
    else:
        default = to_rule(layout.default, phase, dim, "by_path default")
        default_source = RuleSource("by_path default")
    # Per leaf: the best match among the nodes on its path.
    n = all_nodes[0].stop if all_nodes else 0
    best: list[tuple[tuple[int, int], str | tuple[Any, ...], Node, Rule | None] | None] = [None] * n
    ties: dict[int, list[str | tuple[Any, ...]]] = {}
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
        raise _error(bullet_list(problems, "make one pattern more specific"))
    out: list[tuple[Node, Rule | None, RuleSource]] = []
    seen_groups: set[int] = set()
    for i in range(n):
        cur = best[i]
        if cur is None:
            out.append((leaf_nodes[i], default, default_source))
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
                raise _error(
                    f"{rule.describe()} on {where} (pattern {pattern!r}) takes the subtree whole, "
                    + (
                        f"but pattern {other[1]!r} sets a rule inside it"
                        if other
                        else "but part of it is matched elsewhere"
                    )
                )
            seen_groups.add(id(node))
            out.append((node, rule, RuleSource("pattern", pattern)))
        else:
            out.append((leaf_nodes[i], rule, RuleSource("pattern", pattern)))
    # Whole-value rules on empty nodes (None, {}) still apply: as_list on None gives [None, ...].
    for _, pattern, node, rule in matches:
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
                out.append((node, rule, RuleSource("pattern", pattern)))
    return out
