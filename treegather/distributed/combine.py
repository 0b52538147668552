"""The result of a :mod:`treegather.distributed` call, from every rank's received bytes.

:func:`fast` reads the ranks' wire-plan payloads (:mod:`~treegather.distributed.payload`):
vectorised for the default rules, else each rank's tree rebuilt from views of the bytes;
:func:`full` rebuilds each rank's tree from its header and bytes
(:mod:`~treegather.distributed.wire`). Anything but the vectorised case then goes through :func:`rules`, the single-process :func:`treegather.gather`
with the ranks as replicas, so the rules and their errors are defined once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import _tree
from .._errors import TreegatherError
from .._gather import gather as _gather_local
from .._rules import AsList
from . import payload, wire
from .errors import rank_note
from .grads import connect as _connect_grads
from .group import Group
from .group import target as _target
from .plan import Local
from .preamble import HEADER

__all__ = ["fast", "full", "rules"]


def fast(
    g: Group,
    local: Local,
    payloads: payload.Payloads,
    nbytes: list[int],
    carrier: torch.device,
    layout: Any,
    dim: int,
) -> Any:
    """Combine the ranks' payloads: vectorised for the default rules, else the rules as usual."""
    ranks = g.ranks
    plan = local.plan
    target = _target(local.devices, carrier)
    received = payload.parse(plan, payloads, nbytes, target)
    spec = plan.spec if local.spec is None else local.spec  # this call's dict keys, statics
    if plan.vectorised:
        return payload.unpack(plan, received, spec)
    per_rank = payload.rank_leaves(plan, received)
    if plan.grads:  # sync_grads: the same positions on every rank (the digest says so)
        own = [local.leaves[i] for i in plan.grads]
        _connect_grads(per_rank, [plan.grads] * len(ranks), own, g.rank, g.handle, g.device)
    trees = [spec.unflatten(leaves) for leaves in per_rank]
    if type(layout) is AsList:  # (the trees untouched, as the rule returns them)
        return trees
    sizes: list[Any] = received.sizes if received.sizes is not None else [None]
    return rules(ranks, trees, target, layout, dim, sizes)


def full(
    g: Group,
    headers: list[dict[str, Any]],
    buffers: Sequence[torch.Tensor],
    rows: Sequence[Sequence[int]],
    local: wire.Packed,
    carrier: torch.device,
    layout: Any,
    dim: int,
    tree: Any = None,
) -> Any:
    """Every rank's tree from its header and bytes (checked already), combined by the rules.

    ``tree`` is this rank's own tree (for ``sync_grads``: its leaves that require grad).
    """
    ranks = g.ranks
    up_spec = wire.agreed_up_spec(headers, local)
    per_rank = [
        wire.decode(h, buf[wire.padded(r[HEADER]) :]) for h, buf, r in zip(headers, buffers, rows)
    ]
    for h, leaves in zip(headers, per_rank):
        wire.place_held(h, leaves)
    grads = [h.get("grads") or () for h in headers]
    if any(grads):
        leaves = _tree.flatten(tree)[0]
        own = [leaves[i] for i in grads[g.rank]]
        parts = [h.get("parts") or {} for h in headers]
        _connect_grads(per_rank, grads, own, g.rank, g.handle, g.device, parts)
    trees = [wire.rank_tree(up_spec, h, leaves) for h, leaves in zip(headers, per_rank)]
    target = _target(local.devices, carrier)
    return rules(ranks, trees, target, layout, dim, [h["sizes"] for h in headers])


def rules(
    ranks: Sequence[int],
    trees: list[Any],
    device: torch.device,
    layout: Any,
    dim: int,
    sizes: list[Any],
) -> Any:
    """Apply the single-process gather rules to the per-rank trees (replica i = group rank i)."""
    try:
        return _gather_local(
            trees, device, layout, dim=dim, sizes=None if sizes[0] is None else sizes
        )
    except TreegatherError as exc:
        raise type(exc)(f"{exc}\n{rank_note(ranks)}") from None
