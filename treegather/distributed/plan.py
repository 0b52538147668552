"""The cached wire plan of :mod:`treegather.distributed`: a repeated structure, no header.

For a tree whose structure, leaf dtypes and trailing shapes (every dim but the first) the ranks
share, each rank computes a 128-bit *digest* of what must agree (the exact structure, dict key
order and node metadata, each leaf's dtype and trailing shape, the layout and ``dim``, whether
``sizes`` was passed); the ranks exchange that digest and one payload each, with no header
(:mod:`~treegather.distributed.protocol`, steps 1-2). When any rank's digest differs, every rank
takes the full exchange of :mod:`~treegather.distributed.wire`, whose checks are the definition.
Finding the plan cheaply: ARCHITECTURE.md, "The wire plan, in detail".

Nothing here formats user data (no ``repr``): the digest hashes the pickled structure, dtype
names and shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import operator
import pickle
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from optree import PyTreeSpec

from .. import _layout, _tree
from .._caches import LRU
from .._compiled import structure as _structure
from .._rules import Cat
from . import pickling, wire
from .layout import layout_text

__all__ = [
    "PACKABLE",
    "Local",
    "WirePlan",
    "checked",
    "clear_plans",
    "padded",
    "plan_count",
    "prepare",
]

ALIGN = 16
INT64 = 8
_MISSING: Any = object()
# Plans by (pickled structure, dtypes, dims, trailing shapes, layout key, sizes given).
_PLANS: LRU[Any, WirePlan | None] = LRU("distributed.wire_plans", maxsize=64)
# The call seen last per (structure, layout key, sizes given): its dtypes, exact shapes and plan.
_LAST: LRU[Any, _Seen] = LRU("distributed.wire_plans_last", maxsize=64)
# dtypes torch.cat and torch.stack write into a view of the send buffer on every device.
PACKABLE = frozenset(
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
_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")
_TAIL = operator.itemgetter(slice(1, None))


def padded(n: int) -> int:
    """``n`` rounded up to the 16-byte alignment of every region."""
    return -(-n // ALIGN) * ALIGN


# --------------------------------------------------------------------------------- the plan


class Region(NamedTuple):
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
    regions: tuple[Region, ...]
    objects: tuple[int, ...]  # positions of the non-tensor leaves
    row_positions: tuple[int, ...]  # the leaves whose first dim the rows vector holds
    sizes_given: bool
    vectorised: bool  # default rules only: every result region in one cat
    grads: tuple[int, ...] | None = None  # sync_grads: the leaves that require grad
    # The status, one row count per row-bearing leaf, and ``sizes`` when given; their bytes.
    head_ints: int = dataclasses.field(init=False)
    head_bytes: int = dataclasses.field(init=False)
    # Leaf i is entry order[i] of the regions' leaves in region order, then the objects; None
    # when that is leaf order already.
    order: tuple[int, ...] | None = dataclasses.field(init=False)
    firsts: tuple[int, ...] = dataclasses.field(init=False)  # each region's first leaf

    def __post_init__(self) -> None:
        head_ints = 1 + len(self.row_positions) + self.sizes_given
        object.__setattr__(self, "head_ints", head_ints)
        object.__setattr__(self, "head_bytes", padded(INT64 * head_ints))
        placed = [pos for region in self.regions for pos in region.positions]
        placed += self.objects
        order: list[int] = [0] * len(placed)
        for k, pos in enumerate(placed):
            order[pos] = k
        object.__setattr__(self, "order", None if placed == sorted(placed) else tuple(order))
        object.__setattr__(self, "firsts", tuple(r.positions[0] for r in self.regions))


class Local(NamedTuple):
    """One rank's call, ready for the fast exchange."""

    plan: WirePlan
    leaves: list[Any]
    rows: list[int]
    sizes: int | None
    blob: bytes  # the pickled non-tensor leaves (empty when there are none)
    nbytes: int
    devices: frozenset[torch.device]  # the first tensor leaf's, until ``checked``
    checked: bool = False  # every tensor leaf is known to be strided and on ``devices``
    # The last call whose shapes this one assumes, when only each leaf's element count was read
    # (see :func:`prepare`): packing, or :func:`checked`, confirms them. ``None``: shapes read.
    assumed: _Seen | None = None
    # This call's structure, which results are rebuilt with: ``plan.spec`` may be an earlier
    # call's, whose static fields and dict keys a result must not share (see
    # treegather._compiled.structure.Structure.exact).
    spec: PyTreeSpec | None = None


def checked(local: Local) -> Local | None:
    """``local`` once every tensor leaf is known to be strided and on one device, else ``None``.

    :func:`prepare` looks at the first tensor leaf only (reading every leaf's device and layout
    costs as much as the rest of a repeated call's lookup): packing straight into the first
    collective checks the others, since ``torch.cat`` into a strided buffer refuses other
    devices and layouts, and a rank whose packing fails sends no plan. A payload that will be
    packed after the ranks agreed on the plan is checked here first.
    """
    if local.checked and local.assumed is None:
        return local
    objects = frozenset(local.plan.objects)
    tensors = [x for i, x in enumerate(local.leaves) if i not in objects]
    devices = frozenset(map(_DEVICE, tensors))
    if len(devices) > 1 or list(map(_LAYOUT, tensors)).count(torch.strided) != len(tensors):
        return None
    if local.assumed is not None and list(map(Tensor.size, local.leaves)) != local.assumed.shapes:
        refuted(local)
        return None
    return local._replace(devices=devices, checked=True, assumed=None)


def refuted(local: Local) -> None:
    """``local`` could not be packed: if it assumed the last call's shapes, its structure's calls
    read their shapes from now on (the next call finds its own plan). For good: shapes that
    alternate with the same counts would otherwise cost a full exchange every other call."""
    if local.assumed is not None:
        local.assumed.refuted = True


class _Seen:
    """The last call with one structure and layout: what a repeated call compares itself to."""

    __slots__ = (
        "dtypes",
        "numels",
        "plan",
        "refuted",
        "rows",
        "shapes",
        "spec_bytes",
        "tensor_bytes",
    )

    def __init__(
        self,
        spec_bytes: bytes,
        dtypes: list[Any],
        shapes: list[Any],
        plan: WirePlan | None,
        rows: list[int],
        tensor_bytes: int,
    ) -> None:
        self.spec_bytes = spec_bytes
        self.dtypes = dtypes
        self.shapes = shapes
        self.plan = plan
        self.rows = rows
        self.tensor_bytes = tensor_bytes  # of the head and every region (objects on top)
        # Each leaf's element count, worked out the first time a call is compared by counts
        # (see _same_counts); () when a count is zero (``cat`` skips 1-D empty tensors).
        self.numels: list[int] | tuple[()] | None = None
        # Packing refuted a call that assumed these shapes: this structure's calls (this one's
        # successors included) read their shapes.
        self.refuted = False


def prepare(tree: Any, layout: Any, dim: Any, sizes: Any, sync: bool = False) -> Local | None:
    """This rank's call as a :class:`Local`, or ``None`` when only the full exchange will do.

    ``None`` (this rank sends a zero digest, and every rank takes the full exchange) for bad
    ``sizes``, sparse/quantized/meta/nested tensors, unpicklable leaves or node metadata, or a
    layout that does not resolve: the full exchange reports those; also for a tree holding a
    batch node or a value laid out by rows (:mod:`treegather._tree.batch`): each rank's batch
    sizes travel in its header, and such a value is joined by its own rule. Tensors on several devices
    or of other layouts past the first are found by :func:`checked` or by packing.

    A tree of tensors only, like the last call with its structure, is compared by element
    counts (ARCHITECTURE.md, "The wire plan, in detail").

    With ``sync`` (``sync_grads``), which leaves require grad is part of the plan (and of its
    digest), so the ranks agree on it, and every call reads its leaves' shapes.
    """
    if sizes is not None and (type(sizes) is not int or sizes < 0):
        return None
    sizes_given = sizes is not None
    try:
        leaves, structure, spec = _structure.recognise(tree, "outputs")
        if structure is None and _tree.is_batched(spec):
            return None  # (each rank's batch sizes travel in the full exchange's header)
        text = layout_text(layout, dim, sync)[0]
        grads = wire.grad_positions(leaves) if sync else None
        key = None if structure is None else (structure, text, sizes_given, grads)
        last = None if key is None else _LAST.get(key)
        assumed = None
        if last is not None and not sync and _same_counts(last, leaves):  # tensors only
            seen: _Seen | None = last
            assumed = last
            first = leaves[0] if leaves else None
        else:
            found = _signature(leaves)
            if found is None:
                return None  # (a tensor that travels pickled: a subclass, sparse, ...)
            shapes, dtypes, objects = found
            if objects and any(_tree.rows_of(x) is not None for x in leaves):
                return None  # (joined by its own rule: not in the vectorised unpack)
            seen = _seen(key, last, spec, dtypes, shapes, text, layout, dim, sizes_given, grads)
            if objects:
                first = next((leaves[i] for i, d in enumerate(dtypes) if d is not None), None)
            else:
                first = leaves[0] if leaves else None
        if first is not None and (first.layout != torch.strided or first.device.type == "meta"):
            return None
    except Exception:
        return None
    if seen is None or seen.plan is None:
        return None
    devices = frozenset() if first is None else frozenset((first.device,))
    blob = b""
    if seen.plan.objects:
        try:
            blob = pickling.dumps([leaves[i] for i in seen.plan.objects])
        except Exception:
            return None
    nbytes = seen.tensor_bytes + len(blob)
    single = len(leaves) < 2  # one leaf: its shape was read whole, and checked
    return Local(
        seen.plan,
        leaves,
        seen.rows,
        sizes,
        blob,
        nbytes,
        devices,
        single,
        None if single else assumed,
        spec,
    )


def _same_counts(last: _Seen, leaves: list[Any]) -> bool:
    """Whether ``leaves`` (tensors only) can take ``last``'s plan by element counts and dtypes.

    Each region's first leaf must have ``last``'s exact shape (read first: where the rows change
    with the batch, this fails before anything per leaf is read). No count may be zero: ``cat``
    skips a 1-D empty tensor instead of checking its dims.
    """
    plan = last.plan
    if plan is None or plan.objects or last.refuted or last.numels == ():
        return False
    shapes = last.shapes
    try:
        for i in plan.firsts:
            if leaves[i].size() != shapes[i]:
                return False
        numels = last.numels
        if numels is None:
            counts = list(map(torch.Size.numel, shapes))
            numels = last.numels = () if 0 in counts else counts
        if not numels:
            return False
        counts = list(map(Tensor.numel, leaves))  # a TypeError for a leaf that is no tensor
        if counts != numels or list(map(_DTYPE, leaves)) != last.dtypes:
            return False
        return list(map(type, leaves)).count(Tensor) == len(leaves)  # (no subclass: pickled)
    except Exception:  # not a tensor, a nested tensor, ...: the shapes will tell
        return False


def _seen(
    key: Any,
    last: _Seen | None,
    spec: PyTreeSpec,
    dtypes: list[Any],
    shapes: list[Any],
    text: str,
    layout: Any,
    dim: Any,
    sizes_given: bool,
    grads: tuple[int, ...] | None = None,
) -> _Seen | None:
    """The plan for this call, from ``last`` (the last call with its ``key``) when it can be."""
    if last is not None and last.shapes == shapes and last.dtypes == dtypes:
        return last
    try:
        spec_bytes = (
            last.spec_bytes
            if last is not None
            else pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        )
    except Exception:
        return None
    plan = _plan_for(spec, spec_bytes, dtypes, shapes, text, layout, dim, sizes_given, grads)
    rows: list[int] = []
    nbytes = 0
    if plan is not None:
        rows = [shapes[i][0] for i in plan.row_positions]
        nbytes = plan.head_bytes
        for region in plan.regions:
            count = sum(rows[region.rows]) if region.trailing is not None else len(region.positions)
            nbytes += padded(count * region.row_bytes)
    found = _Seen(spec_bytes, dtypes, shapes, plan, rows, nbytes)
    found.refuted = last is not None and last.refuted
    if key is not None:
        _LAST.put(key, found)
    return found


def _plan_for(
    spec: PyTreeSpec,
    spec_bytes: bytes,
    dtypes: list[Any],
    shapes: list[Any],
    text: str,
    layout: Any,
    dim: Any,
    sizes_given: bool,
    grads: tuple[int, ...] | None = None,
) -> WirePlan | None:
    """The plan for these shapes whatever their rows: keyed by dims and trailing shapes."""
    # Each leaf's number of dims (-1: not a tensor) and its shape after the first dim.
    ndims = tuple(-1 if s is None else len(s) for s in shapes)
    trailing = tuple(None if s is None else s[1:] for s in shapes)
    key = (spec_bytes, tuple(dtypes), ndims, trailing, text, sizes_given, grads)
    plan = _PLANS.get(key, _MISSING)
    if plan is _MISSING:
        tails = [t if n > 0 else None for n, t in zip(ndims, trailing)]
        plan = _build(spec, spec_bytes, dtypes, tails, layout, dim, sizes_given, grads)
        _PLANS.put(key, plan)
    return plan


def _signature(leaves: list[Any]) -> tuple[list[Any], list[Any], bool] | None:
    """Each leaf's shape and dtype (``None`` for non-tensors), and whether there are others;
    ``None`` for a tree holding a tensor subclass (it travels pickled, as what it is)."""
    types = list(map(type, leaves))
    if types.count(Tensor) == len(types):
        return list(map(Tensor.size, leaves)), list(map(_DTYPE, leaves)), False
    shapes: list[Any] = []
    dtypes: list[Any] = []
    for leaf, kind in zip(leaves, types):
        if kind is not Tensor and isinstance(leaf, Tensor):
            return None
        if kind is Tensor:
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
    grads: tuple[int, ...] | None = None,
) -> WirePlan | None:
    """The plan for one key (a cache miss: about what one full-exchange call costs locally)."""
    if any(d is not None and d not in PACKABLE for d in dtypes):
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
    regions: list[Region] = []
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
            Region(dtype, trail, tuple(positions), slice(start, len(row_positions)), row_bytes)
        )
    objects = tuple(i for i, d in enumerate(dtypes) if d is None)
    vectorised = (
        not grads
        and resolved.up_spec is spec
        and all(
            _default_cat(rule, dtypes[i], trailing[i], dim) for i, rule in enumerate(resolved.rules)
        )
    )
    h = hashlib.blake2b(spec_bytes, digest_size=16)
    h.update(repr([(str(d), t) for d, t in zip(dtypes, trailing)]).encode())
    h.update(f"{layout_text(layout, dim, grads is not None)[0]};sizes={sizes_given}".encode())
    h.update(repr(grads).encode())
    digest = h.digest()
    # Two signed int64 for the preamble; (0, 0) is reserved for "no plan on this rank".
    d0 = int.from_bytes(digest[:8], "little", signed=True) or 1
    d1 = int.from_bytes(digest[8:], "little", signed=True)
    return WirePlan(
        (d0, d1),
        spec,
        tuple(regions),
        objects,
        tuple(row_positions),
        sizes_given,
        vectorised,
        grads,
    )


def _default_cat(rule: Any, dtype: Any, trailing: Any, dim: Any) -> bool:
    """Whether a leaf combines as the default rule does: ``cat`` at dim 0, ``as_list``."""
    if dtype is None:
        return rule is None
    if rule is None:
        return type(dim) is int and dim == 0
    return type(rule) is Cat and type(rule.dim) is int and rule.dim == 0 and trailing is not None


def clear_plans() -> None:
    """Forget every wire plan (also done by :func:`treegather.clear_caches`)."""
    _PLANS.clear()
    _LAST.clear()


def plan_count() -> int:
    """How many wire plans are cached (for tests)."""
    return len(_PLANS)
