"""The payload of :mod:`treegather.distributed`'s wire plan: packing and unpacking.

One rank's payload, for a :class:`~treegather.distributed.plan.WirePlan`::

    [status, rows of each tensor leaf, sizes (int64) | pad | a region per (dtype, trailing shape) | objects]

:func:`payload` writes each region with one ``torch.cat`` (``torch.stack`` for 0-dim leaves)
straight into the buffer the collective sends (after the first collective's row, when the
payload rides with it). Every rank's payload arrives in one buffer at a fixed stride
(:class:`Payloads`); :func:`parse` reads the heads and works out where each rank's values are.
Unpacking: :func:`unpack` (the default rules, vectorised) or :func:`rank_leaves` (views of the
buffer, for the rules of :func:`treegather.gather`); ARCHITECTURE.md, "The wire plan, in detail".
"""

from __future__ import annotations

import array
import pickle
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from optree import PyTreeSpec

from .._caches import LRU
from .._errors import TreegatherError
from .plan import INT64, Local, Region, WirePlan, padded
from .wire import tensor_bytes

__all__ = ["Payloads", "Received", "parse", "payload", "rank_leaves", "send", "unpack"]

_INDEXED_MIN = 32  # leaves per region from which the combine gathers rows with one index
_OWN_STORAGE = 1 << 18  # bytes per result leaf from which each leaf gets its own tensor
# Per plan digest: where every rank's values were in the last call's buffer (see _geometry).
_GEOMETRIES: LRU[Any, Geometry] = LRU("distributed.payload_geometries", maxsize=64, trees=False)


def payload(local: Local, out: torch.Tensor, prefix: Sequence[int] = ()) -> bool:
    """Write this rank's payload into ``out`` (uint8, 1-D, at least ``local.nbytes`` long).

    ``prefix`` (``int64`` values, e.g. the first collective's row) goes first, written together
    with the payload's head; the payload follows. Each region is one ``torch.cat``
    (``torch.stack`` for 0-dim leaves) straight into ``out``, which should live on the
    tensors' device; padding bytes are zeroed. Should packing fail (a tensor on another
    device, a sparse one: see :func:`treegather.distributed.plan.checked`), ``out`` holds a failure
    status instead, which every rank reads, and the result is ``False``.
    """
    try:
        _payload(local, out, prefix)
    except Exception:
        _failed(out, prefix)
        return False
    return True


def _failed(out: torch.Tensor, prefix: Sequence[int]) -> None:
    """``out`` as a payload that says packing failed (every rank then raises)."""
    out.zero_()
    status = torch.tensor([*prefix, _FAILED], dtype=torch.int64)
    out[: INT64 * len(status)].view(torch.int64).copy_(status)


_FAILED = 1


def send(
    fast: Local, stride: int, device: torch.device, buf: torch.Tensor, prefix: Sequence[int] = ()
) -> bool:
    """Pack ``prefix`` and this rank's payload into ``buf`` (``stride`` bytes on ``device``).

    Each region is one ``cat`` straight into the buffer. When the tensors live on another
    device than the bytes travel on (GPU tensors on gloo), they are packed there and moved in
    one copy for the whole tree instead of one per leaf. ``False`` when packing failed.
    """
    home = next(iter(fast.devices)) if fast.devices else device
    if home == device:
        return payload(fast, buf, prefix)
    try:  # never raise on one rank only: the others would wait in the collective
        staged = torch.empty(stride, dtype=torch.uint8, device=home)
        packed = payload(fast, staged, prefix)
        buf.copy_(staged)
    except Exception:
        _failed(buf, prefix)
        return False
    return packed


def _payload(local: Local, out: torch.Tensor, prefix: Sequence[int]) -> None:
    plan = local.plan
    head = [*prefix, 0, *local.rows]
    if plan.sizes_given:
        head.append(local.sizes if local.sizes is not None else 0)
    ints = torch.frombuffer(array.array("q", head), dtype=torch.int64)
    out[: INT64 * len(head)].view(torch.int64).copy_(ints)
    offset = INT64 * len(prefix) + plan.head_bytes
    _zero(out, INT64 * len(head), offset)
    if torch.is_grad_enabled():  # cat and stack with out= refuse tensors that require grad
        with torch.no_grad():
            offset = _regions(local, out, offset)
    else:
        offset = _regions(local, out, offset)
    if local.blob:
        blob = torch.frombuffer(bytearray(local.blob), dtype=torch.uint8)
        out[offset : offset + len(local.blob)].copy_(blob)
    _zero(out, INT64 * len(prefix) + local.nbytes, out.numel())


def _regions(local: Local, out: torch.Tensor, offset: int) -> int:
    """Write every region from ``offset`` on; return where the objects go."""
    leaves = local.leaves
    for region in local.plan.regions:
        if len(region.positions) == len(leaves):  # every leaf, in leaf order
            parts = leaves
        else:
            parts = [leaves[i] for i in region.positions]
        if region.trailing is None:
            nbytes = len(parts) * region.row_bytes
            torch.stack(parts, out=out[offset : offset + nbytes].view(region.dtype))
        else:
            count = sum(local.rows[region.rows])
            nbytes = count * region.row_bytes
            target = out[offset : offset + nbytes].view(region.dtype)
            torch.cat(parts, out=target.view(count, *region.trailing))
        _zero(out, offset + nbytes, offset + padded(nbytes))
        offset += padded(nbytes)
    return offset


def _zero(out: torch.Tensor, start: int, stop: int) -> None:
    """Zero ``out[start:stop]`` (padding: no stale memory travels), skipping empty ranges."""
    if stop > start:
        out[start:stop].zero_()


class Payloads(NamedTuple):
    """Every rank's payload in one buffer: rank ``r``'s bytes start at ``offset + r * stride``."""

    buf: torch.Tensor  # uint8, 1-D, ``world * stride`` bytes
    offset: int
    stride: int
    heads: list[list[int]] | None = None  # their head ints, when read already


class Geometry(NamedTuple):
    """Where every rank's values are in the buffer: a function of the heads, kept per plan.

    A steady loop receives the same heads call after call (the same rows on every rank), so the
    last geometry of each plan is kept with the row permutations the combine computed for it.
    """

    heads: list[list[int]]  # with the offset, stride and byte counts: what the rest follows from
    offset: int
    stride: int
    nbytes: list[int]
    rows: list[list[int]]  # per rank: the rows of each row-bearing leaf
    sizes: list[int] | None
    starts: list[list[int]]  # per region, per rank: where its values start in the buffer
    spans: list[list[int]]  # per region, per rank: their bytes
    blobs: list[tuple[int, int]]  # per rank: where its pickled objects are
    # (region, aligned) -> the row index and each result leaf's rows (see _gather_rows).
    orders: dict[tuple[int, bool], tuple[torch.Tensor, list[int]]]


class Received(NamedTuple):
    """The ranks' payloads, parsed: per rank its rows, sizes and objects; where its values are."""

    objects: list[list[Any]]  # per rank: its non-tensor leaves
    buf: torch.Tensor  # every rank's bytes (on the target device)
    geometry: Geometry

    @property
    def rows(self) -> list[list[int]]:
        return self.geometry.rows

    @property
    def sizes(self) -> list[int] | None:
        return self.geometry.sizes

    def values(self, j: int, r: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``r``'s values of region ``j``, flat (a view of ``buf``)."""
        start = self.geometry.starts[j][r]
        return self.buf[start : start + self.geometry.spans[j][r]].view(dtype)


def parse(
    plan: WirePlan, payloads: Payloads, nbytes: Sequence[int], target: torch.device
) -> Received:
    """Read every rank's payload; raise on every rank if one of them could not pack its tree.

    The received bytes are moved to ``target`` with one copy when they arrived elsewhere (one
    coalesced host-to-device transfer instead of one per leaf).
    """
    heads = payloads.heads
    if heads is None:
        grid = payloads.buf.view(len(nbytes), payloads.stride)
        start = payloads.offset
        heads = grid[:, start : start + INT64 * plan.head_ints].view(torch.int64).tolist()
    geometry = _geometry(plan, heads, payloads.offset, payloads.stride, list(nbytes))
    objects: list[list[Any]] = [[]] * len(nbytes)
    if plan.objects:
        buf = payloads.buf
        objects = [pickle.loads(tensor_bytes(buf[a:b])) for a, b in geometry.blobs]
    buf = payloads.buf if payloads.buf.device == target else payloads.buf.to(target)
    return Received(objects, buf, geometry)


def _geometry(
    plan: WirePlan, heads: list[list[int]], offset: int, stride: int, nbytes: list[int]
) -> Geometry:
    """The geometry of these heads: the plan's last one when the heads are the same."""
    last = _GEOMETRIES.get(plan.digest)
    if (
        last is not None
        and last.heads == heads
        and last.offset == offset
        and last.stride == stride
        and last.nbytes == nbytes
    ):
        return last
    if any(head[0] for head in heads):
        failed = [r for r, head in enumerate(heads) if head[0]]
        raise TreegatherError(
            f"group rank(s) {', '.join(map(str, failed))} could not pack their tree for "
            "treegather.distributed (see the traceback there); no result on any rank"
        )
    world, n_rows = len(nbytes), len(plan.row_positions)
    rows = [head[1 : 1 + n_rows] for head in heads]
    sizes = [head[1 + n_rows] for head in heads] if plan.sizes_given else None
    spans = [
        [len(region.positions) * region.row_bytes] * world
        if region.trailing is None
        else [sum(rank_rows[region.rows]) * region.row_bytes for rank_rows in rows]
        for region in plan.regions
    ]
    starts: list[list[int]] = [[] for _ in plan.regions]
    blobs = []
    for r in range(world):
        at = offset + r * stride + plan.head_bytes
        for j, per_rank in enumerate(spans):
            starts[j].append(at)
            at += padded(per_rank[r])
        blobs.append((at, offset + r * stride + nbytes[r]))
    found = Geometry(heads, offset, stride, nbytes, rows, sizes, starts, spans, blobs, {})
    _GEOMETRIES.put(plan.digest, found)
    return found


def rank_leaves(plan: WirePlan, received: Received) -> list[list[Any]]:
    """Each rank's leaves (tensors as views of the received bytes), in leaf order."""
    out: list[list[Any]] = []
    for r, objects in enumerate(received.objects):
        leaves: list[Any] = [None] * plan.spec.num_leaves
        for pos, obj in zip(plan.objects, objects):
            leaves[pos] = obj
        for j, region in enumerate(plan.regions):
            flat = received.values(j, r, region.dtype)
            if region.trailing is None:
                parts: Sequence[torch.Tensor] = flat.unbind()
            else:
                rows = received.rows[r][region.rows]
                parts = flat.view(sum(rows), *region.trailing).split_with_sizes(rows)
            for pos, part in zip(region.positions, parts):
                leaves[pos] = part
        out.append(leaves)
    return out


def unpack(plan: WirePlan, received: Received, spec: PyTreeSpec | None = None) -> Any:
    """The combined tree under the default rules: one copy per region (or per large leaf),
    rebuilt with ``spec`` (this call's structure; ``plan.spec`` when ``None``).

    Leaf ``i`` of a region is rank 0's rows of it, then rank 1's, and so on (0-dim leaves: a
    vector with one entry per rank). Non-tensor leaves become the list of rank values.
    """
    world = len(received.objects)
    placed: list[Any] = []  # the regions' leaves in region order, then the objects
    for j, region in enumerate(plan.regions):
        if region.trailing is None:
            per_rank = [received.values(j, r, region.dtype) for r in range(world)]
            placed += torch.stack(per_rank, 1).unbind()
        else:
            placed += _region_results(j, region, received)
    placed += ([objects[j] for objects in received.objects] for j in range(len(plan.objects)))
    leaves = placed if plan.order is None else [placed[k] for k in plan.order]
    return (plan.spec if spec is None else spec).unflatten(leaves)


def _region_results(j: int, region: Region, received: Received) -> Sequence[torch.Tensor]:
    """Region ``j``'s result leaves, each every rank's rows of it in rank order."""
    assert region.trailing is not None
    geometry = received.geometry
    if sum(geometry.spans[j]) >= _OWN_STORAGE * len(region.positions):
        # Large leaves: one tensor each (one copy), not views of one large block; a block of
        # tens of MiB is mapped fresh, and page-faulted, on every call.
        return list(map(torch.cat, zip(*_pieces(j, region, received))))
    rows = [rank_rows[region.rows] for rank_rows in geometry.rows]
    if not region.row_bytes:  # rows of no bytes (a trailing dim of 0): nothing to reorder
        return [
            torch.empty(
                (sum(leaf), *region.trailing), dtype=region.dtype, device=received.buf.device
            )
            for leaf in zip(*rows)
        ]
    aligned = all(start % region.row_bytes == 0 for start in geometry.starts[j])
    if len(rows) > 1 and (aligned or len(region.positions) >= _INDEXED_MIN):
        return _gather_rows(j, region, received, rows, aligned)
    merged = torch.cat([p for column in zip(*_pieces(j, region, received)) for p in column])
    return merged.unsafe_split_with_sizes(list(map(sum, zip(*rows))))


def _pieces(j: int, region: Region, received: Received) -> list[tuple[torch.Tensor, ...]]:
    """Per rank, one view per leaf of its values of region ``j``."""
    assert region.trailing is not None
    out = []
    for r, rows in enumerate(received.rows):
        rs = rows[region.rows]
        flat = received.values(j, r, region.dtype)
        out.append(flat.view(sum(rs), *region.trailing).unsafe_split_with_sizes(rs))
    return out


def _gather_rows(
    j: int, region: Region, received: Received, rows: list[list[int]], aligned: bool
) -> Sequence[torch.Tensor]:
    """Rank-major rows reordered leaf-major with one ``index_select``, split into the leaves.

    Splitting every rank's values into one view per leaf costs about a microsecond per view;
    the permutation is a few vectorised ops whatever the number of leaves. When every rank's
    values start at a multiple of the row size (``aligned``: always for rows of 16 bytes or a
    divisor of 16), the rows are selected straight from the received buffer; otherwise (many
    leaves only) from a copy of the ranks' values side by side.
    """
    assert region.trailing is not None
    row_bytes = region.row_bytes
    geometry = received.geometry
    if aligned:
        n = received.buf.numel() // row_bytes
        source = received.buf.view(region.dtype)[: n * (row_bytes // region.dtype.itemsize)]
        source = source.view(n, *region.trailing)
    else:
        per_rank = [received.values(j, r, region.dtype) for r in range(len(rows))]
        source = torch.cat([flat.view(-1, *region.trailing) for flat in per_rank])
    order = geometry.orders.get((j, aligned))
    if order is None:
        if aligned:
            base = [start // row_bytes for start in geometry.starts[j]]
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

    A few tensor ops whatever the number of leaves; kept with the geometry, since a steady loop
    sends the same rows call after call.

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
