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
from .._caches import LRU
from .._errors import TreegatherError
from .._layout import resolve
from . import errors
from .describe import INT64, ROOT, Local, Plan, Region, padded, plan_from_header
from .exchange import Arrived, tensor_bytes
from .group import receiving_device

__all__ = ["Placed", "place", "sent", "trees"]

_INDEXED_MIN = 32  # leaves per region from which the result rows are gathered with one index
_OWN_STORAGE = 1 << 18  # bytes per result leaf from which each leaf gets its own tensor
_NONE: Any = object()
# Per plan digest: where every rank's values were in the last call's buffer (see _geometry).
_GEOMETRIES: LRU[Any, Geometry] = LRU("distributed.payload_geometries", maxsize=64, trees=False)


class Geometry(NamedTuple):
    """Where every rank's values are in the buffer: a function of the heads and offsets.

    A steady loop receives the same heads call after call, so the last geometry of each shared
    plan is kept with the row permutations computed for it.
    """

    heads: list[list[int]]
    offsets: list[int]
    nbytes: list[int]
    rows: list[list[int]]  # per rank: the rows of each row-bearing leaf
    sizes: list[int] | None
    starts: list[list[int]]  # per rank, per region of its plan: where its values start
    spans: list[list[int]]  # per rank, per region: their bytes
    blobs: list[tuple[int, int]]  # per rank: where its pickled objects are
    # (region, aligned) -> the row index and each result leaf's rows (see _gather_rows).
    orders: dict[tuple[int, bool], tuple[torch.Tensor, list[int]]]


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
    geometry = _geometry(plans, arrived)
    objects: list[list[Any]] = [[] for _ in plans]
    for r, (plan, (a, b)) in enumerate(zip(plans, geometry.blobs)):
        if plan.objects:
            objects[r] = pickle.loads(tensor_bytes(arrived.buf[a:b]))
    spec = local.spec
    assert spec is not None
    up_spec = spec
    if headers is not None:  # (the slow way: the layout resolved again for this structure)
        up_spec = _agreed_up_spec(headers, resolve(spec, layout, "gather", dim, ROOT).up_spec)
        sizes = _sizes_shown(plans, geometry)
        errors.check_leaves(
            ranks, headers, geometry.rows, objects, sizes, spec, up_spec, layout, dim
        )
    buf = arrived.buf if arrived.buf.device == target else arrived.buf.to(target)
    plan = plans[0]
    if headers is None and plan.vectorised:
        return Placed(_unpack(plan, geometry, buf, objects, spec), [], None, None, target)
    leaves = [_rank_leaves(p, geometry, r, buf, objects[r]) for r, p in enumerate(plans)]
    trees = (spec, None) if headers is None else (up_spec, headers)
    return Placed(_NONE, leaves, trees, geometry.sizes, target)


def sent(arrived: Arrived, src: int) -> Any:
    """``broadcast``'s tree, from rank ``src``'s header and payload: tensors on this rank's
    device of the kind they were on there (its current one), else the CPU."""
    header = arrived.headers[0]  # type: ignore[index]
    if "error" in header:
        name, message = header["error"]
        raise errors.ERROR_CLASSES.get(name, TreegatherError)(f"on rank {src}: {message}")
    plan = plan_from_header(header)
    geometry = _geometry([plan], arrived)
    a, b = geometry.blobs[0]
    objects = pickle.loads(tensor_bytes(arrived.buf[a:b])) if plan.objects else []
    leaves = _rank_leaves(plan, geometry, 0, arrived.buf, objects)
    for i, kind in enumerate(header["devices"]):
        if kind is not None:
            leaves[i] = leaves[i].to(receiving_device(kind), copy=True)
    return header["spec"].unflatten(leaves)


def trees(placed: Placed) -> list[Any]:
    """Each rank's tree from its leaves: the shared structure, or (the headers travelled) the
    agreed up-structure with each rank's own whole nodes and batch sizes."""
    spec, headers = placed.trees
    if headers is None:
        return [spec.unflatten(leaves) for leaves in placed.leaves]
    return [_rank_tree(spec, h, leaves) for h, leaves in zip(headers, placed.leaves)]


def _sizes_shown(plans: list[Plan], geometry: Geometry) -> list[int | None]:
    if geometry.sizes is None:
        return [None] * len(plans)
    return [s if p.sizes_given else None for s, p in zip(geometry.sizes, plans)]


def _geometry(plans: list[Plan], arrived: Arrived) -> Geometry:
    """Where every rank's values are; raises on every rank if one could not pack its tree. The
    shared plan's last geometry when the heads are the same."""
    shared = arrived.headers is None
    nbytes = arrived.nbytes
    heads = arrived.heads
    if heads is None:
        buf = arrived.buf
        heads = [
            buf[at : at + INT64 * p.head_ints].view(torch.int64).tolist()
            for at, p in zip(arrived.offsets, plans)
        ]
    last = _GEOMETRIES.get(plans[0].digest) if shared else None
    if (
        last is not None
        and last.heads == heads
        and last.offsets == arrived.offsets
        and last.nbytes == nbytes
    ):
        return last
    if any(head[0] for head in heads):
        failed = [r for r, head in enumerate(heads) if head[0]]
        raise TreegatherError(
            f"group rank(s) {', '.join(map(str, failed))} could not pack their tree for "
            "treegather.distributed (see the traceback there); no result on any rank"
        )
    rows = [head[1 : 1 + len(p.row_positions)] for head, p in zip(heads, plans)]
    given = any(p.sizes_given for p in plans)
    sizes = [
        head[1 + len(p.row_positions)] if p.sizes_given else 0 for head, p in zip(heads, plans)
    ]
    starts, spans, blobs = [], [], []
    for r, (plan, at) in enumerate(zip(plans, arrived.offsets)):
        span = [
            len(reg.positions) * reg.row_bytes
            if reg.trailing is None
            else sum(rows[r][reg.rows]) * reg.row_bytes
            for reg in plan.regions
        ]
        at += plan.head_bytes
        start = []
        for n in span:
            start.append(at)
            at += padded(n)
        starts.append(start)
        spans.append(span)
        blobs.append((at, arrived.offsets[r] + nbytes[r]))
    found = Geometry(
        heads, arrived.offsets, nbytes, rows, sizes if given else None, starts, spans, blobs, {}
    )
    if shared:
        _GEOMETRIES.put(plans[0].digest, found)
    return found


def _values(
    geometry: Geometry, buf: torch.Tensor, r: int, j: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rank ``r``'s values of region ``j``, flat (a view of ``buf``)."""
    start = geometry.starts[r][j]
    return buf[start : start + geometry.spans[r][j]].view(dtype)


def _rank_leaves(
    plan: Plan, geometry: Geometry, r: int, buf: torch.Tensor, objects: list[Any]
) -> list[Any]:
    """Rank ``r``'s leaves (tensors as views of the received bytes), in leaf order."""
    leaves: list[Any] = [None] * (len(plan.objects) + sum(len(g.positions) for g in plan.regions))
    for pos, obj in zip(plan.objects, objects):
        leaves[pos] = obj
    for j, region in enumerate(plan.regions):
        flat = _values(geometry, buf, r, j, region.dtype)
        if region.trailing is None:
            parts: Sequence[torch.Tensor] = flat.unbind()
        else:
            rows = geometry.rows[r][region.rows]
            parts = flat.view(sum(rows), *region.trailing).split_with_sizes(rows)
        for pos, part in zip(region.positions, parts):
            leaves[pos] = part
    return leaves


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


def _unpack(
    plan: Plan, geometry: Geometry, buf: torch.Tensor, objects: list[list[Any]], spec: PyTreeSpec
) -> Any:
    """The combined tree under the default rules: one copy per region (or per large leaf).

    Leaf ``i`` of a region is rank 0's rows of it, then rank 1's, and so on (0-dim leaves: a
    vector with one entry per rank). Non-tensor leaves become the list of rank values.
    """
    world = len(objects)
    placed: list[Any] = []  # the regions' leaves in region order, then the objects
    for j, region in enumerate(plan.regions):
        if region.trailing is None:
            per_rank = [_values(geometry, buf, r, j, region.dtype) for r in range(world)]
            placed += torch.stack(per_rank, 1).unbind()
        else:
            placed += _region_results(j, region, geometry, buf)
    placed += ([objs[j] for objs in objects] for j in range(len(plan.objects)))
    leaves = placed if plan.order is None else [placed[k] for k in plan.order]
    return spec.unflatten(leaves)


def _region_results(
    j: int, region: Region, geometry: Geometry, buf: torch.Tensor
) -> Sequence[torch.Tensor]:
    """Region ``j``'s result leaves, each every rank's rows of it in rank order."""
    assert region.trailing is not None
    spans = [span[j] for span in geometry.spans]
    if sum(spans) >= _OWN_STORAGE * len(region.positions):
        # Large leaves: one tensor each (one copy), not views of one large block; a block of
        # tens of MiB is mapped fresh, and page-faulted, on every call.
        return list(map(torch.cat, zip(*_pieces(j, region, geometry, buf))))
    rows = [rank_rows[region.rows] for rank_rows in geometry.rows]
    aligned = all(start[j] % region.row_bytes == 0 for start in geometry.starts)
    if len(rows) > 1 and (aligned or len(region.positions) >= _INDEXED_MIN):
        return _gather_rows(j, region, geometry, buf, rows, aligned)
    merged = torch.cat([p for column in zip(*_pieces(j, region, geometry, buf)) for p in column])
    return merged.unsafe_split_with_sizes(list(map(sum, zip(*rows))))


def _pieces(
    j: int, region: Region, geometry: Geometry, buf: torch.Tensor
) -> list[tuple[torch.Tensor, ...]]:
    """Per rank, one view per leaf of its values of region ``j``."""
    assert region.trailing is not None
    out = []
    for r, rows in enumerate(geometry.rows):
        rs = rows[region.rows]
        flat = _values(geometry, buf, r, j, region.dtype)
        out.append(flat.view(sum(rs), *region.trailing).unsafe_split_with_sizes(rs))
    return out


def _gather_rows(
    j: int,
    region: Region,
    geometry: Geometry,
    buf: torch.Tensor,
    rows: list[list[int]],
    aligned: bool,
) -> Sequence[torch.Tensor]:
    """Rank-major rows reordered leaf-major with one ``index_select``, split into the leaves.

    Splitting every rank's values into one view per leaf costs about a microsecond per view;
    the permutation is a few vectorised ops whatever the number of leaves. When every rank's
    values start at a multiple of the row size (``aligned``), the rows are selected straight
    from the received buffer; otherwise from a copy of the ranks' values side by side.
    """
    assert region.trailing is not None
    row_bytes = region.row_bytes
    if aligned:
        n = buf.numel() // row_bytes
        source = buf.view(region.dtype)[: n * (row_bytes // region.dtype.itemsize)]
        source = source.view(n, *region.trailing)
    else:
        per_rank = [_values(geometry, buf, r, j, region.dtype) for r in range(len(rows))]
        source = torch.cat([flat.view(-1, *region.trailing) for flat in per_rank])
    order = geometry.orders.get((j, aligned))
    if order is None:
        if aligned:
            base = [start[j] // row_bytes for start in geometry.starts]
        else:
            base = [0]
            for rank_rows in rows[:-1]:
                base.append(base[-1] + sum(rank_rows))
        order = geometry.orders[(j, aligned)] = _permutation(rows, base)
    index, totals = order
    if index.device != source.device:
        index = index.to(source.device)
    # The result leaves are disjoint pieces of one new tensor that nothing else holds:
    # ``unsafe_split`` makes them without autograd's view records (a quarter cheaper per leaf).
    return source.index_select(0, index).unsafe_split_with_sizes(totals)


def _permutation(rows: list[list[int]], base: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Rows of leaf ``l`` of rank ``r`` start at ``base[r] + (rows of leaves < l on r)``: the
    rows in leaf-major order (leaf 0 of every rank, then leaf 1, ...) as an index, and each
    leaf's rows over all ranks.

    >>> index, totals = _permutation([[2, 1], [1, 1]], [0, 3])
    >>> index.tolist(), totals
    ([0, 1, 3, 2, 4], [3, 2])
    """
    counts = torch.tensor(rows, dtype=torch.int64).view(len(rows), -1)  # [world, leaves]
    starts = counts.cumsum(1) - counts + torch.tensor(base, dtype=torch.int64).unsqueeze(1)
    lengths = counts.t().reshape(-1)  # leaf-major
    offsets = starts.t().reshape(-1) - (lengths.cumsum(0) - lengths)
    total = int(lengths.sum())
    index = torch.repeat_interleave(offsets, lengths, output_size=total) + torch.arange(total)
    return index, counts.sum(0).tolist()
