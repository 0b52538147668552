"""Stage 3 of a :mod:`treegather.distributed` call: what arrived, checked and read.

Every rank's payload (:mod:`~treegather.distributed.describe` lays it out) is read with its
plan: the one every rank shares when the digests agreed, else the rank's own, from its header,
once the headers say the trees can be combined (:func:`~treegather.distributed.errors.
check_headers`). Under the default rules a shared plan's payloads become the result here,
vectorised: each region's rows reordered from rank-major to leaf-major with one
``index_select`` and split once into the result leaves (large leaves one ``torch.cat`` each);
otherwise each rank's leaves are views of the received bytes, for the rules to combine.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from optree import PyTreeSpec

from .. import _tree
from .._errors import TreegatherError
from .._layout import resolve
from . import errors
from .describe import ROOT
from .exchange import Arrived, tensor_bytes
from .group import receiving_device
from .payload import Geometry, Local, Plan, geometry, plan_from_header, rank_leaves, unpack

__all__ = ["Placed", "place", "sent", "trees"]

_NONE: Any = object()


class Placed(NamedTuple):
    """What the rules combine: each rank's leaves, or the result already (``result``)."""

    result: Any  # the combined tree under the default rules, or _NONE
    leaves: list[list[Any]]  # per rank, in leaf order (tensors as views of the bytes)
    trees: Any  # how each rank's tree is rebuilt from its leaves (see :func:`trees`)
    sizes: list[int] | None
    target: torch.device


def place(
    ranks: Sequence[int],
    arrived: Arrived,
    local: Local,
    target: torch.device,
    layout: Any,
    dim: int,
) -> Placed:
    """Check what arrived (the same error on every rank) and read every rank's payload."""
    headers = arrived.headers
    if headers is not None:
        errors.check_headers(ranks, headers)
        plans = [plan_from_header(h) for h in headers]
    else:
        assert local.plan is not None
        plans = [local.plan] * len(ranks)
    shared = headers is None
    where = geometry(plans, arrived.buf, arrived.offsets, arrived.nbytes, arrived.heads, shared)
    objects: list[list[Any]] = [[] for _ in plans]
    for r, (plan, (a, b)) in enumerate(zip(plans, where.blobs)):
        if plan.objects:
            objects[r] = pickle.loads(tensor_bytes(arrived.buf[a:b]))
    spec = local.spec
    assert spec is not None
    up_spec = spec
    if headers is not None:  # (the slow way: the layout resolved again for this structure)
        up_spec = _agreed_up_spec(headers, resolve(spec, layout, "gather", dim, ROOT).up_spec)
        sizes = _sizes_shown(plans, where)
        errors.check_leaves(ranks, headers, where.rows, objects, sizes, spec, up_spec, layout, dim)
    buf = arrived.buf if arrived.buf.device == target else arrived.buf.to(target)
    plan = plans[0]
    if headers is None and plan.vectorised:
        return Placed(unpack(plan, where, buf, objects, spec), [], None, None, target)
    leaves = [rank_leaves(p, where, r, buf, objects[r]) for r, p in enumerate(plans)]
    for h, rank in zip(headers or (), leaves):
        _place_held(h, rank)
    trees = (spec, None) if headers is None else (up_spec, headers)
    return Placed(_NONE, leaves, trees, where.sizes, target)


def sent(arrived: Arrived, src: int) -> Any:
    """``broadcast``'s tree, from rank ``src``'s header and payload: tensors on this rank's
    device of the kind they were on there (its current one), else the CPU."""
    header = arrived.headers[0]  # type: ignore[index]
    if "error" in header:
        name, message = header["error"]
        raise errors.ERROR_CLASSES.get(name, TreegatherError)(f"on rank {src}: {message}")
    plan = plan_from_header(header)
    where = geometry([plan], arrived.buf, arrived.offsets, arrived.nbytes)
    a, b = where.blobs[0]
    objects = pickle.loads(tensor_bytes(arrived.buf[a:b])) if plan.objects else []
    leaves = rank_leaves(plan, where, 0, arrived.buf, objects)
    for i, kind in enumerate(header["devices"]):
        if kind is not None and i not in header["held"]:
            leaves[i] = leaves[i].to(receiving_device(kind), copy=True)
    _place_held(header, leaves)
    return header["spec"].unflatten(leaves)


def _place_held(header: dict[str, Any], leaves: list[Any]) -> None:
    """The tensors that travelled pickled (rebuilt on the CPU) on this rank's device of the
    kind the sender's were on (in place); meta tensors stay meta."""
    for i, (_, kind) in (header.get("held") or {}).items():
        if kind not in ("cpu", "meta"):
            leaves[i] = leaves[i].to(receiving_device(kind))


def trees(placed: Placed) -> list[Any]:
    """Each rank's tree from its leaves: the shared structure, or (the headers travelled) the
    agreed up-structure with each rank's own whole nodes and batch sizes."""
    spec, headers = placed.trees
    if headers is None:
        return [spec.unflatten(leaves) for leaves in placed.leaves]
    return [_rank_tree(spec, h, leaves) for h, leaves in zip(headers, placed.leaves)]


def _sizes_shown(plans: list[Plan], where: Geometry) -> list[int | None]:
    if where.sizes is None:
        return [None] * len(plans)
    return [s if p.sizes_given else None for s, p in zip(where.sizes, plans)]


def _agreed_up_spec(headers: Sequence[dict[str, Any]], mine: PyTreeSpec) -> PyTreeSpec:
    """The up-structure every rank rebuilds with: rank 0's (its dict key order), else this
    rank's own. Called once the fingerprints agree: they differ at most in key order."""
    order = headers[0].get("order")
    if order is None:
        return mine
    try:
        found = pickle.loads(order)
        same = isinstance(found, PyTreeSpec) and found == mine
    except Exception:  # metadata that does not unpickle or compare to a bool
        return mine
    return found if same else mine


def _rank_tree(up_spec: PyTreeSpec, header: dict[str, Any], leaves: list[Any]) -> Any:
    """One rank's tree from its leaves: the shared up-structure (with the rank's own batch
    sizes), the rank's own whole nodes."""
    groups = header["groups"]
    if groups:
        leaves = _up_leaves(up_spec, groups, leaves)
    batch = header.get("batch")
    if batch:
        return _tree.rebuild(up_spec, leaves, dict(enumerate(batch)), "outputs")
    return up_spec.unflatten(leaves)


def _up_leaves(up_spec: PyTreeSpec, groups: dict[int, PyTreeSpec], leaves: list[Any]) -> list[Any]:
    """A rank's leaves of the up-structure: its own whole nodes rebuilt from their leaves."""
    up: list[Any] = []
    k = 0
    for pos in range(up_spec.num_leaves):
        sub = groups.get(pos)
        if sub is None:
            up.append(leaves[k])
            k += 1
        else:
            up.append(sub.unflatten(leaves[k : k + sub.num_leaves]))
            k += sub.num_leaves
    return up


# ------------------------------------------------------------------- the default rules
