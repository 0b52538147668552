"""Stage 4 of a :mod:`treegather.distributed` call: every rank's tree, combined by the rules.

The ranks are the replicas of the single-process :func:`treegather.gather` (replica ``i`` is
group rank ``i``), so the rules and their errors are defined once. With ``sync_grads`` every
rank's leaves that require grad are first made outputs of one autograd function
(:mod:`~treegather.distributed.grads`); without it, a backward through the result says to pass
it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._errors import TreegatherError
from .._gather import gather as _gather_local
from .._rules import AsList
from . import grads
from .errors import rank_note
from .group import Group
from .payload import Local
from .place import _NONE, Placed, trees

__all__ = ["combine", "rules"]


def combine(
    g: Group,
    placed: Placed,
    local: Local,
    layout: Any,
    dim: int,
    sync: bool,
    public: bool,
) -> Any:
    """The result of a call: ``placed``'s result, or every rank's tree combined by ``layout``.
    ``public``: an :func:`~treegather.distributed.all_gather` of the user's (whose result says
    to pass ``sync_grads`` when a backward reaches it without)."""
    if placed.result is not _NONE:
        out = placed.result
    else:
        if sync:  # (the leaves that require grad: in every rank's header, or the shared plan's)
            headers = placed.trees[1]
            positions = (
                [local.plan.grads or () for _ in g.ranks]  # type: ignore[union-attr]
                if headers is None
                else [h["grads"] or () for h in headers]
            )
            own = [local.leaves[i] for i in positions[g.rank]]
            # (which tensors of a value laid out by rows require grad: each rank's header says)
            parts = [{} for _ in g.ranks] if headers is None else [h["parts"] for h in headers]
            grads.connect(placed.leaves, positions, own, g.rank, g.handle, g.device, parts)
        per_rank = trees(placed)
        if type(layout) is AsList:  # (the trees untouched, as the rule returns them)
            return per_rank
        out = rules(g.ranks, per_rank, placed.target, layout, dim, placed.sizes)
    if public and not sync:
        return grads.unsynced(out, local.leaves, None)
    return out


def rules(
    ranks: Sequence[int], trees: list[Any], device: Any, layout: Any, dim: int, sizes: Any
) -> Any:
    """The single-process gather rules over the per-rank trees (replica i = group rank i)."""
    try:
        return _gather_local(trees, device, layout, dim=dim, sizes=sizes)
    except TreegatherError as exc:
        raise type(exc)(f"{exc}\n{rank_note(ranks)}") from None
