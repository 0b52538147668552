"""The result of a :mod:`treegather.distributed` call, from every rank's received bytes.

:func:`fast` reads the ranks' wire-plan payloads (:mod:`treegather._dist_payload`): vectorised
for the default rules, else each rank's tree rebuilt from views of the bytes; :func:`full`
rebuilds each rank's tree from its header and bytes (:mod:`treegather._wire`). Anything but the
vectorised case then goes through :func:`rules`, the single-process :func:`treegather.gather`
with the ranks as replicas, so the rules and their errors are defined once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from treegather import _dist_group, _dist_payload, _wire, _wireplan
from treegather._dist_preamble import HEADER
from treegather._errors import TreegatherError
from treegather._gather import gather as _gather_local

__all__ = ["fast", "full", "rules"]


def fast(
    ranks: Sequence[int],
    local: _wireplan.Local,
    payloads: _dist_payload.Payloads,
    nbytes: list[int],
    carrier: torch.device,
    layout: Any,
    dim: int,
) -> Any:
    """Combine the ranks' payloads: vectorised for the default rules, else the rules as usual."""
    plan = local.plan
    target = _dist_group.target(local.devices, carrier)
    received = _dist_payload.parse(plan, payloads, nbytes, target)
    spec = plan.spec if local.spec is None else local.spec  # this call's dict keys, statics
    if plan.vectorised:
        return _dist_payload.unpack(plan, received, spec)
    trees = [spec.unflatten(leaves) for leaves in _dist_payload.rank_leaves(plan, received)]
    sizes: list[Any] = received.sizes if received.sizes is not None else [None]
    return rules(ranks, trees, target, layout, dim, sizes)


def full(
    ranks: Sequence[int],
    headers: list[dict[str, Any]],
    buffers: Sequence[torch.Tensor],
    rows: Sequence[Sequence[int]],
    local: _wire.Packed,
    carrier: torch.device,
    layout: Any,
    dim: int,
) -> Any:
    """Every rank's tree from its header and bytes (checked already), combined by the rules."""
    up_spec = _wire.agreed_up_spec(headers, local)
    trees = [
        _wire.rank_tree(up_spec, h, _wire.decode(h, buf[_wire.padded(r[HEADER]) :]))
        for h, buf, r in zip(headers, buffers, rows)
    ]
    target = _dist_group.target(local.devices, carrier)
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
        if list(ranks) == list(range(len(ranks))):
            note = "(replica i above is rank i)"
        else:
            note = f"(replica i above is the group's rank i, global ranks {list(ranks)})"
        raise type(exc)(f"{exc}\n{note}") from None
