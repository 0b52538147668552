"""Plans: a layout resolved for one structure, once, into what each leaf gets.

:func:`resolve` turns (structure, layout) into an immutable :class:`Plan`: which rule each leaf
gets, and which subtrees a whole-value rule takes as one; :func:`resolve_sources` also says where
each rule came from (for :func:`treegather.explain`). The plain definition: nothing is cached
here; the compiled layer (:mod:`treegather._compiled`) keeps plans per structure, keyed by
:func:`layout_key`, so that equal layouts (an inline ``by_path({...})`` each step) share one plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from optree import PyTreeSpec

from .._caches import typed_key
from .._rules import Rule
from .._tree import Node, alike, display_path, flatten, leaf_nodes, nodes
from .by_path import ByPath, RuleSource, assign_by_path, path_text
from .prefix import assign_prefix

__all__ = ["Plan", "describe_source", "layout_key", "rebase", "resolve", "resolve_sources"]


_AUTO: Any = object()


class Plan:
    """What to do with each leaf of one structure under one layout."""

    __slots__ = ("_lists", "default_only", "groups", "node_of", "rules", "spec", "up_spec")

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
        self._lists: tuple[tuple[int, int, int], ...] | None = None

    def lists(self) -> tuple[tuple[int, int, int], ...]:
        """``(start, stop, length)`` of every ``list`` node of :attr:`up_spec` (not a tuple, nor
        a list subclass) of two or more items that share one structure and hold a leaf, every
        position of which takes the default rule: the lists that may hold one item per sample
        (:mod:`treegather._misplaced`). Found once per plan, by one walk of the structure.

        >>> import optree
        >>> spec = optree.tree_structure({"a": [1, 2], "b": (3, 4), "c": [5, [6]]})
        >>> resolve(spec, None, "gather", 0, "outputs").lists()
        ((0, 2, 2),)
        >>> resolve(spec, {"a": "sum", "b": None, "c": None}, "gather", 0, "outputs").lists()
        ()
        """
        if self._lists is None:
            self._lists = _default_lists(self)
        return self._lists


def _default_lists(plan: Plan) -> tuple[tuple[int, int, int], ...]:
    """:meth:`Plan.lists`, by one :meth:`~optree.PyTreeSpec.walk` (each node's value: its
    structure, compared between a list's items, and its first and last leaf)."""
    spec = plan.up_spec
    found: list[tuple[int, int, int]] = []

    def node(kind: type, data: Any, children: Any) -> tuple[Any, int, int]:
        kids = [(None, c, c + 1) if type(c) is int else c for c in children]
        starts = [c[1] for c in kids if c[1] >= 0]
        start = starts[0] if starts else -1
        stop = max((c[2] for c in kids if c[1] >= 0), default=-1)
        if kind is list and len(kids) > 1 and start >= 0 and alike([c[0] for c in kids]):
            found.append((start, stop, len(kids)))
        return (kind, data, tuple(c[0] for c in kids)), start, stop

    spec.walk(range(spec.num_leaves), node, None)
    if not found:
        return ()
    rules, groups = plan.rules, plan.groups
    return tuple(
        sorted(
            (a, b, n)
            for a, b, n in found
            if all(rules[p] is None and groups[p] is None for p in range(a, b))
        )
    )


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


def resolve_sources(
    spec: PyTreeSpec,
    layout: Any,
    phase: str,
    dim: int,
    root: str | None,
    unmatched: list[Any] | None = None,
) -> tuple[Plan, list[RuleSource]]:
    """:func:`resolve`, and for each position of the plan where its rule came from.

    The plan is the one :func:`resolve` returns (same rules, same groups); the sources are
    only recorded, for :func:`treegather.explain`. ``unmatched``, when given, receives the
    :func:`by_path` layout's optional patterns that match nothing in ``spec``.

    >>> import optree
    >>> spec = optree.tree_structure({"a": 1, "meta": {"b": 2}})
    >>> from treegather import by_path
    >>> plan, sources = resolve_sources(spec, by_path({"meta": "first"}), "gather", 0, "outputs")
    >>> [describe_source(s, "outputs") for s in sources]
    ['default for its type', "by_path pattern 'meta'"]
    """
    found: dict[Any, Any] = {}
    plan = _build(spec, layout, phase, dim, root, found)
    if unmatched is not None:
        unmatched.extend(found.get("unmatched") or ())
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
        shown = f"by_path {kind} {path_text(source.pattern)}"
        return shown + (" (optional)" if source.optional else "")
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
        unmatched: list[Any] | None = None if found is None else []
        assigned = assign_by_path(all_nodes, layout, phase, dim, root, unmatched)
        if found is not None:
            found["unmatched"] = unmatched
    else:
        assigned = assign_prefix(spec, all_nodes, layout, phase, dim, root)
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


def rebase(plan: Plan, spec: PyTreeSpec) -> Plan:
    """``plan`` for ``spec``: a structure equal to ``plan.spec`` whose dict keys and node metadata
    are other objects (another call's). The same rules; trees are rebuilt, and messages name
    paths, from ``spec``. Only for a plan without whole-value groups (``up_spec is spec``).

    >>> import optree
    >>> old, new = optree.tree_structure({"a": 1}), optree.tree_structure({"a": 2})
    >>> rebase(resolve(old, None, "gather", 0, "outputs"), new).up_spec is new
    True
    """
    if plan.up_spec is not plan.spec:
        raise ValueError("rebase: a plan with whole-value groups is resolved again instead")
    return Plan(spec, spec, plan.rules, plan.groups, _lazy_leaf_nodes(spec))


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
    up_leaves, up_spec = flatten(skeleton)  # (noted when it holds a batch node)
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
