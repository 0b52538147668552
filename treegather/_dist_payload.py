"""The payload of :mod:`treegather.distributed`'s wire plan: packing and unpacking.

One rank's payload, for a :class:`~treegather._wireplan.WirePlan`::

    [status, rows of each tensor leaf, sizes (int64) | pad | a region per (dtype, trailing shape) | objects]

:func:`payload` writes each region with one ``torch.cat`` (``torch.stack`` for 0-dim leaves)
straight into the buffer the collective sends. :func:`parse` reads every rank's payload back
as views. For the default rules (``cat`` along dim 0, ``as_list`` for other leaves)
:func:`unpack` builds the results vectorised: a region of many small leaves is reordered from
rank-major to leaf-major rows with one ``index_select`` and split once into the result leaves;
large leaves are one ``torch.cat`` each (one copy per result leaf, each with its own storage).
Other layouts rebuild each rank's leaves with :func:`rank_leaves` and apply the rules of
:func:`treegather.gather`.
"""

from __future__ import annotations

import array
import pickle
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from treegather._errors import TreegatherError
from treegather._wireplan import INT64, Local, Region, WirePlan, padded

__all__ = ["Received", "parse", "payload", "rank_leaves", "send", "unpack"]

_INDEXED_MIN = 32  # leaves per region from which the combine gathers rows with one index
_OWN_STORAGE = 1 << 18  # bytes per result leaf from which each leaf gets its own tensor


def payload(local: Local, out: torch.Tensor) -> None:
    """Write this rank's payload into ``out`` (uint8, 1-D, at least ``local.nbytes`` long).

    Each region is one ``torch.cat`` (``torch.stack`` for 0-dim leaves) straight into ``out``,
    which should live on the tensors' device; padding bytes are zeroed. Should packing fail
    (it is checked not to), ``out`` holds a failure status instead, which every rank reads.
    """
    try:
        _payload(local, out)
    except Exception:
        out.zero_()
        out[:INT64].view(torch.int64).fill_(_FAILED)


_FAILED = 1


def send(fast: Local, stride: int, device: torch.device, buf: torch.Tensor) -> torch.Tensor:
    """Pack this rank's payload into ``buf`` (``stride`` bytes on ``device``) and return it.

    Each region is one ``cat`` straight into the buffer. When the tensors live on another
    device than the bytes travel on (GPU tensors on gloo), they are packed there and moved in
    one copy for the whole tree instead of one per leaf.
    """
    home = next(iter(fast.devices)) if fast.devices else device
    if home == device:
        payload(fast, buf)
    else:
        staged = torch.empty(stride, dtype=torch.uint8, device=home)
        payload(fast, staged)
        buf.copy_(staged)
    return buf


def _payload(local: Local, out: torch.Tensor) -> None:
    plan = local.plan
    head = [0, *local.rows]
    if plan.sizes_given:
        head.append(local.sizes if local.sizes is not None else 0)
    offset = plan.head_bytes
    if head:
        ints = torch.frombuffer(array.array("q", head), dtype=torch.int64)
        out[: INT64 * len(head)].view(torch.int64).copy_(ints)
        out[INT64 * len(head) : offset].zero_()
    leaves = local.leaves
    with torch.no_grad():
        for region in plan.regions:
            parts = [leaves[i] for i in region.positions]
            if region.trailing is None:
                nbytes = len(parts) * region.row_bytes
                torch.stack(parts, out=out[offset : offset + nbytes].view(region.dtype))
            else:
                count = sum(local.rows[region.rows])
                nbytes = count * region.row_bytes
                target = out[offset : offset + nbytes].view(region.dtype)
                torch.cat(parts, out=target.view(count, *region.trailing))
            out[offset + nbytes : offset + padded(nbytes)].zero_()
            offset += padded(nbytes)
    if local.blob:
        blob = torch.frombuffer(bytearray(local.blob), dtype=torch.uint8)
        out[offset : offset + len(local.blob)].copy_(blob)
    out[local.nbytes :].zero_()


class Received(NamedTuple):
    """The ranks' payloads, parsed: per rank its rows, sizes, region views and objects."""

    rows: list[list[int]]
    counts: np.ndarray  # the same rows as an int64 [world, row-bearing leaves] array
    sizes: list[int] | None
    regions: list[list[torch.Tensor]]  # per region, per rank: the region's flat values
    objects: list[list[Any]]  # per rank: its non-tensor leaves


def parse(
    plan: WirePlan, buffers: Sequence[torch.Tensor], nbytes: Sequence[int], target: torch.device
) -> Received:
    """Read every rank's payload (``buffers[r]``: uint8, rank ``r``'s bytes first).

    Tensor regions are moved to ``target`` with one copy per rank when they arrived elsewhere
    (one coalesced host-to-device transfer instead of one per leaf).
    """
    n_rows = len(plan.row_positions)
    stacked = torch.stack([b[: INT64 * plan.head_ints] for b in buffers])
    head_ints = stacked.view(torch.int64).cpu().numpy()
    heads = head_ints.tolist()
    failed = [r for r, h in enumerate(heads) if h[0] != 0]
    if failed:
        raise TreegatherError(
            f"group rank(s) {', '.join(map(str, failed))} could not pack their tree for "
            "treegather.distributed (see the traceback there); no result on any rank"
        )
    rows = [h[1 : 1 + n_rows] for h in heads]
    sizes = [h[1 + n_rows] for h in heads] if plan.sizes_given else None
    regions: list[list[torch.Tensor]] = [[] for _ in plan.regions]
    objects: list[list[Any]] = []
    for r, buf in enumerate(buffers):
        offset = plan.head_bytes
        data_start = offset
        spans = []
        for region in plan.regions:
            count = (
                sum(rows[r][region.rows]) if region.trailing is not None else len(region.positions)
            )
            spans.append((offset, count * region.row_bytes))
            offset += padded(count * region.row_bytes)
        if plan.objects:
            blob = buf[offset : nbytes[r]].cpu().numpy().tobytes()
            objects.append(pickle.loads(blob))
        else:
            objects.append([])
        data = buf[data_start:offset]
        if data.device != target:
            data = data.to(target)
        for j, (region, (start, size)) in enumerate(zip(plan.regions, spans)):
            start -= data_start
            regions[j].append(data[start : start + size].view(region.dtype))
    return Received(rows, head_ints[:, 1 : 1 + n_rows], sizes, regions, objects)


def rank_leaves(plan: WirePlan, received: Received) -> list[list[Any]]:
    """Each rank's leaves (tensors as views of the received bytes), in leaf order."""
    out: list[list[Any]] = []
    for r, objects in enumerate(received.objects):
        leaves: list[Any] = [None] * plan.spec.num_leaves
        for pos, obj in zip(plan.objects, objects):
            leaves[pos] = obj
        for region, per_rank in zip(plan.regions, received.regions):
            flat = per_rank[r]
            if region.trailing is None:
                parts: Sequence[torch.Tensor] = flat.unbind()
            else:
                rows = received.rows[r][region.rows]
                parts = flat.view(sum(rows), *region.trailing).split_with_sizes(rows)
            for pos, part in zip(region.positions, parts):
                leaves[pos] = part
        out.append(leaves)
    return out


def unpack(plan: WirePlan, received: Received) -> Any:
    """The combined tree under the default rules: one copy per region (or per large leaf).

    Leaf ``i`` of a region is rank 0's rows of it, then rank 1's, and so on (0-dim leaves: a
    vector with one entry per rank). Non-tensor leaves become the list of rank values.
    """
    world = len(received.objects)
    leaves: list[Any] = [None] * plan.spec.num_leaves
    for j, pos in enumerate(plan.objects):
        leaves[pos] = [received.objects[r][j] for r in range(world)]
    for region, per_rank in zip(plan.regions, received.regions):
        if region.trailing is None:
            results: Sequence[torch.Tensor] = torch.stack(per_rank, 1).unbind()
        else:
            results = _region_results(region, per_rank, received)
        for pos, value in zip(region.positions, results):
            leaves[pos] = value
    return plan.spec.unflatten(leaves)


def _region_results(
    region: Region, per_rank: list[torch.Tensor], received: Received
) -> Sequence[torch.Tensor]:
    """One region's result leaves, each every rank's rows of it in rank order."""
    trailing = region.trailing
    assert trailing is not None
    world = len(per_rank)
    rows = [received.rows[r][region.rows] for r in range(world)]
    totals = list(map(sum, zip(*rows)))
    if sum(totals) * region.row_bytes >= _OWN_STORAGE * len(totals):
        # Large leaves: one tensor each (one copy), not views of one large block; a block of
        # tens of MiB is mapped fresh, and page-faulted, on every call.
        pieces = _pieces(per_rank, rows, trailing)
        return list(map(torch.cat, zip(*pieces)))
    if world > 1 and len(region.positions) >= _INDEXED_MIN:
        merged = _gather_rows(per_rank, received.counts[:, region.rows], trailing)
    else:
        pieces = _pieces(per_rank, rows, trailing)
        merged = torch.cat([p for column in zip(*pieces) for p in column])
    return merged.split_with_sizes(totals)


def _pieces(
    per_rank: Sequence[torch.Tensor], rows: list[list[int]], trailing: tuple[int, ...]
) -> list[tuple[torch.Tensor, ...]]:
    """Per rank, one view per leaf of its region (``rows``: that rank's rows of each leaf)."""
    return [flat.view(sum(rs), *trailing).split_with_sizes(rs) for flat, rs in zip(per_rank, rows)]


def _gather_rows(
    per_rank: Sequence[torch.Tensor], counts: np.ndarray, trailing: tuple[int, ...]
) -> torch.Tensor:
    """Many small leaves: rank-major rows reordered leaf-major with one ``index_select``.

    Splitting every rank's region into one view per leaf costs about a microsecond per view;
    the row permutation is a few vectorised numpy ops (a microsecond each, where a torch op on
    a small CPU tensor costs several) whatever the number of leaves.
    """
    # counts: [world, leaves] rows of each leaf on each rank.
    stacked = torch.cat([flat.view(-1, *trailing) for flat in per_rank])
    per_rank_rows = counts.sum(1)
    rank_base = np.cumsum(per_rank_rows) - per_rank_rows
    starts = np.cumsum(counts, 1) - counts + rank_base[:, None]  # first row of (rank, leaf)
    lengths = counts.T.reshape(-1)  # leaf-major order: leaf 0 of every rank, then leaf 1...
    offsets = starts.T.reshape(-1) - (np.cumsum(lengths) - lengths)
    index = np.repeat(offsets, lengths) + np.arange(int(lengths.sum()))
    return stacked.index_select(0, torch.from_numpy(index).to(stacked.device))
