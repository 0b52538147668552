"""explain: what a layout does to every leaf of a tree, shown before any data is moved.

:func:`explain` resolves the layout with the same resolver scatter and gather use
(:func:`treegather._layout.resolve_sources`, which also says *why* each leaf got its rule),
classifies each scatter position with scatter's own first pass (nothing is split or moved), and
works out the per-device sizes and gathered shapes arithmetically. The rows it returns, and
their rendering, are :mod:`.table`'s; the text of each cell comes from :mod:`.text`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from .._devices import DeviceLike, as_devices
from .._errors import BatchSizeError, LayoutError, LeafTypeError, safe_repr
from .._layout import EXPLAIN_POINTER, Plan, RuleSource, display_path
from .._layout import resolve_sources as _resolve_sources
from .._rules import SPLIT_ROWS, Cut, GatherRule, Problem, ScatterRule, Split, default_rule
from .._scatter import _shard_sizes, _validate, call_tree, survey
from .._tree import flatten, rows_of
from .table import ExplainedLeaf, Explanation
from .text import _strip, _value_text, _why

__all__ = ["explain"]

Tensor = torch.Tensor
_ROOTS = {"scatter": "inputs", "gather": "outputs"}


def explain(
    tree: Any,
    layout: Any = None,
    devices: Sequence[DeviceLike] | DeviceLike | None = None,
    way: str = "scatter",
    *,
    dim: int = 0,
    module_kwargs: Mapping[str, Any] | None = None,
) -> Explanation:
    """Show, leaf by leaf, what ``layout`` does to ``tree``, without moving or splitting anything.

    Each row gives the leaf's path as you would type it, its type/shape/dtype, the rule that
    applies (defaults spelled out) and why: the default for its type, a single rule, a
    prefix-tree layout (and at which node), or which :func:`by_path` pattern or exact path
    matched. For ``way="scatter"`` with ``devices`` it also gives what each device would get
    and the shard sizes, and lists the problems :func:`scatter` would raise. For
    ``way="gather"``, ``tree`` is one replica's output (the others are taken to be alike) and
    each row says what the leaf becomes; ``devices`` (the replicas' devices) sets how many
    replicas there are, else the sizes are written in terms of ``k``.

    A layout that does not fit the tree raises the :class:`LayoutError` scatter or gather
    would; everything else is reported in the result, not raised. An ``optional``
    :func:`by_path` pattern that matches nothing is listed under the table.

    For a :func:`data_parallel` call, ``explain(batch, in_layout, devices)`` shows what its
    ``in_layout`` does to a single input ``batch`` (the paths start at it in both). With
    keyword arguments, pass ``tree`` and ``module_kwargs`` as :func:`data_parallel` takes them
    (``inputs``: a tuple is the positional arguments, ``args[0]['ids']``; anything else the
    single input, ``inputs['ids']``; the keywords are ``kwargs['labels']``), which also shows
    :func:`scatter_kwargs` (a tuple of positional arguments) and ``DataParallel`` calls.

    Args:
        tree: for scatter the input tree, for gather one replica's output tree.
        layout: a rule, a prefix tree of rules, or :func:`by_path` patterns.
        devices: scatter: the devices to split over; gather: the replicas' devices.
        way: ``"scatter"`` or ``"gather"``.
        dim: the call's ``dim``.
        module_kwargs: scatter only: the call's keyword arguments; ``tree`` is then the
            call's ``inputs`` (``{}`` for a call without keyword arguments).

    Returns:
        An :class:`Explanation`: a table when printed, a sequence of :class:`ExplainedLeaf`.

    Raises:
        LayoutError: the layout does not fit the tree.
        ValueError: ``way`` is neither ``"scatter"`` nor ``"gather"``.

    >>> import torch, treegather as tg
    >>> batch = {"x": torch.zeros(10, 4), "ids": list("abcdefghij"), "lr": 0.1}
    >>> tg.explain(batch, tg.by_path({"ids": tg.split_items()}), ["cpu"] * 4)
    scatter over 4 devices (cpu x4): shard sizes (3, 3, 2, 2)
    path           value                  rule           why                             per device
    -------------  ---------------------  -------------  ------------------------------  ------------------------------------------
    inputs['ids']  list of 10 item(s)     split_items()  by_path pattern 'ids'           3 item(s), 3 item(s), 2 item(s), 2 item(s)
    inputs['lr']   float 0.1              broadcast()    default for float               whole x4
    inputs['x']    Tensor(10, 4) float32  split()        default for a Tensor with dims  (3, 4), (3, 4), (2, 4), (2, 4)
    >>> outs = {"loss": torch.tensor(0.5), "logits": torch.zeros(4, 3), "tag": "t"}
    >>> print(tg.explain(outs, {"loss": "mean", "logits": 0, "tag": None}, ["cpu"] * 2, "gather"))
    gather of 2 replica(s) shaped like this one
    path               value                 rule     why                                 result
    -----------------  --------------------  -------  ----------------------------------  ------------------------------------------------
    outputs['logits']  Tensor(4, 3) float32  cat()    prefix layout at outputs['logits']  Tensor(8, 3) float32 (if every replica is alike)
    outputs['loss']    Tensor() float32      mean()   prefix layout at outputs['loss']    Tensor() float32 (weighted by sizes when given)
    outputs['tag']     str 't'               first()  prefix layout at outputs['tag']     replica 0's value
    """
    if way not in _ROOTS:
        raise ValueError(f"explain(way={safe_repr(way)}): way is 'scatter' or 'gather'")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"explain(dim={safe_repr(dim)}): dim is an int")
    devs = None if devices is None else as_devices(devices)
    root: str | None = _ROOTS[way]
    if module_kwargs is not None:
        if way != "scatter":
            raise ValueError("explain(module_kwargs=...) explains a call's scatter: way='scatter'")
        tree, root = call_tree(tree, module_kwargs)
    leaves, spec = flatten(tree, root)
    unmatched: list[Any] = []
    try:
        plan, sources = _resolve_sources(spec, layout, way, dim, root, unmatched)
    except LayoutError as exc:  # the pointer to explain would point here
        text = str(exc)
        if text.endswith("\n" + EXPLAIN_POINTER):
            raise LayoutError(text[: -len(EXPLAIN_POINTER) - 1]) from None
        raise
    up = leaves if plan.up_spec is plan.spec else plan.up_spec.flatten_up_to(tree)
    if way == "scatter":
        found = _explain_scatter(up, plan, sources, devs, dim, root)
    else:
        found = _explain_gather(up, plan, sources, devs, dim, "outputs")
    if unmatched:
        notes = tuple(
            f"by_path {'path' if isinstance(p, tuple) else 'pattern'} {p!r} (optional) matches "
            "nothing here"
            for p in unmatched
        )
        found = dataclasses.replace(found, notes=notes)
    return found


# ---------------------------------------------------------------------------------- scatter


def _explain_scatter(
    up: list[Any],
    plan: Plan,
    sources: list[RuleSource],
    devs: tuple[torch.device, ...] | None,
    dim: int,
    root: str | None,
) -> Explanation:
    targets = devs if devs is not None else (torch.device("cpu"),)
    cuts, found = survey(up, plan, dim, targets)
    problems: list[str | None] = [p.text if isinstance(p, Problem) else None for p in found]
    if cuts.lengths:
        for pos, cut in enumerate(found):
            if isinstance(cut, Cut) and cut.kind == "array":
                problems[pos] = (
                    "would be sent whole to every device while the batch is split; convert it "
                    "with torch.as_tensor or mark it broadcast()"
                )
    error = None
    try:
        _validate(up, plan, dim, root, targets)
    except (BatchSizeError, LeafTypeError) as exc:
        error = f"{type(exc).__name__}: {_strip(str(exc))}"
    sizes = None
    if error is None and devs is not None:
        try:
            sizes = _shard_sizes(cuts, len(devs))
        except BatchSizeError as exc:
            error = f"{type(exc).__name__}: {_strip(str(exc))}"
    if len(cuts.lengths) > 1:
        common = max(cuts.lengths.items(), key=lambda kv: len(kv[1]))[0]
        for n, positions in cuts.lengths.items():
            if n != common:
                for p in positions:
                    problems[p] = problems[p] or (
                        f"batch size {n}, where the other split leaves have {common}"
                    )
    # Shards made: one per size, or one per device when nothing is split.
    k = None if devs is None else (len(devs) if sizes is None else len(sizes))
    rows = []
    for pos, (x, cut) in enumerate(zip(up, found)):
        group = plan.groups[pos]
        rule = group[2] if group is not None else plan.rules[pos]
        shown = rule.describe() if rule is not None else _default_name(x, dim)
        per_device: tuple[str, ...] | None = None
        if isinstance(cut, Cut) and cut.kind in ("split", "items"):
            if rule is not None:
                shows: Any = rule
            else:
                shows = SPLIT_ROWS if rows_of(x) is not None else Split(cut.dim)
            result, per_device = cast(ScatterRule, shows).explain(x, cut, sizes)
        elif problems[pos] is not None:
            result = "fails (see problems)"
        else:
            result = "whole, to every device"
            if k is not None and error is None:
                per_device = ("whole",) * k
        rows.append(
            ExplainedLeaf(
                display_path(plan.node_of(pos), root),
                _value_text(x, group is not None),
                shown,
                _why(sources[pos], x, root),
                result,
                per_device,
                problems[pos],
            )
        )
    return Explanation("scatter", tuple(rows), devs, sizes, error)


def _default_name(x: Any, dim: int) -> str:
    if rows_of(x) is not None:
        return SPLIT_ROWS.describe()
    if isinstance(x, Tensor) and x.dim() > 0:
        return "split()" if dim == 0 else f"split(dim={dim})"
    return "broadcast()"


# ----------------------------------------------------------------------------------- gather


def _explain_gather(
    up: list[Any],
    plan: Plan,
    sources: list[RuleSource],
    devs: tuple[torch.device, ...] | None,
    dim: int,
    root: str,
) -> Explanation:
    k: int | None = None if devs is None else len(devs)
    rows = []
    for pos, x in enumerate(up):
        group = plan.groups[pos]
        rule = group[2] if group is not None else plan.rules[pos]
        if rule is None:
            rule = default_rule(x, dim)[0]
        result, problem = cast(GatherRule, rule).becomes(x, k)
        rows.append(
            ExplainedLeaf(
                display_path(plan.node_of(pos), root),
                _value_text(x, group is not None),
                rule.describe(),
                _why(sources[pos], x, root),
                result,
                None,
                problem,
            )
        )
    return Explanation("gather", tuple(rows), devs)
