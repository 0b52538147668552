"""gather's combine step: each position of a plan combined across replicas by its rule.

What a rule does is its class's (:mod:`treegather._rules`); this is the loop over a plan's
positions: the default rules leaf by leaf (tensors: ``cat``, others: ``as_list``), the layout's
rules, and the whole-value rules last (a custom callable may have side effects, so it runs only
once every leaf-wise rule has succeeded). Bad data raises plain errors here;
:func:`treegather._mismatch.diagnose` then names the paths.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch

from ._errors import TreegatherError
from ._layout import Plan, display_path
from ._rules import JOIN_ROWS, LEAF_AS_LIST, ROOT, Combining, GatherRule
from ._rules.leafwise import cat_values, one_dtype
from ._tree import rows_of

__all__ = ["Inputs", "combine_default", "combine_planned", "needs_move"]

Tensor = torch.Tensor
Inputs = tuple[tuple[tuple[Any, ...], dict[str, Any]], ...]
"""Each replica's call, ``(args, kwargs)``, for the rules that read the inputs."""


def needs_move(columns: list[tuple[Any, ...]], target: torch.device) -> bool:
    """Whether any replica's tensors live off ``target`` (sampled: the first tensor position).

    Only a hint for the fast path: a leaf elsewhere is still moved, just less cheaply (and a
    meta tensor elsewhere still found: moving it raises, and ``gather`` names its path).
    """
    for column in columns:
        if any(type(v) is Tensor or isinstance(v, Tensor) for v in column):
            return any(isinstance(v, Tensor) and v.device != target for v in column)
    return False


def combine_default(
    columns: Iterable[tuple[Any, ...]],
    target: torch.device,
    moving: bool,
    dim: int,
) -> list[Any]:
    """The default rules leaf by leaf: ``cat(dim)`` for tensors, ``as_list()`` for the rest.

    The same as each position's :func:`treegather._rules.default_rule` combining it, in one
    loop that tries ``torch.cat`` first. Every result is checked to be on ``target``:
    ``torch.cat`` of a column wholly on another device (a GPU, or the meta device even on a
    CPU-only machine) stays there, and moving it there raises for a meta tensor (``gather``
    then names the path).
    """
    if moving:
        return [
            cat_values(col, target, True, dim)
            if isinstance(col[0], Tensor)
            else _other(col, target)
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
                append(cat_values(col, target, False, dim))
            else:
                append(_other(col, target))
            continue
        one_dtype(col)  # torch.cat promoted mixed dtypes: refuse them
        if (not r.is_cpu) if cpu else (r.get_device() != index):
            r = r.to(target)
        append(r)
    return out


_NO_CONTEXT = Combining(torch.device("cpu"), False, None, 0)  # (as_list needs none)


def _other(col: tuple[Any, ...], target: torch.device) -> Any:
    """The default rule of a leaf that is not a tensor: its rows joined for a value laid out by
    rows (a ``PackedSequence``, a PyG graph batch), else ``as_list()``."""
    if rows_of(col[0]) is not None:
        return JOIN_ROWS.combine(col, _NO_CONTEXT._replace(target=target))
    return LEAF_AS_LIST.combine(col, _NO_CONTEXT)


def combine_planned(
    plan: Plan,
    columns: Iterable[tuple[Any, ...]],
    target: torch.device,
    moving: bool,
    sizes: tuple[int, ...] | None,
    dim: int,
    inputs: Inputs | None = None,
) -> list[Any]:
    """Every position combined by the plan's rule (the default where it has none); ``inputs``
    are the replicas' calls, when the gather follows them (``mean(weight=f)`` reads them)."""
    ctx = Combining(target, moving, sizes, dim, None, inputs)
    out: list[Any] = []
    deferred = []
    for pos, col in enumerate(columns):
        group = plan.groups[pos]
        if group is not None:
            deferred.append((pos, group, col))
            out.append(None)
            continue
        rule = plan.rules[pos]
        if rule is None:
            out.extend(combine_default([col], target, moving, dim))
            continue
        try:
            out.append(cast(GatherRule, rule).combine(col, ctx))
        except TreegatherError as exc:  # a leaf rule's own typed error: say where
            located = type(exc)(f"{display_path(plan.node_of(pos), ROOT)}: {exc}")
            raise located from exc.__cause__  # (mean(weight=f): what f raised)
    for pos, (_, node, whole), col in deferred:
        out[pos] = cast(GatherRule, whole).combine(col, ctx._replace(node=node))
    return out
