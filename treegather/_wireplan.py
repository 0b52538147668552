"""The cached wire plan of :mod:`treegather.distributed`: a repeated structure in two collectives.

For a tree whose structure, leaf dtypes and trailing shapes (every dim but the first) the ranks
share, nothing but the batch rows changes from call to call. Each rank then computes a 128-bit
*digest* of what must agree (the exact structure, dict key order and node metadata included,
each leaf's dtype and trailing shape, the layout and ``dim``, whether ``sizes`` was passed),
cached in an :class:`~treegather._caches.LRU` keyed by type-aware values, and the ranks exchange
only that digest (in the preamble every call makes) and then one payload per rank::

    [status, rows of each tensor leaf, sizes (int64) | pad | a region per (dtype, trailing shape) | objects]

Each region is written with one ``torch.cat`` (``torch.stack`` for 0-dim leaves) straight into
the buffer the collective sends. For the default rules (``cat`` along dim 0, ``as_list`` for
other leaves) the results come out vectorised: a region of many small leaves is reordered from
rank-major to leaf-major rows with one ``index_select`` and split once into the result leaves;
large leaves are one ``torch.cat`` each (one copy per result leaf, each with its own storage).
Other layouts rebuild each rank's tree from views of the received bytes and apply the rules of
:func:`treegather.gather`. Non-tensor leaves travel as one pickled list at the end of the
payload. There is no header: when any rank's digest differs (or a rank cannot use the plan),
every rank takes the full exchange of :mod:`treegather._wire`, whose checks and errors are the
definition.

Nothing here formats or ``repr``\\ s user data: the structure is keyed by its pickled bytes (type
aware: ``True``, ``1`` and ``1.0`` differ, and so does key order), and the digest hashes those
bytes, dtype names and shapes.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import math
import operator
import pickle
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch
from optree import PyTreeSpec

from treegather import _layout, _tree
from treegather._caches import LRU
from treegather._errors import TreegatherError
from treegather._layout import ByPath
from treegather._rules import Cat, Custom, Rule

__all__ = ["WirePlan", "Local", "prepare", "layout_text", "payload", "unpack", "padded"]

ALIGN = 16
_INT64 = 8
_MISSING: Any = object()
_PLANS: LRU[Any, WirePlan | None] = LRU("distributed.wire_plans", maxsize=64)
# The same plans by exact shapes (rows included): a repeated call skips the trailing shapes.
_BY_SHAPES: LRU[Any, WirePlan | None] = LRU("distributed.wire_plans_by_shapes", maxsize=64)
# dtypes torch.cat and torch.stack write into a view of the send buffer on every device.
_PACKABLE = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex128,
        torch.complex64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)
Tensor = torch.Tensor
_DEVICE = operator.attrgetter("device")
_LAYOUT = operator.attrgetter("layout")
_TAIL = operator.itemgetter(slice(1, None))
_INDEXED_MIN = 32  # leaves per region from which the combine gathers rows with one index
_OWN_STORAGE = 1 << 18  # bytes per result leaf from which each leaf gets its own tensor


def padded(n: int) -> int:
    """``n`` rounded up to the 16-byte alignment of every region."""
    return -(-n // ALIGN) * ALIGN


# ------------------------------------------------------------------------------ layout text


class _Shown(str):
    """A string that ``repr``\\ s as itself (to print a layout with described rules)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def _describe_rule(value: Any) -> tuple[str, str]:
    """One layout entry as ``(key, shown)``: the key is type-aware and process-independent."""
    if isinstance(value, Custom) or (callable(value) and not isinstance(value, (Rule, ByPath))):
        fn = value.fn if isinstance(value, Custom) else value
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
        return f"callable:{name}", f"custom rule {getattr(fn, '__qualname__', name)}"
    if isinstance(value, Rule) and dataclasses.is_dataclass(value):
        fields = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
        key = type(value).__qualname__ + "".join(
            f"|{n}={type(v).__name__}:{v!r}" for n, v in fields
        )
        return key, value.describe()
    if isinstance(value, ByPath):
        parts = [(p, *_describe_rule(r)) for p, _, r in value.patterns]
        default = _describe_rule(value.default)
        # Patterns are dotted strings or exact tuple paths: typed, in an order of their own.
        keys = sorted(f"{type(p).__name__}:{p!r}={k}" for p, k, _ in parts)
        key = "by_path:" + "|".join(keys) + f"|={default[0]}"
        inner = ", ".join(f"{p!r}: {s}" for p, _, s in parts)
        return key, f"by_path({{{inner}}}, default={default[1]})"
    if value is None or type(value) in (bool, int, float, str):
        return f"{type(value).__name__}:{value!r}", repr(value)
    return f"object:{type(value).__module__}.{type(value).__qualname__}", type(value).__qualname__


def layout_text(layout: Any, dim: Any) -> tuple[str, str]:
    """``(key, shown)`` for a layout and ``dim``: equal keys iff the ranks combine alike.

    The key is type-aware (``1`` and ``True`` differ), ignores dict insertion order, and names
    callables by module and qualified name (process-independent); ``shown`` is for messages.

    >>> import treegather as tg
    >>> layout_text({"x": tg.stack()}, 0)[1]
    "layout {'x': stack()}, dim=0"
    >>> layout_text(None, 0)[0] == layout_text(None, False)[0]
    False
    """
    atoms = (bool, int, float, str, type(None))
    dim_key = f"{type(dim).__name__}:{dim!r}" if type(dim) in atoms else f"?{type(dim)}"
    if layout is None:
        return f"None;{dim_key}", f"layout None, dim={dim!r}"
    leaves, spec = optree.tree_flatten(layout, none_is_leaf=True, namespace=_tree.NAMESPACE)
    described = [_describe_rule(leaf) for leaf in leaves]
    key = repr(spec) + "".join(f";{k}" for k, _ in described) + f";{dim_key}"
    shown = spec.unflatten([_Shown(s) for _, s in described])
    return key, f"layout {shown!r}, dim={dim!r}"


# --------------------------------------------------------------------------------- the plan


class _Region(NamedTuple):
    dtype: torch.dtype
    trailing: tuple[int, ...] | None  # None: 0-dim leaves (one element each)
    positions: tuple[int, ...]  # leaf indices, in leaf order
    rows: slice  # this region's entries in the rows vector (0-dim: empty)
    row_bytes: int  # bytes per row (0-dim: per leaf)


@dataclasses.dataclass(frozen=True)
class WirePlan:
    """How one structure travels: immutable, shared by every call with the same key."""

    digest: tuple[int, int]
    spec: PyTreeSpec
    regions: tuple[_Region, ...]
    objects: tuple[int, ...]  # positions of the non-tensor leaves
    row_positions: tuple[int, ...]  # the leaves whose first dim the rows vector holds
    sizes_given: bool
    vectorised: bool  # default rules only: every result region in one cat

    @property
    def head_ints(self) -> int:
        """The status, one row count per row-bearing leaf, and ``sizes`` when given."""
        return 1 + len(self.row_positions) + self.sizes_given

    @property
    def head_bytes(self) -> int:
        return padded(_INT64 * self.head_ints)


class Local(NamedTuple):
    """One rank's call, ready for the fast exchange."""

    plan: WirePlan
    leaves: list[Any]
    rows: list[int]
    sizes: int | None
    blob: bytes  # the pickled non-tensor leaves (empty when there are none)
    nbytes: int
    devices: frozenset[torch.device]


def prepare(tree: Any, layout: Any, dim: Any, sizes: Any) -> Local | None:
    """This rank's call as a :class:`Local`, or ``None`` when only the full exchange will do.

    ``None`` (this rank sends a zero digest, and every rank takes the full exchange) for bad
    ``sizes``, sparse/quantized/meta/nested tensors, tensors on several devices, unpicklable
    leaves or node metadata, or a layout that does not resolve: the full exchange reports those.
    """
    if sizes is not None and (type(sizes) is not int or sizes < 0):
        return None
    try:
        leaves, spec = _tree.flatten(tree)
        spec_bytes = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        shapes, dtypes, objects = _signature(leaves)
    except Exception:
        return None
    tensors = [leaves[i] for i, d in enumerate(dtypes) if d is not None] if objects else leaves
    devices = frozenset(map(_DEVICE, tensors))
    if len(devices) > 1 or list(map(_LAYOUT, tensors)).count(torch.strided) != len(tensors):
        return None
    if devices and next(iter(devices)).type == "meta":
        return None
    text = layout_text(layout, dim)[0]
    dtype_key = tuple(dtypes)
    # The shapes seen last with this structure (rows included): the usual repeated call.
    exact = (spec_bytes, dtype_key, tuple(shapes), text, sizes is not None)
    plan = _BY_SHAPES.get(exact, _MISSING)
    if plan is _MISSING:
        plan = _plan_for(spec, spec_bytes, dtypes, shapes, objects, text, layout, dim, sizes)
        _BY_SHAPES.put(exact, plan)
    if plan is None:
        return None
    blob = b""
    if plan.objects:
        try:
            blob = pickle.dumps([leaves[i] for i in plan.objects], protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            return None
    rows = [shapes[i][0] for i in plan.row_positions]
    if any(r < 0 for r in rows):  # pragma: no cover - torch sizes are never negative
        return None
    nbytes = plan.head_bytes + len(blob)
    for region in plan.regions:
        count = sum(rows[region.rows]) if region.trailing is not None else len(region.positions)
        nbytes += padded(count * region.row_bytes)
    return Local(plan, leaves, rows, sizes, blob, nbytes, devices)


def _plan_for(
    spec: PyTreeSpec,
    spec_bytes: bytes,
    dtypes: list[Any],
    shapes: list[Any],
    objects: bool,
    text: str,
    layout: Any,
    dim: Any,
    sizes: Any,
) -> WirePlan | None:
    """The plan for these shapes whatever their rows: keyed by dims and trailing shapes."""
    # Each leaf's number of dims (-1: not a tensor) and its shape after the first dim.
    ndims = (
        tuple(-1 if s is None else len(s) for s in shapes) if objects else tuple(map(len, shapes))
    )
    trailing = tuple(map(_TAIL, shapes)) if not objects else tuple(s and s[1:] for s in shapes)
    key = (spec_bytes, tuple(dtypes), ndims, trailing, text, sizes is not None)
    plan = _PLANS.get(key, _MISSING)
    if plan is _MISSING:
        tails = [t if n > 0 else None for n, t in zip(ndims, trailing)]
        plan = _build(spec, spec_bytes, dtypes, tails, layout, dim, sizes is not None)
        _PLANS.put(key, plan)
    return plan


def _signature(leaves: list[Any]) -> tuple[list[Any], list[Any], bool]:
    """Each leaf's shape and dtype (``None`` for non-tensors), and whether there are others."""
    types = list(map(type, leaves))
    if types.count(Tensor) == len(types):
        return list(map(Tensor.size, leaves)), [t.dtype for t in leaves], False
    shapes: list[Any] = []
    dtypes: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            shapes.append(leaf.size())
            dtypes.append(leaf.dtype)
        else:
            shapes.append(None)
            dtypes.append(None)
    return shapes, dtypes, True


def _build(
    spec: PyTreeSpec,
    spec_bytes: bytes,
    dtypes: Sequence[torch.dtype | None],
    trailing: Sequence[tuple[int, ...] | None],
    layout: Any,
    dim: Any,
    sizes_given: bool,
) -> WirePlan | None:
    """The plan for one key (a cache miss: about what one full-exchange call costs locally)."""
    if any(d is not None and d not in _PACKABLE for d in dtypes):
        return None  # float8, quantized, ...: the full exchange carries them as raw bytes
    try:
        resolved = _layout.resolve(spec, layout, "gather", dim, "outputs")
    except Exception:
        return None
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (d, t) in enumerate(zip(dtypes, trailing)):
        if d is not None:
            groups.setdefault((d.itemsize, str(d), t is None, t), []).append(i)
    # Widest elements first keeps each region's start aligned (regions are padded anyway).
    order = sorted(groups, key=lambda k: (-k[0], k[1], k[2], k[3] or ()))
    regions: list[_Region] = []
    row_positions: list[int] = []
    for k in order:
        positions = groups[k]
        dtype, trail = dtypes[positions[0]], trailing[positions[0]]
        assert dtype is not None
        start = len(row_positions)
        if trail is not None:
            row_positions.extend(positions)
        row_bytes = dtype.itemsize * (math.prod(trail) if trail is not None else 1)
        regions.append(
            _Region(dtype, trail, tuple(positions), slice(start, len(row_positions)), row_bytes)
        )
    objects = tuple(i for i, d in enumerate(dtypes) if d is None)
    vectorised = resolved.up_spec is spec and all(
        _default_cat(rule, dtypes[i], trailing[i], dim) for i, rule in enumerate(resolved.rules)
    )
    h = hashlib.blake2b(spec_bytes, digest_size=16)
    h.update(repr([(str(d), t) for d, t in zip(dtypes, trailing)]).encode())
    h.update(f"{layout_text(layout, dim)[0]};sizes={sizes_given}".encode())
    digest = h.digest()
    # Two signed int64 for the preamble; (0, 0) is reserved for "no plan on this rank".
    d0 = int.from_bytes(digest[:8], "little", signed=True) or 1
    d1 = int.from_bytes(digest[8:], "little", signed=True)
    return WirePlan(
        (d0, d1), spec, tuple(regions), objects, tuple(row_positions), sizes_given, vectorised
    )


def _default_cat(rule: Any, dtype: Any, trailing: Any, dim: Any) -> bool:
    """Whether a leaf combines as the default rule does: ``cat`` at dim 0, ``as_list``."""
    if dtype is None:
        return rule is None
    if rule is None:
        return type(dim) is int and dim == 0
    return type(rule) is Cat and type(rule.dim) is int and rule.dim == 0 and trailing is not None


def digest_of(local: Local | None) -> tuple[int, int]:
    """The digest this rank sends in the preamble (``(0, 0)``: no plan)."""
    return (0, 0) if local is None else local.plan.digest


# ------------------------------------------------------------------------------ pack/unpack


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
        out[:_INT64].view(torch.int64).fill_(_FAILED)


_FAILED = 1


def _payload(local: Local, out: torch.Tensor) -> None:
    plan = local.plan
    head = [0, *local.rows]
    if plan.sizes_given:
        head.append(local.sizes if local.sizes is not None else 0)
    offset = plan.head_bytes
    if head:
        ints = torch.frombuffer(array.array("q", head), dtype=torch.int64)
        out[: _INT64 * len(head)].view(torch.int64).copy_(ints)
        out[_INT64 * len(head) : offset].zero_()
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
    counts: torch.Tensor  # the same rows as an int64 [world, row-bearing leaves] CPU tensor
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
    stacked = torch.stack([b[: _INT64 * plan.head_ints] for b in buffers])
    head_ints = stacked.view(torch.int64).cpu()
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
    """The combined tree under the default rules: one ``cat`` per region, then views.

    Leaf ``i`` of a region is rank 0's rows of it, then rank 1's, and so on: the regions' pieces
    interleaved and concatenated in one call, then split once per leaf (0-dim leaves: stacked
    into a vector with one entry per rank). Non-tensor leaves become the list of rank values.
    """
    world = len(received.objects)
    leaves: list[Any] = [None] * plan.spec.num_leaves
    for j, pos in enumerate(plan.objects):
        leaves[pos] = [received.objects[r][j] for r in range(world)]
    for region, per_rank in zip(plan.regions, received.regions):
        if region.trailing is None:
            results: Sequence[torch.Tensor] = torch.stack(per_rank, 1).unbind()
        else:
            rows = [received.rows[r][region.rows] for r in range(world)]
            if world > 1 and len(region.positions) >= _INDEXED_MIN:
                counts = received.counts[:, region.rows]
                totals = counts.sum(0).tolist()
                merged = _gather_rows(per_rank, counts, region.trailing)
            else:
                totals = list(map(sum, zip(*rows)))
                pieces = [
                    flat.view(sum(rs), *region.trailing).split_with_sizes(rs)
                    for flat, rs in zip(per_rank, rows)
                ]
                if sum(totals) * region.row_bytes >= _OWN_STORAGE * len(totals):
                    # Large leaves: one tensor each (one copy), not views of one large block;
                    # a block of tens of MiB is mapped fresh, and page-faulted, on every call.
                    results = list(map(torch.cat, zip(*pieces)))
                    for pos, value in zip(region.positions, results):
                        leaves[pos] = value
                    continue
                columns = pieces[0] if world == 1 else [p for col in zip(*pieces) for p in col]
                merged = torch.cat(columns)
            results = merged.split_with_sizes(totals)
        for pos, value in zip(region.positions, results):
            leaves[pos] = value
    return plan.spec.unflatten(leaves)


def _gather_rows(
    per_rank: Sequence[torch.Tensor], counts: torch.Tensor, trailing: tuple[int, ...]
) -> torch.Tensor:
    """Many small leaves: rank-major rows reordered leaf-major with one ``index_select``.

    Splitting every rank's region into one view per leaf costs about a microsecond per view;
    the row permutation is a few vectorised ops whatever the number of leaves.
    """
    # counts: [world, leaves] rows of each leaf on each rank.
    stacked = torch.cat([flat.view(-1, *trailing) for flat in per_rank])
    rank_base = counts.sum(1).cumsum(0) - counts.sum(1)
    starts = counts.cumsum(1) - counts + rank_base[:, None]  # first row of (rank, leaf)
    lengths = counts.t().reshape(-1)  # leaf-major order: leaf 0 of every rank, then leaf 1...
    offsets = starts.t().reshape(-1) - (lengths.cumsum(0) - lengths)
    index = torch.repeat_interleave(offsets, lengths) + torch.arange(int(lengths.sum()))
    return stacked.index_select(0, index.to(stacked.device))


def clear_plans() -> None:
    """Forget every wire plan (also done by :func:`treegather.clear_caches`)."""
    _PLANS.clear()
    _BY_SHAPES.clear()


def plan_count() -> int:
    """How many wire plans are cached (for tests)."""
    return len(_PLANS)
