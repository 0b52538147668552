"""The payload of a :mod:`treegather.distributed` call: how it is laid out, written and read.

Every rank's payload, whichever way it travels::

    [status, rows of each tensor leaf of >= 1 dim, sizes | one region per (dtype, trailing
     shape): its leaves' bytes, written by one torch.cat | the other leaves, pickled]

A :class:`Plan` lays it out (the regions, widest elements first, each 16-byte aligned so that
any dtype is a view of the received bytes); :func:`write` packs this rank's :class:`Local`
straight into a collective's buffer; :func:`geometry` finds every rank's values in what
arrived, :func:`rank_leaves` reads one rank's leaves (views of the bytes) and :func:`unpack`
the result of the default rules, vectorised: each region's rows reordered from rank-major to
leaf-major with one ``index_select`` and split once into the result leaves (large leaves one
``torch.cat`` each). Every result is a copy, so the buffer may be reused.
"""

from __future__ import annotations

import array
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from optree import PyTreeSpec

from .._caches import LRU
from .._errors import TreegatherError

__all__ = [
    "DTYPES",
    "Geometry",
    "Local",
    "PACKABLE",
    "Plan",
    "Region",
    "geometry",
    "home_of",
    "layout_of",
    "padded",
    "plan_from_header",
    "rank_leaves",
    "unpack",
    "write",
]

Tensor = torch.Tensor
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


ALIGN = 16  # every region starts 16-byte aligned, so any dtype can be viewed in place


INT64 = 8


# dtypes torch.cat writes into a view of the send buffer on every device; the others travel as
# their bytes, each leaf viewed as uint8 (their shapes are then read, not proved by packing).
PACKABLE = frozenset(
    {
        *(torch.float64, torch.float32, torch.float16, torch.bfloat16),
        *(torch.complex128, torch.complex64, torch.bool, torch.uint8),
        *(torch.int64, torch.int32, torch.int16, torch.int8),
    }
)


_FAILED = 1  # the status of a payload that could not be packed


def padded(n: int) -> int:
    """``n`` rounded up to the 16-byte alignment of every region."""
    return -(-n // ALIGN) * ALIGN


class Region(NamedTuple):
    dtype: torch.dtype
    trailing: tuple[int, ...] | None  # None: 0-dim leaves (one element each)
    positions: tuple[int, ...]  # leaf indices, in leaf order
    rows: slice  # this region's entries in the rows vector (0-dim: empty)
    row_bytes: int  # bytes per row (0-dim: per leaf)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one structure's payload is laid out; immutable, shared by calls with the same key."""

    digest: tuple[int, int]  # (0, 0): never shared, the header always travels
    regions: tuple[Region, ...]
    objects: tuple[int, ...]  # positions of the non-tensor leaves
    row_positions: tuple[int, ...]  # the leaves whose first dim the rows vector holds
    sizes_given: bool
    vectorised: bool = False  # default rules only: every result region in one cat
    grads: tuple[int, ...] | None = None  # sync_grads: the leaves that require grad
    header: bytes = b""  # the pickled description (:func:`_header`)
    spec: PyTreeSpec | None = None
    head_ints: int = dataclasses.field(init=False)
    head_bytes: int = dataclasses.field(init=False)
    # Leaf i is entry order[i] of the regions' leaves in region order, then the objects; None
    # when that is leaf order already.
    order: tuple[int, ...] | None = dataclasses.field(init=False)
    firsts: tuple[int, ...] = dataclasses.field(init=False)  # each region's first leaf
    packable: bool = dataclasses.field(init=False)  # every region written by torch.cat

    def __post_init__(self) -> None:
        head_ints = 1 + len(self.row_positions) + self.sizes_given
        object.__setattr__(self, "head_ints", head_ints)
        object.__setattr__(self, "head_bytes", padded(INT64 * head_ints))
        placed = [pos for region in self.regions for pos in region.positions]
        placed += self.objects
        order = [0] * len(placed)
        for k, pos in enumerate(placed):
            order[pos] = k
        object.__setattr__(self, "order", None if placed == sorted(placed) else tuple(order))
        object.__setattr__(self, "firsts", tuple(r.positions[0] for r in self.regions))
        object.__setattr__(self, "packable", all(r.dtype in PACKABLE for r in self.regions))

    def nbytes(self, rows: Sequence[int]) -> int:
        """The payload's bytes before its objects, for these rows: the head and every region."""
        total = self.head_bytes
        for region in self.regions:
            n = sum(rows[region.rows]) if region.trailing is not None else len(region.positions)
            total += padded(n * region.row_bytes)
        return total


def layout_of(
    dtypes: Sequence[torch.dtype | None], trailing: Sequence[tuple[int, ...] | None]
) -> tuple[tuple[Region, ...], tuple[int, ...], tuple[int, ...]]:
    """The regions (widest elements first, which keeps each region's start aligned), the
    leaves whose rows the head holds, and the non-tensor leaves."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (d, t) in enumerate(zip(dtypes, trailing)):
        if d is not None:
            groups.setdefault((d.itemsize, str(d), t is None, t), []).append(i)
    regions: list[Region] = []
    row_positions: list[int] = []
    for k in sorted(groups, key=lambda k: (-k[0], k[1], k[2], k[3] or ())):
        positions = groups[k]
        dtype, trail = dtypes[positions[0]], trailing[positions[0]]
        assert dtype is not None
        start = len(row_positions)
        if trail is not None:
            row_positions.extend(positions)
        row_bytes = dtype.itemsize * (math.prod(trail) if trail is not None else 1)
        rows = slice(start, len(row_positions))
        regions.append(Region(dtype, trail, tuple(positions), rows, row_bytes))
    objects = tuple(i for i, d in enumerate(dtypes) if d is None)
    return tuple(regions), tuple(row_positions), objects


def plan_from_header(header: dict[str, Any]) -> Plan:
    """The plan another rank laid its payload out with, from its header."""
    meta = header["meta"]
    dtypes = [None if m is None else DTYPES[m[0]] for m in meta]
    trailing = [None if m is None else m[1] for m in meta]
    regions, row_positions, objects = layout_of(dtypes, trailing)
    return Plan((0, 0), regions, objects, row_positions, header["sizes_given"])


def write(local: Local, out: Tensor, prefix: Sequence[int] = ()) -> bool:
    """Write ``prefix`` (int64 values, such as a collective's row) and this rank's payload into
    ``out`` (uint8, 1-D, at least ``8 * len(prefix) + local.nbytes`` long); padding is zeroed.

    Each region is one ``torch.cat`` straight into ``out`` (which should live on the tensors'
    device; otherwise they are packed where they live and moved in one copy). Should packing
    fail (a tensor on another device, a sparse one, a shape other than assumed), ``out`` holds
    a failure status, which every rank reads, and the result is ``False``.
    """
    assert local.plan is not None
    home = home_of(local, out.device)
    try:
        if home == out.device:
            _write(local, out, prefix)
        else:
            staged = torch.empty(out.numel(), dtype=torch.uint8, device=home)
            _write(local, staged, prefix)
            out.copy_(staged)
    except Exception:
        out.zero_()
        status = torch.tensor([*prefix, _FAILED], dtype=torch.int64)
        out[: INT64 * len(status)].view(torch.int64).copy_(status)
        return False
    return True


def home_of(local: Local, fallback: torch.device) -> torch.device:
    """Where ``local``'s tensors are packed: their device, when they are on one (a meta
    tensor travels pickled, never as bytes), else ``fallback`` (they are moved there)."""
    if len(local.devices) == 1:
        (device,) = local.devices
        if device.type != "meta":
            return device
    return fallback


def _write(local: Local, out: Tensor, prefix: Sequence[int]) -> None:
    plan = local.plan
    assert plan is not None
    head = [*prefix, 0, *local.rows]
    if plan.sizes_given:
        head.append(local.sizes if local.sizes is not None else 0)
    out[: INT64 * len(head)].view(torch.int64).copy_(
        torch.frombuffer(array.array("q", head), dtype=torch.int64)
    )
    offset = INT64 * len(prefix) + plan.head_bytes
    _zero(out, INT64 * len(head), offset)
    with torch.no_grad():  # (cat with out= refuses tensors that require grad)
        for region in plan.regions:
            offset = _region(local, region, out, offset)
    if local.blob:
        out[offset : offset + len(local.blob)].copy_(
            torch.frombuffer(bytearray(local.blob), dtype=torch.uint8)
        )
    _zero(out, INT64 * len(prefix) + local.nbytes, out.numel())


def _region(local: Local, region: Region, out: Tensor, offset: int) -> int:
    """Write one region from ``offset``; return where the next one starts."""
    leaves = local.leaves
    parts: list[Tensor] = (
        leaves
        if len(region.positions) == len(leaves) and type(leaves) is list
        else [leaves[i] for i in region.positions]
    )
    if region.trailing is None:
        nbytes = len(parts) * region.row_bytes
    else:
        count = sum(local.rows[region.rows])
        nbytes = count * region.row_bytes
    target = out[offset : offset + nbytes]
    if len(local.devices) > 1:  # (a tree spread over devices: packed where the bytes go)
        parts = [p.to(out.device) for p in parts]
    if region.dtype not in PACKABLE:  # (as bytes: conjugate and negative bits resolved)
        flat = [p.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8) for p in parts]
        torch.cat(flat, out=target)
    elif region.trailing is None:
        torch.stack(parts, out=target.view(region.dtype))
    else:
        torch.cat(parts, out=target.view(region.dtype).view(count, *region.trailing))
    _zero(out, offset + nbytes, offset + padded(nbytes))
    return offset + padded(nbytes)


def _zero(out: Tensor, start: int, stop: int) -> None:
    if stop > start:
        out[start:stop].zero_()


class Local(NamedTuple):
    """This rank's call, ready to send: a plan and the values it lays out, or an error header."""

    plan: Plan | None  # None: ``header`` is an error header, and no payload travels
    header: bytes
    leaves: Sequence[Any] = ()
    rows: Sequence[int] = ()
    sizes: int | None = None
    blob: bytes = b""  # the pickled non-tensor leaves (empty when there are none)
    nbytes: int = 0  # of the payload
    devices: frozenset[torch.device] = frozenset()  # of the tensor leaves
    # This call's own structure, which results are rebuilt with (``plan.spec`` may be an earlier
    # call's, whose static fields and dict keys a result must not share).
    spec: PyTreeSpec | None = None
    # The first collective's buffer with the payload packed after ``room`` bytes, when it fits
    # the capacity given to :func:`describe` (``None``: it does not, or no plan).
    inline: Tensor | None = None

    @property
    def digest(self) -> tuple[int, int]:
        return (0, 0) if self.plan is None else self.plan.digest


_INDEXED_MIN = 32  # leaves per region from which the result rows are gathered with one index


_OWN_STORAGE = 1 << 18  # bytes per result leaf from which each leaf gets its own tensor


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


def geometry(
    plans: Sequence[Plan],
    buf: Tensor,
    offsets: list[int],
    nbytes: list[int],
    heads: list[list[int]] | None = None,
    shared: bool = False,
) -> Geometry:
    """Where every rank's values are in ``buf`` (rank ``r``'s payload, laid out by
    ``plans[r]``, starts at ``offsets[r]``; its head ints, when read already: ``heads``);
    raises on every rank if one could not pack its tree. With ``shared`` (every rank has one
    plan), the plan's last geometry when the heads are the same."""
    if heads is None:
        heads = [
            buf[at : at + INT64 * p.head_ints].view(torch.int64).tolist()
            for at, p in zip(offsets, plans)
        ]
    last = _GEOMETRIES.get(plans[0].digest) if shared else None
    if (
        last is not None
        and last.heads == heads
        and last.offsets == offsets
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
    for r, (plan, at) in enumerate(zip(plans, offsets)):
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
        blobs.append((at, offsets[r] + nbytes[r]))
    found = Geometry(
        heads, offsets, nbytes, rows, sizes if given else None, starts, spans, blobs, {}
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


def rank_leaves(
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


def unpack(
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
    if not region.row_bytes:  # rows of no bytes (a trailing dim of 0): nothing to reorder
        return [
            torch.empty((sum(leaf), *region.trailing), dtype=region.dtype, device=buf.device)
            for leaf in zip(*rows)
        ]
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
