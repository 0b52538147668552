"""Prefix-tree layouts (the vmap/pmap convention): a tree of rules that mirrors the data's
containers down to where it puts a rule.

:func:`assign_prefix` gives each node the layout names its rule and where it came from; when
the layout is not a prefix of the data, the error lists every place where it departs from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import optree
from optree import PyTreeSpec

from .._errors import bullet_list, layout_error, safe_repr
from .._rules import Rule, to_rule
from .._tree import INPUT_AND_KWARGS, NAMESPACE, Node, child_styles, display_path
from .by_path import RuleSource

__all__ = ["assign_prefix"]


def assign_prefix(
    spec: PyTreeSpec,
    all_nodes: list[Node],
    layout: Any,
    phase: str,
    dim: int,
    root: str | None,
) -> list[tuple[Node, Rule | None, RuleSource]]:
    lleaves, lspec = optree.tree_flatten(layout, none_is_leaf=True, namespace=NAMESPACE)
    single_input = root == INPUT_AND_KWARGS
    if lspec.is_leaf() and (root is None or single_input):
        # One rule for an (args, kwargs) pair applies to each argument: a whole-value rule
        # (split_items) takes each argument whole, never the synthetic pair itself. With a
        # single input, the rule is that input's, as in scatter(input, devices, rule).
        rule = to_rule(lleaves[0], phase, dim, "layout")
        single = RuleSource("layout")
        return [
            (nd, rule, single)
            for nd in all_nodes
            if len(nd.path) == 2 or (single_input and nd.raw == (0,))
        ]
    # With a single input (data_parallel(fn, batch)), a prefix layout is the input's, as in
    # scatter(batch, devices, layout); its keyword arguments keep their default rules.
    target, above = (spec.children()[0], (0,)) if single_input else (spec, ())
    skeleton = target.unflatten(range(target.num_leaves))
    try:
        lspec.flatten_up_to(skeleton)
    except Exception as exc:  # (optree's message reprs the tree: a key's repr may raise there)
        problems = _prefix_problems(layout, target, "inputs" if single_input else root) or [
            safe_repr(str(exc), None, text=str)
        ]
        name = "(args, kwargs)" if root is None else "inputs" if single_input else root
        hint = (
            "a prefix-tree layout mirrors the data's containers down to where it puts a rule "
            "(every key of a dict, every item of a list); use by_path({...}) for a partial "
            "layout"
        )
        if single_input:
            hint += (
                "; with a single input the layout starts at it (for a layout of "
                "(args, kwargs), pass the input as a tuple: data_parallel(fn, (batch,), ...))"
            )
        raise layout_error(
            f"the layout is not a prefix of the structure of {name}:\n"
            + bullet_list(problems if len(problems) > 1 else [f"  - {problems[0]}"], hint)
        ) from None
    by_raw = {nd.raw: nd for nd in all_nodes}
    out: list[tuple[Node, Rule | None, RuleSource]] = []
    for path, value in zip(lspec.paths(), lleaves):
        node = by_raw[(*above, *path)]
        rule = to_rule(value, phase, dim, f"layout at {display_path(node, root)}")
        out.append(
            (node, rule, RuleSource("layout") if not path else RuleSource("prefix", None, node))
        )
    return out


def _prefix_problems(layout: Any, spec: PyTreeSpec, root: str | None) -> list[str]:
    """Where a prefix-tree layout departs from the data's structure, as the user would read it.

    Iterative (a stack of pending nodes, in pre-order): a layout as deep as the data is fine.
    """
    problems: list[str] = []

    def is_rule(x: Any) -> bool:
        return optree.tree_structure(x, none_is_leaf=True, namespace=NAMESPACE).is_leaf()

    def name(t: Any) -> str:
        return "None" if t is type(None) else f"a {t.__qualname__}"

    Pending = tuple[Any, PyTreeSpec, tuple[tuple[Any, str], ...], tuple[Any, ...]]
    stack: list[Pending] = [(layout, spec, (), ())]
    while stack and len(problems) < 20:
        lay, node, path, raw = stack.pop()
        if is_rule(lay):
            continue
        where = display_path(Node(path, raw, 0, 0, node), root)
        if node.is_leaf():
            problems.append(f"{where}: the layout has {name(type(lay))} where the data has a leaf")
            continue
        if type(lay) is not node.type:
            problems.append(
                f"{where}: the layout has {name(type(lay))} where the data has {name(node.type)}"
            )
            continue
        children, _, entries, _ = optree.tree_flatten_one_level(
            cast(Any, lay), none_is_leaf=True, namespace=NAMESPACE
        )
        data_entries = list(node.entries())
        styled = dict(zip(data_entries, child_styles(node)))
        below: list[Pending] = []
        if list(entries) != data_entries:
            if isinstance(lay, Mapping):
                common = [k for k in entries if k in data_entries]
                lacks = [k for k in data_entries if k not in entries]
                extra = [k for k in entries if k not in data_entries]
                parts = []
                if lacks:
                    parts.append(f"lacks key(s) {', '.join(map(safe_repr, lacks))}")
                if extra:
                    parts.append(f"has key(s) {', '.join(map(safe_repr, extra))} the data does not")
                problems.append(f"{where}: the layout {' and '.join(parts)}")
                below = [
                    (
                        lay[key],
                        node.children()[data_entries.index(key)],
                        (*path, styled[key]),
                        (*raw, key),
                    )
                    for key in common
                ]
            else:
                problems.append(
                    f"{where}: the layout has {len(entries)} item(s) where the data has "
                    f"{len(data_entries)}"
                )
        else:
            below = [
                (child_lay, child, (*path, styled[entry]), (*raw, entry))
                for entry, child_lay, child in zip(entries, children, node.children())
            ]
        stack.extend(reversed(below))
    return problems
