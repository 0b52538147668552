"""by_path layouts: dotted fnmatch patterns and exact tuple paths, matched against a structure.

``by_path({"meta.*": "as_list", ("encoder.layer.0.weight",): "sum"})``: a string is a dotted
pattern (segments matched with fnmatch, ``**`` for any depth, a segment spelled exactly like a
key means that key); a tuple is an exact path, each item compared with ``==`` and by type. The
match with more literal segments wins; a tie is an error, and so is a pattern matching nothing.
:func:`assign_by_path` gives each node of a structure its rule and where it came from.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from .._caches import typed_key
from .._errors import ArgumentTypeError, LayoutError, bullet_list, layout_error, safe_repr
from .._rules import Rule, foreign_rule, is_foreign, to_rule
from .._tree import INPUT_AND_KWARGS, Node, display_path, is_call_root

__all__ = [
    "PATTERN_LIMIT",
    "ByPath",
    "by_path",
    "Patterns",
    "RuleSource",
    "assign_by_path",
    "path_text",
    "writable_path",
]

PATTERN_LIMIT = 200
"""The most characters of one pattern or path a message shows (a tuple path holds keys)."""


_SPECIALS = "*?["

Patterns = Mapping[str, Any] | Mapping[tuple[Any, ...], Any] | Mapping[str | tuple[Any, ...], Any]
"""What :func:`by_path` takes: dotted patterns and/or exact tuple paths, mapped to rules."""

Pattern = str | tuple[Any, ...]
"""One key of :data:`Patterns`: a dotted pattern or an exact tuple path."""


class ByPath:
    """A layout written as path patterns and exact paths; build it with :func:`by_path`.

    Immutable and compared by value: two ``by_path`` layouts with equal patterns, rules and
    default are equal (``True`` is not ``1``; a tuple path is not the dotted string that spells
    the same path), so an inline ``by_path({...})`` written each step shares one cached plan.
    """

    __slots__ = ("_key", "_optional_at", "default", "optional", "patterns")

    def __init__(
        self, patterns: Patterns, default: Any = None, optional: Iterable[Pattern] = ()
    ) -> None:
        if not isinstance(patterns, Mapping):
            raise TypeError(
                f"by_path expects a mapping of patterns to rules, got {safe_repr(patterns)}"
            )
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
                shown = safe_repr(pattern)
                raise LayoutError(
                    f"by_path pattern {shown} is not a string (a dotted pattern) or a tuple "
                    f"(an exact path such as ({shown},))"
                )
            if is_foreign(rule):  # refused at once (also where an optional one matches nothing)
                raise layout_error(foreign_rule(rule, "", f"by_path pattern {path_text(pattern)}"))
            items.append((pattern, segments, rule))
        if is_foreign(default):
            raise layout_error(foreign_rule(default, "", "by_path default"))
        self.patterns: tuple[tuple[str | tuple[Any, ...], tuple[Any, ...], Any], ...] = tuple(items)
        self.default = default
        at = _optional_flags([p for p, _, _ in items], optional)
        self._optional_at: tuple[bool, ...] = at
        self.optional: tuple[Pattern, ...] = tuple(p for (p, _, _), o in zip(items, at) if o)
        # Equal layouts are equal values (rules by value, callables by identity; True is not 1,
        # a tuple path is not a string), so an inline by_path({...}) finds the plan of an equal
        # one written last step.
        self._key = typed_key((tuple((p, r, o) for (p, _, r), o in zip(items, at)), default))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByPath) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self, "_key"):
            raise AttributeError("a by_path layout is immutable; build a new one")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        inner = ", ".join(f"{path_text(p)}: {safe_repr(r, None)}" for p, _, r in self.patterns)
        optional = f", optional={safe_repr(self.optional, None)}" if self.optional else ""
        return f"by_path({{{inner}}}, default={safe_repr(self.default, None)}{optional})"


def _optional_flags(patterns: list[Pattern], optional: Iterable[Pattern]) -> tuple[bool, ...]:
    """Per pattern, whether ``optional`` names it (type-aware: ``(1,)`` is not ``(True,)``)."""
    if isinstance(optional, (str, bytes)) or not isinstance(optional, Iterable):
        raise ArgumentTypeError(
            f"by_path(optional={safe_repr(optional)}): optional is a collection of the layout's patterns, "
            f"such as optional=('loss',)"
        )
    keys = [typed_key(p) for p in patterns]
    flags = [False] * len(patterns)
    unknown = []
    for entry in optional:
        key = typed_key(entry)
        if key in keys:
            flags[keys.index(key)] = True
        else:
            unknown.append(entry)
    if unknown:
        raise LayoutError(
            f"by_path optional names {', '.join(map(path_text, unknown))}, which "
            f"{'is' if len(unknown) == 1 else 'are'} not among the layout's patterns "
            f"({', '.join(map(path_text, patterns)) or 'none'}); optional lists patterns exactly as "
            "written in the mapping (a dotted string, or an exact path as a tuple)"
        )
    return tuple(flags)


def by_path(patterns: Patterns, default: Any = None, *, optional: Iterable[Pattern] = ()) -> ByPath:
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
    you would type them), unless ``optional`` lists it: a layout written for a training step
    (``{"loss": tg.mean()}``) can then be reused for a call whose output has no loss. Leaves no
    pattern matches get ``default`` (``None``: the built-in default for their type).

    Args:
        patterns: ``{"pattern": rule}`` or ``{("exact", "path"): rule}``; a rule is a rule
            object, an int dim, ``None``, a rule-name string or (for gather) a callable
            ``f(values, device)``.
        default: the rule for unmatched leaves.
        optional: patterns (keys of ``patterns``, written exactly as there: ``("loss",)`` is
            the pattern ``'loss'``, ``[("loss",)]`` the exact path) that may match nothing.

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
    >>> train = tg.by_path({"loss": "mean", "logits": 0}, optional=("loss",))
    >>> tg.gather([{"logits": torch.ones(1, 2)}, {"logits": torch.zeros(1, 2)}], "cpu", train)
    {'logits': tensor([[1., 1.],
            [0., 0.]])}
    """
    return ByPath(patterns, default, optional)


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
    optional: bool = False
    """The pattern is one of the layout's ``optional`` ones (``"pattern"`` only)."""


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
        name, raw_name = _name(entry), _name(raw)
        names: tuple[str, ...] = (name,) if name == raw_name else (name, raw_name)
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
        if is_call_root(root):
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
    steps = node.path[1:] if is_call_root(root) else node.path
    names = [_name(entry) for entry, _ in steps]
    if all(map(_spellable, names)):
        return ".".join(names)
    return path_text(tuple(entry for entry, _ in steps))


def _name(entry: Any) -> str:
    """How a dotted pattern spells one step: the entry's ``str`` (never raising)."""
    return entry if type(entry) is str else safe_repr(entry, None, text=str)


def path_text(pattern: Any) -> str:
    """A pattern or exact path as a message shows it: its repr, each key's never raising and
    each cut to :data:`PATTERN_LIMIT` characters."""
    if not isinstance(pattern, tuple):
        return safe_repr(pattern, PATTERN_LIMIT)
    items = [safe_repr(p, PATTERN_LIMIT) for p in pattern]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


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
    typed = pattern if isinstance(pattern, str) else ".".join(map(_name, pattern))
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


def _two_meanings(
    pattern: Pattern, segments: tuple[Any, ...], hit: list[tuple[Node, Any]], root: str
) -> str | None:
    """For an ``(input, kwargs)`` pair: a pattern whose first step names a key literally in
    both the input and the keyword arguments could mean either; say which paths it reaches.

    (A wildcard first step, ``'*'`` or ``'**.logits'``, means both on purpose.)
    """
    head = segments[0]
    if isinstance(pattern, str) and (head == "**" or any(c in head for c in _SPECIALS)):
        return None
    sides: dict[Any, str] = {}
    for nd, _ in hit:
        sides.setdefault(nd.raw[0], display_path(nd, root))
    if len(sides) < 2:
        return None
    return f"{sides[0]} or {sides[1]}"


Match = tuple[tuple[int, int], "str | tuple[Any, ...]", Node, "Rule | None"]
"""One pattern's hit on one node: (score, pattern, node, rule)."""


def assign_by_path(
    all_nodes: list[Node],
    layout: ByPath,
    phase: str,
    dim: int,
    root: str | None,
    unmatched: list[Pattern] | None = None,
) -> list[tuple[Node, Rule | None, RuleSource]]:
    """Each leaf's (or whole-value node's) rule under ``layout``, and where it came from.

    ``unmatched``, when given, receives the optional patterns that match nothing here.
    """
    matches, optional_hit = _matches(all_nodes, layout, phase, dim, root, unmatched)
    if layout.default is None:
        default, default_source = None, RuleSource("default")
    else:
        default = to_rule(layout.default, phase, dim, "by_path default")
        default_source = RuleSource("by_path default")
    leaf_nodes = [nd for nd in all_nodes if nd.spec.is_leaf()]
    best = _best_per_leaf(matches, all_nodes[0].stop if all_nodes else 0, leaf_nodes, root)

    def source(pattern: Pattern) -> RuleSource:
        optional = bool(optional_hit) and typed_key(pattern) in optional_hit
        return RuleSource("pattern", pattern, None, optional)

    out: list[tuple[Node, Rule | None, RuleSource]] = []
    seen_groups: set[int] = set()
    for i, cur in enumerate(best):
        if cur is None:
            out.append((leaf_nodes[i], default, default_source))
            continue
        _, pattern, node, rule = cur
        if rule is None or not rule.whole:
            out.append((leaf_nodes[i], rule, source(pattern)))
        elif id(node) not in seen_groups:
            _check_whole(node, rule, pattern, best, root)
            seen_groups.add(id(node))
            out.append((node, rule, source(pattern)))
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
                out.append((node, rule, source(pattern)))
    return out


def _matches(
    all_nodes: list[Node],
    layout: ByPath,
    phase: str,
    dim: int,
    root: str | None,
    unmatched: list[Pattern] | None,
) -> tuple[list[Match], set[Any]]:
    """Every pattern's hits (a pattern matching nothing, or two things, is an error), and the
    optional patterns that matched."""
    seg_of = _levels(all_nodes, root)
    problems: list[str] = []
    two_ways = 0
    optional_hit: set[Any] = set()
    matches: list[Match] = []
    for (pattern, pat_segs, value), optional in zip(layout.patterns, layout._optional_at):
        if isinstance(pattern, tuple):
            hit = [(nd, len(pat_segs)) for nd, levels in seg_of if _match_exact(pat_segs, levels)]
        else:
            found = [(nd, _match(pat_segs, levels)) for nd, levels in seg_of]
            hit = [(nd, c) for nd, c in found if c is not None]
        kind = "path" if isinstance(pattern, tuple) else "pattern"
        if not hit:
            if optional:
                if unmatched is not None:
                    unmatched.append(pattern)
                continue
            close = _close_paths(pattern, seg_of, root)
            hint = f"; close paths: {', '.join(close)}" if close else ""
            problems.append(f"by_path {kind} {path_text(pattern)} matches nothing{hint}")
            continue
        if root == INPUT_AND_KWARGS:
            meanings = _two_meanings(pattern, pat_segs, hit, root)
            if meanings:
                two_ways += 1
                problems.append(f"by_path {kind} {path_text(pattern)} could mean {meanings}")
                continue
        rule = to_rule(value, phase, dim, f"by_path pattern {path_text(pattern)}")
        matches.extend((_score(pattern, pat_segs, c), pattern, nd, rule) for nd, c in hit)
        if optional:
            optional_hit.add(typed_key(pattern))
    if problems:
        hints = []
        if len(problems) > two_ways:
            hints.append(
                "patterns are dotted paths from the root: "
                "'loss', 'meta.*', 'hidden.0', '**.logits'; a tuple is an exact path, for keys "
                "with a '.', '*', '?' or '[' in them: ('encoder.layer.0.weight',)"
            )
        if two_ways:
            hints.append(
                "with a single input, paths start at it and at the names of module_kwargs; pass "
                "the input as a tuple, data_parallel(fn, (batch,), ...), to write '0.name' for "
                "the input's key and 'name' for the keyword argument"
            )
        raise layout_error(bullet_list(problems, "; ".join(hints)))
    return matches, optional_hit


def _best_per_leaf(
    matches: list[Match], n: int, leaf_nodes: list[Node], root: str | None
) -> list[Match | None]:
    """Per leaf, the best match among the nodes on its path (an exact tie is an error)."""
    best: list[Match | None] = [None] * n
    ties: dict[int, list[str | tuple[Any, ...]]] = {}
    for match in sorted(matches, key=lambda m: m[0], reverse=True):
        score, pattern, node, _ = match
        for i in range(node.start, node.stop):
            cur = best[i]
            if cur is None:
                best[i] = match
            elif cur[0] == score and cur[1] != pattern:
                ties.setdefault(i, [cur[1]]).append(pattern)
    if ties:
        problems = [
            f"{display_path(leaf_nodes[i], root)} is matched equally well by "
            + " and ".join(path_text(p) for p in dict.fromkeys(pats))
            for i, pats in sorted(ties.items())
        ]
        raise layout_error(bullet_list(problems, "make one pattern more specific"))
    return best


def _check_whole(
    node: Node, rule: Rule, pattern: Pattern, best: list[Match | None], root: str | None
) -> None:
    """A whole-value rule takes its node whole: no other pattern may set a rule inside it."""
    inside = [best[j] for j in range(node.start, node.stop)]
    stray = [m for m in inside if m is None or m[2] is not node]
    if not stray:
        return
    other = next(m for m in stray if m is not None) if any(stray) else None
    where = display_path(node, root)
    raise layout_error(
        f"{rule.describe()} on {where} (pattern {path_text(pattern)}) takes the subtree whole, "
        + (
            f"but pattern {path_text(other[1])} sets a rule inside it"
            if other
            else "but part of it is matched elsewhere"
        )
    )
