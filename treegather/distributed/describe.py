"""Stage 1 of a :mod:`treegather.distributed` call: what this rank sends, described and checked.

A rank's tree becomes a :class:`Local`: its leaves, the :class:`Plan` of how they travel, and
the plan's *header*. The payload of every call, whichever way it travels::

    [status, rows of each tensor leaf of >= 1 dim, sizes | one region per (dtype, trailing
     shape): its leaves' bytes, written by one torch.cat | the other leaves, pickled]

A plan is a function of the structure, each leaf's dtype and trailing shape (every dim but the
first), the layout and ``dim``, whether ``sizes`` was passed and which leaves require grad
(``sync_grads``); it is kept per such key, with its *digest* (two int64 that the ranks compare
in the call's first collective) and its *header* (the pickled description another rank reads
the payload with, and checks the trees with, sent only when the digests differ). A tree the
plans cannot keep (batch nodes, values laid out by rows, unpicklable structure) gets a plan of
its own with the digest ``(0, 0)``: its header always travels. So does every tree under
:func:`treegather._caches.reference_only`: the header path is the definition.

A repeated call finds its plan without reading every shape: a tree of tensors whose leaves have
the dtypes and element counts of the last call with its structure, and whose regions' first
leaves have that call's exact shapes, takes that call's plan; packing each region with one
``torch.cat`` then proves every other leaf's shape (``cat`` refuses other trailing dims, and
equal counts then mean equal rows). So a payload that will travel in the first collective is
packed here, and a larger one has its shapes read here: what leaves this module is checked.

Problems found here (a sparse tensor, an unpicklable leaf, a bad ``sizes``) become an *error
header* instead of an exception, so that every rank learns of them in the exchange and raises
the same error, instead of the others waiting in a collective. Nothing here formats user data.
"""

from __future__ import annotations

import hashlib
import operator
import pickle
from collections.abc import Sequence
from typing import Any

import torch
from optree import PyTreeSpec

from .. import _layout, _tree
from .._caches import FAST_PATHS, LRU
from .._compiled import structure as _structure
from .._errors import BatchSizeError, LeafTypeError, TreegatherError, safe_repr
from .._rules import Cat, kinds
from . import pickling
from .layout import layout_text
from .payload import DTYPES, Local, Plan, home_of, layout_of, write

__all__ = [
    "ROOT",
    "describe",
    "error_header",
    "fingerprint",
    "format_problems",
    "grad_positions",
    "leaf_paths",
]

ROOT = "outputs"  # how error messages name the tree (as treegather.gather does)
MAX_LISTED = 10  # problems listed in one message before "... and N more"
_NAMES = {d: name for name, d in DTYPES.items()}
Tensor = torch.Tensor
_MISSING: Any = object()
_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")
_QUANTIZED = frozenset(d for name, d in DTYPES.items() if name.startswith("q"))
# Plans by (pickled structure, dtypes, dims, trailing shapes, layout key, sizes given, grads,
# whether the header carries the structure for rank 0's key order).
_PLANS: LRU[Any, Plan | None] = LRU("distributed.wire_plans", maxsize=64)
# The call seen last per (structure, layout key, sizes given, grads, order).
_LAST: LRU[Any, _Seen] = LRU("distributed.wire_plans_last", maxsize=64)


# ------------------------------------------------------------------------------- the plan


def error_header(cls: type[Exception], message: str) -> bytes:
    """What a rank sends instead of its tree when it found a problem of its own."""
    return pickle.dumps({"error": (cls.__name__, message)}, protocol=pickle.HIGHEST_PROTOCOL)


def _failed(cls: type[Exception], message: str) -> Local:
    return Local(None, error_header(cls, message))


def describe(
    tree: Any,
    layout: Any,
    dim: int,
    sizes: Any,
    sync: bool = False,
    *,
    room: int = 0,
    capacity: int = 0,
    avoid: str | None = None,
    order: bool = False,
    with_spec: bool = False,
) -> Local:
    """This rank's call as a :class:`Local`; never raises (a problem becomes an error header).

    A payload of at most ``capacity`` bytes is packed into the first collective's buffer
    (``room + capacity`` bytes, the payload after ``room``); a larger one is checked (every
    leaf's shape, layout and device read) for :func:`write` to pack once the ranks agreed; so
    is one whose tensors are all on a device of the type ``avoid`` names (an accelerator whose
    own backend carries the bytes, which the first collective does not use).
    ``order`` (rank 0): the header carries the structure, so that every rank rebuilds the
    trees with rank 0's dict key order. ``with_spec`` (``broadcast``'s sender): the header
    carries the whole structure and each leaf's device type. ``sync`` (``sync_grads``): which
    leaves require grad is part of the plan.
    """
    if sizes is not None and (isinstance(sizes, bool) or not isinstance(sizes, int) or sizes < 0):
        message = f"sizes must be this rank's non-negative int (e.g. its batch size), got {safe_repr(sizes)}"
        return _failed(BatchSizeError, message)
    try:
        kept = (
            _kept(tree, layout, dim, sizes, sync, order)
            if FAST_PATHS.on and not with_spec
            else None
        )
        if avoid is not None and kept is not None and _all_on(kept[0].devices, avoid):
            capacity = 0
        local = None if kept is None else _ready(kept[0], kept[1], room, capacity)
        if local is None:  # (no plan kept, or packing refuted what it assumed: read it all)
            local = _described(tree, layout, dim, sizes, sync, order, with_spec)
            if local.plan is not None:
                if local.plan.digest == (0, 0) or (avoid and _all_on(local.devices, avoid)):
                    capacity = 0  # (its header travels, and its payload with it)
                local = _ready(local, None, room, capacity, read=True) or _failed(
                    LeafTypeError, "this rank's tensors could not be packed"
                )
        return local
    except TreegatherError as exc:  # (a tree that contains itself): the same error everywhere
        return _failed(type(exc), str(exc))
    except Exception as exc:  # a node's flatten function failed, say: still tell the others
        message = f"could not prepare this rank's tree: {type(exc).__name__}: {exc}"
        return _failed(TreegatherError, message)


def _all_on(devices: frozenset[torch.device], kind: str) -> bool:
    return bool(devices) and all(d.type == kind for d in devices)


def _ready(
    local: Local, assumed: _Seen | None, room: int, capacity: int, read: bool = False
) -> Local | None:
    """``local`` packed into the first collective's buffer when it fits ``capacity``, else
    checked for :func:`write` (unless every leaf was ``read``); ``None`` when packing or the
    check refutes what it assumed (a shape, one layout, one device)."""
    if local.nbytes <= capacity:
        home = home_of(local, torch.device("cpu"))
        buf = torch.empty(room + capacity, dtype=torch.uint8, device=home)
        if not write(local, buf[room:]):
            if assumed is not None:  # for good: shapes that alternate with the same counts
                assumed.refuted = True
            return None
        return local._replace(inline=buf)
    if read:
        return local
    assert local.plan is not None
    objects = frozenset(local.plan.objects)
    tensors = [x for i, x in enumerate(local.leaves) if i not in objects]
    devices = frozenset(map(_DEVICE, tensors))
    if len(devices) > 1 or list(map(_LAYOUT, tensors)).count(torch.strided) != len(tensors):
        return None
    if assumed is not None and list(map(Tensor.size, local.leaves)) != assumed.shapes:
        assumed.refuted = True
        return None
    return local._replace(devices=devices)


def _kept(
    tree: Any, layout: Any, dim: int, sizes: int | None, sync: bool, order: bool
) -> tuple[Local, _Seen | None] | None:
    """The call through the plan kept for its key, and the last call whose shapes it assumes
    (``None``: it read them), or ``None``: no plan can be kept for it (:func:`_described`)."""
    leaves, structure, spec = _structure.recognise(tree, ROOT)
    if structure is None and _tree.is_batched(spec):
        return None  # (each rank's batch sizes travel in its header)
    text = layout_text(layout, dim, sync)[0]
    grads = grad_positions(leaves) if sync else None
    key = None if structure is None else (structure, text, sizes is not None, grads, order)
    last = None if key is None else _LAST.get(key)
    assumed = None
    if last is not None and not sync and _same_counts(last, leaves):
        seen: _Seen | None = last
        assumed = last
        first = leaves[0] if leaves else None
    else:
        try:
            found = _signature(leaves)
        except RuntimeError:  # (a nested tensor has no sizes)
            return None
        if found is None:  # (a subclass: it travels pickled, as what it is)
            return None
        shapes, dtypes = found
        if any(_tree.rows_of(x) is not None for x in leaves if type(x) is not Tensor):
            return None  # (joined by its own rule, and its rows are not a leaf's)
        seen = _seen(
            key, last, tree, spec, dtypes, shapes, layout, dim, sizes is not None, grads, order
        )
        first = next((leaves[i] for i, d in enumerate(dtypes) if d is not None), None)
    if seen is None or seen.plan is None:
        return None
    if first is not None and (first.layout != torch.strided or first.device.type == "meta"):
        return None
    blob = b""
    if seen.plan.objects:
        try:
            blob = pickling.dumps([leaves[i] for i in seen.plan.objects])
        except Exception:
            return None
    devices = frozenset() if first is None else frozenset((first.device,))
    nbytes = seen.tensor_bytes + len(blob)
    local = Local(
        seen.plan, seen.plan.header, leaves, seen.rows, sizes, blob, nbytes, devices, spec
    )
    return local, None if len(leaves) < 2 else assumed


def _described(
    tree: Any,
    layout: Any,
    dim: int,
    sizes: int | None,
    sync: bool,
    order: bool,
    with_spec: bool,
) -> Local:
    """The call described from scratch: every leaf read and checked, a plan made for it alone
    (its digest ``(0, 0)``: its header travels)."""
    leaves, spec = _tree.flatten(tree, ROOT)
    # A tensor of another kind than a dense torch.Tensor (sparse, nested, quantized, meta, a
    # subclass such as Parameter) travels pickled, as torch pickles it, and comes back as what
    # it was, on a device of the kind it was on (``held``).
    held = {
        i: (_NAMES[x.dtype], x.device.type)
        for i, x in enumerate(leaves)
        if isinstance(x, Tensor) and not pickling.plain(x)
    }
    dtypes: list[Any] = [
        None if i in held or not isinstance(x, Tensor) else x.dtype for i, x in enumerate(leaves)
    ]
    shapes: list[Any] = [None if d is None else x.size() for x, d in zip(leaves, dtypes)]
    # (a value laid out by rows travels detached: sync_grads connects its tensors that require
    # grad, which the header names)
    objects = [_detached(x) for x, d in zip(leaves, dtypes) if d is None]
    try:
        blob = pickling.dumps(objects) if objects else b""
    except Exception as exc:
        return _failed(LeafTypeError, _unpicklable(spec, leaves, exc))
    grads = grad_positions(leaves) if sync else None
    parts = {
        i: by_rows.requiring_grad()
        for i in grads or ()
        if (by_rows := _tree.rows_of(leaves[i])) is not None
    }
    extra: dict[str, Any] = {"held": held, "parts": parts}
    if with_spec:
        extra["spec"] = spec
        extra["devices"] = [x.device.type if isinstance(x, Tensor) else None for x in leaves]
    try:
        plan = _build(
            tree, spec, dtypes, shapes, layout, dim, sizes is not None, grads, order, extra
        )
    except TreegatherError as exc:  # the layout does not fit the tree
        return _failed(type(exc), str(exc))
    except Exception as exc:  # unpicklable node metadata in the header
        return _failed(LeafTypeError, _unpicklable(spec, leaves, exc))
    rows = [shapes[i][0] for i in plan.row_positions]
    devices = frozenset(x.device for x in leaves if isinstance(x, Tensor))
    nbytes = plan.nbytes(rows) + len(blob)
    return Local(plan, plan.header, leaves, rows, sizes, blob, nbytes, devices, spec)


class _Seen:
    """The last call with one key: what a repeated call compares itself to."""

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
        plan: Plan | None,
        rows: list[int],
    ) -> None:
        self.spec_bytes = spec_bytes
        self.dtypes = dtypes
        self.shapes = shapes
        self.plan = plan
        self.rows = rows
        self.tensor_bytes = 0 if plan is None else plan.nbytes(rows)
        # Each leaf's element count, worked out the first time a call is compared by counts;
        # () when a count is zero (``cat`` skips a 1-D empty tensor instead of checking it).
        self.numels: list[int] | tuple[()] | None = None
        # Packing refuted a call that assumed these shapes: this key's calls read their shapes.
        self.refuted = False


def _same_counts(last: _Seen, leaves: list[Any]) -> bool:
    """Whether ``leaves`` (tensors only) can take ``last``'s plan by element counts and dtypes:
    each region's first leaf has ``last``'s exact shape (read first: where the rows change with
    the batch, this fails before anything per leaf is read), no count is zero."""
    plan = last.plan
    if plan is None or plan.objects or not plan.packable or last.refuted or last.numels == ():
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
    tree: Any,
    spec: PyTreeSpec,
    dtypes: list[Any],
    shapes: list[Any],
    layout: Any,
    dim: Any,
    sizes_given: bool,
    grads: tuple[int, ...] | None,
    order: bool,
) -> _Seen | None:
    """The plan for this call, from ``last`` (the last call with its ``key``) when it can be."""
    if last is not None and last.shapes == shapes and last.dtypes == dtypes:
        return last
    if not _QUANTIZED.isdisjoint(dtypes):  # (the plain path names them)
        return None
    try:
        spec_bytes = last.spec_bytes if last is not None else _pickled(spec)
    except Exception:
        return None
    text = layout_text(layout, dim, grads is not None)[0]
    ndims = tuple(-1 if s is None else len(s) for s in shapes)
    trailing = tuple(None if s is None else tuple(s[1:]) for s in shapes)
    plan_key = (spec_bytes, tuple(dtypes), ndims, trailing, text, sizes_given, grads, order)
    plan = _PLANS.get(plan_key, _MISSING)
    if plan is _MISSING:
        try:
            plan = _build(
                tree, spec, dtypes, shapes, layout, dim, sizes_given, grads, order, None, spec_bytes
            )
        except Exception:  # (the plain path names the problem)
            plan = None
        _PLANS.put(plan_key, plan)
    rows = [] if plan is None else [shapes[i][0] for i in plan.row_positions]
    found = _Seen(spec_bytes, dtypes, shapes, plan, rows)
    found.refuted = last is not None and last.refuted
    if key is not None:
        _LAST.put(key, found)
    return found


def _pickled(spec: PyTreeSpec) -> bytes:
    return pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)


def _signature(leaves: list[Any]) -> tuple[list[Any], list[Any]] | None:
    """Each leaf's shape and dtype (``None`` for non-tensors); ``None`` for a tree holding a
    tensor subclass (it travels pickled, as what it is). A nested tensor's size raises."""
    types = list(map(type, leaves))
    if types.count(Tensor) == len(types):
        return list(map(Tensor.size, leaves)), list(map(_DTYPE, leaves))
    shapes: list[Any] = []
    dtypes: list[Any] = []
    for x, kind in zip(leaves, types):
        if kind is Tensor:
            shapes.append(x.size())
            dtypes.append(x.dtype)
        elif isinstance(x, Tensor):
            return None
        else:
            shapes.append(None)
            dtypes.append(None)
    return shapes, dtypes


def _build(
    tree: Any,
    spec: PyTreeSpec,
    dtypes: Sequence[torch.dtype | None],
    shapes: Sequence[Any],
    layout: Any,
    dim: Any,
    sizes_given: bool,
    grads: tuple[int, ...] | None,
    order: bool,
    extra: dict[str, Any] | None,
    spec_bytes: bytes | None = None,
) -> Plan:
    """The plan for these dtypes and shapes, whatever their rows, with its header: to keep, with
    a digest the ranks compare (``spec_bytes`` given), or for one call (digest ``(0, 0)``)."""
    trailing = [None if s is None or len(s) == 0 else tuple(s[1:]) for s in shapes]
    regions, row_positions, objects = layout_of(dtypes, trailing)
    resolved = _layout.resolve(spec, layout, "gather", dim, ROOT)
    up_spec, groups = resolved.up_spec, None
    if up_spec is not spec:
        # Nodes taken whole may differ between ranks (per-sample lists of uneven length): their
        # structures travel in the header, and only the rest must match.
        subtrees = up_spec.flatten_up_to(tree)
        groups = {
            pos: _tree.flatten(subtrees[pos])[1]
            for pos, group in enumerate(resolved.groups)
            if group is not None
        }
    vectorised = (
        spec_bytes is not None
        and not grads
        and up_spec is spec
        and all(
            _default_cat(rule, dtypes[i], trailing[i], dim) for i, rule in enumerate(resolved.rules)
        )
    )
    key, shown = layout_text(layout, dim, grads is not None)
    content = {
        "fingerprint": fingerprint(up_spec) + (f":{','.join(map(str, groups))}" if groups else ""),
        "layout": (key, shown),
        "meta": [None if d is None else (_NAMES[d], t) for d, t in zip(dtypes, trailing)],
        "sizes_given": sizes_given,
        "grads": grads,
        "groups": groups,
        "parts": {},
        "batch": [bn.meta.size for bn in _tree.batch_nodes(up_spec)]
        if _tree.is_batched(up_spec)
        else None,
        "order": _or_none(_pickled, up_spec) if order else None,
        **(extra or {}),
    }
    header = pickle.dumps(content, protocol=pickle.HIGHEST_PROTOCOL)
    digest = (0, 0)
    if spec_bytes is not None:
        h = hashlib.blake2b(spec_bytes, digest_size=16)
        h.update(repr([(str(d), t) for d, t in zip(dtypes, trailing)]).encode())
        h.update(f"{key};sizes={sizes_given};{grads!r}".encode())
        raw = h.digest()
        # Two signed int64 for the first collective; (0, 0) is reserved for "no plan".
        digest = (
            int.from_bytes(raw[:8], "little", signed=True) or 1,
            int.from_bytes(raw[8:], "little", signed=True),
        )
    return Plan(
        digest, regions, objects, row_positions, sizes_given, vectorised, grads, header, spec
    )


def _or_none(fn: Any, value: Any) -> Any:
    try:
        return fn(value)
    except Exception:  # unpicklable node metadata: each rank keeps its own key order
        return None


def _default_cat(rule: Any, dtype: Any, trailing: Any, dim: Any) -> bool:
    """Whether a leaf combines as the default rule does: ``cat`` at dim 0, ``as_list``."""
    if dtype is None:
        return rule is None
    if rule is None:
        return type(dim) is int and dim == 0
    return type(rule) is Cat and type(rule.dim) is int and rule.dim == 0 and trailing is not None


def grad_positions(leaves: Sequence[Any]) -> tuple[int, ...]:
    """The positions of the leaves that require grad (what ``sync_grads`` connects): tensors,
    and values laid out by rows holding one."""
    if not torch.is_grad_enabled():
        return ()
    return tuple(i for i, x in enumerate(leaves) if _requires_grad(x))


def _requires_grad(x: Any) -> bool:
    if isinstance(x, Tensor):
        return x.requires_grad
    held = _tree.rows_of(x)
    return held is not None and held.requires_grad


def _detached(x: Any) -> Any:
    """``x``, or, laid out by rows, its value detached (what travels)."""
    by_rows = _tree.rows_of(x) if type(x) is not Tensor else None
    return x if by_rows is None else by_rows.detached().held


# -------------------------------------------------------------------------------- packing


# --------------------------------------------------------------------------- fingerprints


def fingerprint(spec: PyTreeSpec) -> str:
    """A digest of ``spec``: equal on two ranks iff their structures are equal.

    Type-aware (``True``, ``1`` and ``1.0`` as keys or node metadata differ), blind to batch
    nodes' batch sizes (each rank's travels in its header) and to dict insertion order (as
    ``PyTreeSpec`` equality is), computed without formatting anything.
    """
    nodes: list[Any] = []

    def node(kind: Any, data: Any, children: Any) -> None:
        if type(data) is _tree.Batched:  # (a batch size may differ between ranks)
            data = ("batched", data.key())
        nodes.append((kind, data, len(children)))

    spec.walk(range(spec.num_leaves), node, lambda _: nodes.append(0))
    try:
        data = pickle.dumps(nodes, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # a local class or unpicklable metadata: name them instead
        data = pickle.dumps(
            [
                n
                if n == 0
                else (
                    _qualname(n[0]),
                    _or_none(pickle.dumps, n[1]) or f"<{_qualname(type(n[1]))}>",
                    n[2],
                )
                for n in nodes
            ],
            protocol=pickle.HIGHEST_PROTOCOL,
        )
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _qualname(kind: Any) -> str:
    return f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', '?')}"


def leaf_paths(spec: PyTreeSpec) -> list[str]:
    return [_tree.format_path(ROOT, n.path) for n in _tree.nodes(spec) if n.spec.is_leaf()]


def _unpicklable(spec: PyTreeSpec, leaves: list[Any], exc: Exception) -> str:
    problems = []
    tensors = False
    for path, leaf in zip(leaf_paths(spec), leaves):
        if isinstance(leaf, Tensor) and pickling.plain(leaf):
            continue  # (its bytes travel)
        try:
            pickling.dumps(leaf)
        except Exception as leaf_exc:
            said = safe_repr(leaf_exc, 100, text=str)
            problem = f"{path}: {_tree.describe(leaf)} ({type(leaf_exc).__name__}: {said})"
            if isinstance(leaf, Tensor):
                tensors = True
                problem += f": {kinds.kind_text(leaf)} tensors cannot be pickled"
            problems.append(problem)
    if not problems:
        problems.append(f"the tree's structure ({type(exc).__name__}: {exc})")
    hint = "turn them into tensors, strings or numbers, or leave them out of the tree"
    if tensors:
        hint = (
            "convert such tensors first (e.g. .to_dense() for an mkldnn or sparse tensor); " + hint
        )
    return format_problems(
        "leaves must be picklable (tensors of most kinds are) to travel between ranks",
        problems,
        hint,
    )


def format_problems(title: str, problems: list[str], hint: str) -> str:
    shown = problems[:MAX_LISTED]
    if len(problems) > MAX_LISTED:
        shown.append(f"... and {len(problems) - MAX_LISTED} more")
    return f"{title}:\n" + "\n".join(f"  - {p}" for p in shown) + f"\nHint: {hint}"


def plan_count() -> int:
    """How many plans are kept (for tests)."""
    return len(_PLANS)
