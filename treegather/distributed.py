"""Gather pytrees across processes: treegather's layouts on ``torch.distributed``.

:func:`all_gather`, :func:`gather` and :func:`broadcast` move whole pytrees between the ranks of
a process group (gloo on CPU, NCCL on CUDA, any backend with all-gather, gather and broadcast) and
combine them with exactly the rules of the single-process :func:`treegather.gather`: ``cat``
with uneven sizes, ``stack``, ``mean`` weighted by ``sizes``, ``pad``, ``as_list``, ``first`` and
custom callables; non-tensor leaves default to ``as_list()``.

The number of collectives does not grow with the number of leaves. Each call flattens the tree
once and then issues:

1. one all-gather of a few integers per rank (the byte lengths below, the call, ``dst``/``src``);
2. one all-gather (``gather``: an all-gather of the headers, then one gather to ``dst``;
   ``broadcast``: one broadcast) of a single ``uint8`` buffer per rank holding a pickled header
   (structure fingerprint, per-leaf dtype and shape, the non-tensor leaves, ``sizes``) followed by
   the bytes of every tensor leaf, whatever its dtype, padded to the longest rank.

Packing bytes rather than one buffer per dtype keeps the count at two or three collectives for any
mix of dtypes, and carries ``bool``, ``bfloat16``, complex and float8 leaves on backends that do
not reduce them (only all-gather, gather and broadcast are used, which never look at the values).

Every rank checks every other rank's header the same way, so when the trees differ (a missing
key, a list against a tuple, a tensor against a string, mismatched dtypes or non-cat dims) every
rank raises the same :class:`~treegather.StructureMismatchError` (or the error the gather rule
raises), naming the leaf path and the ranks, instead of hanging in a mismatched collective or
returning garbage.

Results are new tensors, detached from autograd, built from the exchanged bytes on every rank
(the calling rank's contribution included), so all ranks compute bitwise-identical results; they
land on the device of this rank's tensor leaves (the communication device when those are spread
over several devices).

Security:
    Non-tensor leaves and the headers travel as :mod:`pickle` data and are unpickled on the
    receiving ranks, as with :func:`torch.distributed.all_gather_object`. Bytes are only ever
    received from the ranks of the process group you pass (or the default group), so the trust
    boundary is that of ``torch.distributed`` itself: only join process groups whose members you
    trust.
"""

from __future__ import annotations

import hashlib
import math
import pickle
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from optree import PyTreeSpec

from treegather import _layout, _tree
from treegather._errors import (
    BatchSizeError,
    LayoutError,
    LeafTypeError,
    ShapeMismatchError,
    StructureMismatchError,
    TreegatherError,
)
from treegather._gather import gather as _gather_local

__all__ = ["all_gather", "gather", "broadcast"]

_MAGIC = 0x7467_6472  # identifies a treegather preamble
_ALL_GATHER, _GATHER, _BROADCAST = 1, 2, 3
_CALL_NAMES = {_ALL_GATHER: "all_gather", _GATHER: "gather", _BROADCAST: "broadcast"}
_ALIGN = 16  # every region starts 16-byte aligned, so any dtype can be viewed in place
_ROOT = "outputs"  # how error messages name the tree (as treegather.gather does)
_MAX_LISTED = 10  # problems listed in one message before "... and N more"

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_DTYPE_NAMES: dict[torch.dtype, str] = {d: name for name, d in _DTYPES.items()}
_ITEMSIZES: dict[str, int] = {name: d.itemsize for name, d in _DTYPES.items()}
_ERROR_CLASSES: dict[str, type[TreegatherError]] = {
    cls.__name__: cls
    for cls in (
        BatchSizeError,
        LayoutError,
        LeafTypeError,
        ShapeMismatchError,
        StructureMismatchError,
        TreegatherError,
    )
}


# ------------------------------------------------------------------------------ process group


class _Group(NamedTuple):
    handle: Any  # the ProcessGroup, or None for the default group
    rank: int  # this process's rank in the group
    ranks: list[int]  # global rank of each group rank
    device: torch.device  # where the small exchanges run (torch's object-collective device)
    accelerator: torch.device | None  # this process's current accelerator, if the group has one


def _group(group: Any) -> _Group:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() "
            "on every rank (torchrun sets the environment it needs) before treegather.distributed."
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the process group passed as group=")
    handle = group if group is not None else dist.group.WORLD
    ranks = list(dist.get_process_group_ranks(handle))
    device = _comm_device(group)
    return _Group(group, rank, ranks, device, _group_accelerator(handle, device))


def _comm_device(group: Any) -> torch.device:
    """The device collectives of ``group`` run on: CPU for gloo, the current GPU for NCCL."""
    pick = getattr(dist.distributed_c10d, "_get_object_coll_device", None)
    if pick is not None:
        kind = pick(group)
    else:  # older torch: decide from the backend name
        kind = "cuda" if "nccl" in str(dist.get_backend(group)).lower() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)
    index = (
        module.current_device() if module is not None and hasattr(module, "current_device") else 0
    )
    return torch.device(kind, index)


def _group_accelerator(handle: Any, device: torch.device) -> torch.device | None:
    """This process's current accelerator, when the group has a native backend for it.

    ``"cpu:gloo,cuda:nccl"`` (torch's default on GPU machines) qualifies; plain ``"gloo"``
    (which torch lists as ``"cpu:gloo,cuda:gloo"``) does not: gloo stages GPU tensors through
    the CPU anyway.
    """
    if device.type != "cpu":
        return device
    try:
        config = str(dist.get_backend_config(handle))
    except (AttributeError, RuntimeError, ValueError):
        return None
    for entry in config.split(","):
        kind, _, backend = entry.partition(":")
        if kind in ("", "cpu") or backend in ("", "gloo"):
            continue
        module = getattr(torch, kind, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            return torch.device(kind, module.current_device())
    return None


def _placement(g: _Group, local: _Local) -> int:
    """What this rank's tensors want: 0 the exchange device, 1 the accelerator, 2 either."""
    if g.accelerator is None or g.device == g.accelerator:
        return 0
    if not local.devices:
        return 2
    return 1 if all(d.type == g.accelerator.type for d in local.devices) else 0


def _data_device(g: _Group, rows: Sequence[Sequence[int]]) -> torch.device:
    """Carry tensor bytes on the accelerator when every rank's tensors live there.

    A group with several backends (``"cpu:gloo,cuda:nccl"``, torch's default on GPU machines)
    runs object collectives on the CPU; tensors already on the GPU then go through NCCL instead.
    """
    flags = {r[5] for r in rows}
    if g.accelerator is not None and 0 not in flags and 1 in flags:
        return g.accelerator
    return g.device


def _root_rank(g: _Group, rank: int, name: str) -> int:
    """Map a global ``dst``/``src`` rank to its rank in the group."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank not in g.ranks:
        raise ValueError(f"{name}={rank!r} is not a rank of the process group (ranks {g.ranks})")
    return g.ranks.index(rank)


# ---------------------------------------------------------------------------------- encoding


class _Local(NamedTuple):
    spec: PyTreeSpec | None  # the whole tree's structure
    header: bytes
    chunks: tuple[torch.Tensor, ...] = ()  # uint8, 1-D: one per dtype group, in packing order
    nbytes: int = 0  # of all chunks together
    devices: frozenset[torch.device] = frozenset()  # of this rank's tensor leaves
    # The structure down to the nodes a whole-value rule (cat_items, as_list, first, a callable)
    # takes whole: only that part must match across ranks. ``spec`` when there are none.
    up_spec: PyTreeSpec | None = None


_FINGERPRINTS: dict[PyTreeSpec, str] = {}


def _fingerprint(spec: PyTreeSpec) -> str:
    try:
        return _FINGERPRINTS[spec]
    except (KeyError, TypeError):
        pass
    digest = hashlib.blake2b(repr(spec).encode(), digest_size=16).hexdigest()
    try:
        if len(_FINGERPRINTS) > 64:
            _FINGERPRINTS.clear()
        _FINGERPRINTS[spec] = digest
    except TypeError:  # unhashable node metadata
        pass
    return digest


def _leaf_paths(spec: PyTreeSpec) -> list[str]:
    return [_tree.format_path(_ROOT, n.path) for n in _tree.nodes(spec) if n.spec.is_leaf()]


def _pack_order(meta: Sequence[Any]) -> list[list[int]]:
    """Tensor leaf indices grouped by dtype, widest elements first.

    Laying groups out widest first keeps every leaf aligned to its element size inside a
    16-byte-aligned buffer, so each one is a zero-copy view of the received bytes.
    """
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(meta):
        if m is not None:
            groups.setdefault(m[0], []).append(i)
    order = sorted(groups, key=lambda name: (-_ITEMSIZES[name], name))
    return [groups[name] for name in order]


def _flat_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One dtype group as contiguous bytes (on the CPU when the tensors are spread out)."""
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        tensors = [t.cpu() for t in tensors]
    try:
        flat = torch._utils._flatten_dense_tensors(tensors)
    except (AttributeError, RuntimeError):  # pragma: no cover - fallback for exotic tensors
        flat = torch.cat([t.reshape(-1) for t in tensors])
    return flat.view(torch.uint8)


def _error_header(cls: type[TreegatherError], message: str) -> bytes:
    return pickle.dumps({"error": (cls.__name__, message)}, protocol=pickle.HIGHEST_PROTOCOL)


def _encode(
    tree: Any, sizes: Any, layout: Any = None, dim: int = 0, *, with_spec: bool = False
) -> _Local:
    """Flatten ``tree`` into a pickled header and one byte buffer of all its tensor leaves.

    Problems found here become an error header instead of an exception, so that every rank
    learns of them after the exchange and raises the same error instead of leaving the other
    ranks waiting in a collective.
    """
    if sizes is not None and (isinstance(sizes, bool) or not isinstance(sizes, int) or sizes < 0):
        message = f"sizes must be this rank's non-negative int (e.g. its batch size), got {sizes!r}"
        return _Local(None, _error_header(BatchSizeError, message))
    leaves, spec = _tree.flatten(tree)
    up_spec, groups = spec, None
    if layout is not None:
        try:
            plan = _layout.resolve(spec, layout, "gather", dim, _ROOT)
        except TreegatherError as exc:
            return _Local(spec, _error_header(type(exc), str(exc)))
        if plan.up_spec is not spec:
            # Nodes taken whole may differ between ranks (per-sample lists of uneven length):
            # each rank sends their structures, and only the rest must match.
            up_spec = plan.up_spec
            subtrees = up_spec.flatten_up_to(tree)
            groups = {
                pos: _tree.flatten(subtrees[pos])[1]
                for pos, group in enumerate(plan.groups)
                if group is not None
            }
    meta: list[tuple[Any, ...] | None] = []  # (dtype, shape[, device type]) or None per leaf
    objects: list[Any] = []
    bad: list[int] = []
    devices: set[torch.device] = set()
    strided = torch.strided
    names = _DTYPE_NAMES
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.layout is not strided or leaf.is_quantized or leaf.is_nested:
                bad.append(i)
            devices.add(leaf.device)
            if with_spec:
                meta.append((names[leaf.dtype], tuple(leaf.shape), leaf.device.type))
            else:
                meta.append((names[leaf.dtype], tuple(leaf.shape)))
        else:
            meta.append(None)
            objects.append(leaf)
    if bad:
        paths = _leaf_paths(spec)
        problems = [
            f"{paths[i]}: {_tree.describe(leaves[i])}, layout {leaves[i].layout}" for i in bad
        ]
        message = _problems(
            "cannot send sparse, quantized or nested tensors",
            problems,
            "convert them first (e.g. .to_dense() or .dequantize())",
        )
        return _Local(spec, _error_header(LeafTypeError, message))
    fingerprint = _fingerprint(up_spec)
    if groups:
        fingerprint += ":" + ",".join(map(str, groups))
    content = {
        "fingerprint": fingerprint,
        "meta": meta,
        "objects": objects,
        "groups": groups,
        "sizes": sizes,
        "spec": spec if with_spec else None,
    }
    try:
        header = pickle.dumps(content, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        return _Local(spec, _error_header(LeafTypeError, _unpicklable(spec, leaves, exc)))
    with torch.no_grad():
        chunks = tuple(_flat_bytes([leaves[i] for i in idx]) for idx in _pack_order(meta))
    nbytes = sum(c.numel() for c in chunks)
    return _Local(spec, header, chunks, nbytes, frozenset(devices), up_spec)


def _unpicklable(spec: PyTreeSpec, leaves: list[Any], exc: Exception) -> str:
    paths = _leaf_paths(spec)
    problems = []
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor):
            continue
        try:
            pickle.dumps(leaf, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as leaf_exc:
            problems.append(
                f"{path}: {_tree.describe(leaf)} ({type(leaf_exc).__name__}: {leaf_exc})"
            )
    if not problems:
        problems.append(f"the tree's structure ({type(exc).__name__}: {exc})")
    return _problems(
        "non-tensor leaves must be picklable to travel between ranks",
        problems,
        "turn them into tensors, strings or numbers, or leave them out of the tree",
    )


def _problems(title: str, problems: list[str], hint: str) -> str:
    shown = problems[:_MAX_LISTED]
    if len(problems) > _MAX_LISTED:
        shown.append(f"... and {len(problems) - _MAX_LISTED} more")
    return f"{title}:\n" + "\n".join(f"  - {p}" for p in shown) + f"\nHint: {hint}"


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _message_buffer(
    local: _Local, stride: int, device: torch.device, *, header: bool = True
) -> torch.Tensor:
    """``[header | pad | tensor bytes | pad]`` (or only the tensor bytes) as ``stride`` bytes."""
    buf = torch.zeros(stride, dtype=torch.uint8, device=device)
    start = 0
    if header:
        head = torch.frombuffer(bytearray(local.header), dtype=torch.uint8)
        buf[: head.numel()].copy_(head)
        start = _padded(head.numel())
    for chunk in local.chunks:
        buf[start : start + chunk.numel()].copy_(chunk)
        start += chunk.numel()
    return buf


# -------------------------------------------------------------------------------- collectives


def _all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _preamble(g: _Group, call: int, root: int, local: _Local) -> list[list[int]]:
    """Exchange each rank's call, root, byte lengths and placement; check the calls agree."""
    row = [_MAGIC, call, root, len(local.header), local.nbytes, _placement(g, local)]
    mine = torch.tensor(row, dtype=torch.int64)
    out = torch.empty(len(g.ranks) * len(row), dtype=torch.int64, device=g.device)
    _all_gather_into(out, mine.to(g.device), g.handle)
    rows = out.view(len(g.ranks), len(row)).tolist()
    calls = {(r[0], r[1], r[2]) for r in rows}
    if len(calls) > 1:
        described = [
            f"rank {g.ranks[i]}: "
            + (
                f"treegather.distributed.{_CALL_NAMES.get(r[1], '?')}"
                + (
                    f"(..., {'src' if r[1] == _BROADCAST else 'dst'}={g.ranks[r[2]]})"
                    if r[2] >= 0
                    else ""
                )
                if r[0] == _MAGIC
                else "not a treegather.distributed call"
            )
            for i, r in enumerate(rows)
        ]
        raise StructureMismatchError(
            _problems(
                "the ranks of the group made different treegather.distributed calls",
                described,
                "every rank must make the same call, with the same dst/src, in the same order",
            )
        )
    return rows


def _headers(
    buffers: torch.Tensor | Sequence[torch.Tensor], lengths: Sequence[int]
) -> list[dict[str, Any]]:
    return [pickle.loads(buf[:n].cpu().numpy().tobytes()) for buf, n in zip(buffers, lengths)]


# -------------------------------------------------------------------------------- validation


def _check(g: _Group, headers: list[dict[str, Any]], local: _Local) -> None:
    """Raise the same error on every rank when a rank failed or the trees disagree."""
    errors = [(i, h["error"]) for i, h in enumerate(headers) if "error" in h]
    if errors:
        cls = _ERROR_CLASSES.get(errors[0][1][0], TreegatherError)
        by_message: dict[str, list[int]] = {}
        for i, (_, msg) in errors:
            by_message.setdefault(msg, []).append(g.ranks[i])
        raise cls(
            "\n".join(
                f"on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {msg}"
                for msg, rs in by_message.items()
            )
        )
    if len({h["fingerprint"] for h in headers}) > 1:
        _raise_structure_mismatch(g, headers, local)
    assert local.up_spec is not None
    kinds = [_up_kinds(h, local.up_spec.num_leaves) for h in headers]
    if any(k != kinds[0] for k in kinds[1:]):
        paths = _leaf_paths(local.up_spec)
        mixed, dtypes = [], []
        for j, path in enumerate(paths):
            per_rank = [k[j] for k in kinds]
            if len(set(per_rank)) == 1:
                continue
            tensors = [p is not None and p.startswith("Tensor(") for p in per_rank]
            if len(set(tensors)) > 1:
                described = [_describe_up(h, j, k) for h, k in zip(headers, per_rank)]
                mixed.append(f"{path}: " + _by_rank(g, described))
            elif all(tensors):
                dtypes.append(f"{path}: " + _by_rank(g, [p[7:-1] for p in per_rank if p]))
        if mixed:
            raise StructureMismatchError(
                _problems(
                    "leaves are tensors on some ranks and other objects on others",
                    mixed,
                    "every rank must pass a tensor at the same paths (e.g. torch.tensor(x) for "
                    "numbers)",
                )
            )
        raise ShapeMismatchError(
            _problems(
                "tensor leaves have different dtypes on different ranks",
                dtypes,
                "cast them to one dtype on every rank before gathering (e.g. .float())",
            )
        )
    sizes = [h["sizes"] for h in headers]
    if len({s is None for s in sizes}) > 1:
        raise BatchSizeError(
            "sizes= was passed on some ranks only: "
            + _by_rank(g, ["None" if s is None else str(s) for s in sizes])
            + "\nHint: pass sizes= (this rank's batch size) on every rank, or on none"
        )


def _up_kinds(header: dict[str, Any], n: int) -> list[str | None]:
    """Per leaf of the up-structure: ``"Tensor(dtype)"``, ``"object"``, or None (taken whole)."""
    meta, groups = header["meta"], header["groups"] or {}
    if not groups:
        return ["object" if m is None else f"Tensor({m[0]})" for m in meta]
    out: list[str | None] = []
    k = 0
    for pos in range(n):
        sub = groups.get(pos)
        if sub is not None:
            out.append(None)
            k += sub.num_leaves
        else:
            m = meta[k]
            out.append("object" if m is None else f"Tensor({m[0]})")
            k += 1
    return out


def _describe_up(header: dict[str, Any], pos: int, kind: str | None) -> str:
    """``kind`` with an object's type name instead of ``"object"``."""
    if kind != "object":
        return str(kind)
    leaves = _decode(header, torch.empty(0, dtype=torch.uint8), tensors=False)
    groups = header["groups"] or {}
    k = sum(groups[p].num_leaves if p in groups else 1 for p in range(pos))
    return type(leaves[k]).__qualname__


def _by_rank(g: _Group, values: Sequence[str]) -> str:
    """``'float32 on ranks 0, 2; int64 on rank 1'``."""
    seen: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        seen.setdefault(v, []).append(g.ranks[i])
    return "; ".join(
        f"{v} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
        for v, rs in seen.items()
    )


def _raise_structure_mismatch(g: _Group, headers: list[dict[str, Any]], local: _Local) -> None:
    """Exchange the node paths (only on this error path) and name every difference."""
    assert local.up_spec is not None
    described = [
        (_tree.format_path(_ROOT, n.path), _node_name(n.spec)) for n in _tree.nodes(local.up_spec)
    ]
    per_rank = [dict(d) for d in _all_gather_bytes(g, pickle.dumps(described))]
    all_paths: dict[str, None] = {}
    for d in per_rank:
        all_paths.update(dict.fromkeys(d))
    problems: list[str] = []
    reported: list[str] = []
    for path in all_paths:
        values = [d.get(path, "missing") for d in per_rank]
        if len(set(values)) == 1:
            continue
        # Below a node reported as missing or of another type, every path differs too.
        if any(path.startswith(p) and path[len(p)] in "[." for p in reported):
            continue
        reported.append(path)
        problems.append(f"{path}: " + _by_rank(g, values))
    raise StructureMismatchError(
        _problems(
            "the ranks passed trees of different structure",
            problems or ["same paths and node types, but different node metadata (static fields)"],
            "every rank must pass the same keys, fields and lengths; use the same placeholder "
            "on every rank for values a rank does not have",
        )
    )


def _node_name(spec: PyTreeSpec) -> str:
    if spec.is_leaf():
        return "a leaf"
    if spec.kind == spec.kind.NONE:
        return "None"
    node_type = spec.type
    return node_type.__qualname__ if node_type is not None else str(spec.kind)


def _all_gather_bytes(g: _Group, payload: bytes) -> list[Any]:
    """All-gather one pickled object per rank (two collectives)."""
    n = len(payload)
    lengths = torch.empty(len(g.ranks), dtype=torch.int64, device=g.device)
    _all_gather_into(lengths, torch.tensor([n], dtype=torch.int64, device=g.device), g.handle)
    sizes = lengths.tolist()
    stride = max(sizes)
    mine = torch.zeros(stride, dtype=torch.uint8, device=g.device)
    mine[:n].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    out = torch.empty(stride * len(g.ranks), dtype=torch.uint8, device=g.device)
    _all_gather_into(out, mine, g.handle)
    return [
        pickle.loads(buf[:k].cpu().numpy().tobytes())
        for buf, k in zip(out.view(len(g.ranks), stride), sizes)
    ]


# ---------------------------------------------------------------------------------- decoding


def _decode(header: dict[str, Any], data: torch.Tensor, *, tensors: bool = True) -> list[Any]:
    """Rebuild one rank's leaves: tensors as views of ``data``, objects from the header."""
    meta = header["meta"]
    leaves: list[Any] = [None] * len(meta)
    objects = iter(header["objects"])
    for i, m in enumerate(meta):
        if m is None:
            leaves[i] = next(objects)
    if not tensors:
        return leaves
    offset = 0
    for idx in _pack_order(meta):
        dtype = _DTYPES[meta[idx[0]][0]]
        numels = [math.prod(meta[i][1]) for i in idx]
        nbytes = sum(numels) * _ITEMSIZES[meta[idx[0]][0]]
        region = data[offset : offset + nbytes].view(dtype)
        offset += nbytes
        for i, part in zip(idx, region.split(numels)):
            leaves[i] = part.view(meta[i][1])
    return leaves


def _rank_tree(local: _Local, header: dict[str, Any], leaves: list[Any]) -> Any:
    """One rank's tree from its leaves: the shared up-structure, the rank's own whole nodes."""
    assert local.up_spec is not None
    groups = header["groups"]
    if not groups:
        return local.up_spec.unflatten(leaves)
    up: list[Any] = []
    k = 0
    for pos in range(local.up_spec.num_leaves):
        sub = groups.get(pos)
        if sub is None:
            up.append(leaves[k])
            k += 1
        else:
            up.append(sub.unflatten(leaves[k : k + sub.num_leaves]))
            k += sub.num_leaves
    return local.up_spec.unflatten(up)


def _target_device(local: _Local, carrier: torch.device) -> torch.device:
    """Results go where this rank's tensors are; if they are spread out, where the bytes came."""
    if len(local.devices) == 1:
        return next(iter(local.devices))
    return carrier if local.devices else torch.device("cpu")


def _combine(
    g: _Group, trees: list[Any], device: torch.device, layout: Any, dim: int, sizes: list[Any]
) -> Any:
    """Apply the single-process gather rules to the per-rank trees (replica i = group rank i)."""
    try:
        return _gather_local(
            trees, device, layout, dim=dim, sizes=None if sizes[0] is None else sizes
        )
    except TreegatherError as exc:
        if g.ranks == list(range(len(g.ranks))):
            note = "(replica i above is rank i)"
        else:
            note = f"(replica i above is the group's rank i, global ranks {g.ranks})"
        raise type(exc)(f"{exc}\n{note}") from None


# -------------------------------------------------------------------------------- public API


def all_gather(
    tree: Any,
    layout: Any = None,
    *,
    group: Any = None,
    dim: int = 0,
    sizes: int | None = None,
) -> Any:
    """Gather every rank's ``tree`` onto every rank, combined leaf by leaf with ``layout``.

    The distributed counterpart of :func:`treegather.gather`, with the ranks of ``group`` as
    the replicas (in rank order): tensors are concatenated along ``dim`` by default (uneven
    lengths allowed; 0-dim tensors become a vector), other leaves become a list with one value
    per rank, and ``layout`` picks other rules (``stack``, ``mean``, ``pad``, ``first``, a custom
    callable, ...) for the whole tree, a prefix of it, or :func:`~treegather.by_path` patterns.

    Whatever the tree, this costs two collectives (see the module docstring). Every rank must
    call it with a tree of the same structure and the same ``layout``/``dim``; otherwise every
    rank raises the same error.

    Args:
        tree: This rank's pytree (tensors on the rank's device, strings, numbers, ``None``,
            registered containers).
        layout: How to combine each leaf across ranks, as for :func:`treegather.gather`;
            ``None`` for the defaults.
        group: The process group; ``None`` for the default group.
        dim: The dimension ``cat`` and ``stack`` work along.
        sizes: This rank's weight for ``mean()`` (e.g. its batch size); exchanged with the
            others. Pass it on every rank or on none.

    Returns:
        The combined tree, identical on every rank, on the device of this rank's tensors.

    Raises:
        StructureMismatchError: The ranks' trees differ in structure (the message names the
            path and the ranks) or the ranks made different calls.
        ShapeMismatchError: A rule cannot combine the ranks' tensors (dtypes, other dims).
        BatchSizeError: ``sizes`` is not an int, or was passed on some ranks only.
        LeafTypeError: A leaf cannot travel (unpicklable object, sparse tensor).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import treegather as tg, treegather.distributed as tgd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> rank = dist.get_rank()  # every rank runs the same code
        >>> out = {"ids": torch.arange(rank + 2), "loss": torch.tensor(0.5), "name": f"r{rank}"}
        >>> tgd.all_gather(out)
        {'ids': tensor([0, 1]), 'loss': tensor([0.5000]), 'name': ['r0']}
        >>> tgd.all_gather(out, {"ids": tg.cat(), "loss": tg.mean(), "name": tg.first()}, sizes=2)
        {'ids': tensor([0, 1]), 'loss': tensor(0.5000), 'name': 'r0'}
        >>> dist.destroy_process_group()
    """
    g = _group(group)
    local = _encode(tree, sizes, layout, dim)
    rows = _preamble(g, _ALL_GATHER, -1, local)
    device = _data_device(g, rows)
    stride = max(_padded(r[3]) + _padded(r[4]) for r in rows)
    out = torch.empty(stride * len(g.ranks), dtype=torch.uint8, device=device)
    _all_gather_into(out, _message_buffer(local, stride, device), g.handle)
    buffers = out.view(len(g.ranks), stride)
    headers = _headers(buffers, [r[3] for r in rows])
    _check(g, headers, local)
    trees = [
        _rank_tree(local, h, _decode(h, buf[_padded(r[3]) :]))
        for h, buf, r in zip(headers, buffers, rows)
    ]
    target = _target_device(local, device)
    return _combine(g, trees, target, layout, dim, [h["sizes"] for h in headers])


def gather(
    tree: Any,
    dst: int = 0,
    layout: Any = None,
    *,
    group: Any = None,
    dim: int = 0,
    sizes: int | None = None,
) -> Any:
    """Gather every rank's ``tree`` onto rank ``dst`` only; the other ranks get ``None``.

    Same rules and arguments as :func:`all_gather`, but tensor bytes travel only to ``dst``
    (three collectives: lengths, headers to every rank, tensor bytes to ``dst``). The headers
    reach every rank, and every rank checks them and runs the gather rules once on ``meta``
    tensors (shapes only, no data), so a structure, dtype or shape mismatch raises the same
    error on every rank, not only on ``dst``.

    Args:
        tree: This rank's pytree.
        dst: The global rank that receives the result (as in :func:`torch.distributed.gather`).
        layout: How to combine each leaf across ranks, as for :func:`treegather.gather`.
        group: The process group; ``None`` for the default group.
        dim: The dimension ``cat`` and ``stack`` work along.
        sizes: This rank's weight for ``mean()`` (e.g. its batch size).

    Returns:
        The combined tree on ``dst`` (on the device of ``dst``'s tensors); ``None`` elsewhere.

    Raises:
        StructureMismatchError: The ranks' trees differ in structure, or ranks disagree on ``dst``.
        ShapeMismatchError: A rule cannot combine the ranks' tensors.
        BatchSizeError: ``sizes`` is not an int, or was passed on some ranks only.
        LeafTypeError: A leaf cannot travel.

    Example:
        >>> import torch, torch.distributed as dist
        >>> import treegather as tg, treegather.distributed as tgd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> preds = {"logits": torch.ones(3, 2), "ids": ["a", "b", "c"]}  # per-sample ids
        >>> tgd.gather(preds, dst=0, layout={"logits": tg.cat(), "ids": tg.cat_items()})
        {'logits': tensor([[1., 1.], [1., 1.], [1., 1.]]), 'ids': ['a', 'b', 'c']}
        >>> dist.destroy_process_group()
    """
    g = _group(group)
    root = _root_rank(g, dst, "dst")
    local = _encode(tree, sizes, layout, dim)
    rows = _preamble(g, _GATHER, root, local)
    head_stride = max(r[3] for r in rows)
    mine = torch.zeros(head_stride, dtype=torch.uint8, device=g.device)
    mine[: len(local.header)].copy_(torch.frombuffer(bytearray(local.header), dtype=torch.uint8))
    out = torch.empty(head_stride * len(g.ranks), dtype=torch.uint8, device=g.device)
    _all_gather_into(out, mine, g.handle)
    headers = _headers(out.view(len(g.ranks), head_stride), [r[3] for r in rows])
    _check(g, headers, local)
    assert local.spec is not None
    all_sizes = [h["sizes"] for h in headers]
    _dry_run(g, local, headers, layout, dim, all_sizes)
    data_stride = _padded(max(r[4] for r in rows))  # keeps every row 16-byte aligned
    device = _data_device(g, rows)
    received: list[torch.Tensor] | None = None
    if data_stride:
        send = _message_buffer(local, data_stride, device, header=False)
        if g.rank == root:
            out = torch.empty(len(g.ranks), data_stride, dtype=torch.uint8, device=device)
            received = list(out.unbind(0))
        dist.gather(send, received, dst=dst, group=g.handle)
    if g.rank != root:
        return None
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    trees = [
        _rank_tree(local, h, _decode(h, received[i] if received is not None else empty))
        for i, h in enumerate(headers)
    ]
    return _combine(g, trees, _target_device(local, device), layout, dim, all_sizes)


def _dry_run(
    g: _Group,
    local: _Local,
    headers: list[dict[str, Any]],
    layout: Any,
    dim: int,
    sizes: list[Any],
) -> None:
    """Run the gather rules on shape-only ``meta`` tensors, so every rank sees rule errors."""
    trees = []
    for h in headers:
        objects = iter(h["objects"])
        leaves = [
            next(objects) if m is None else torch.empty(m[1], dtype=_DTYPES[m[0]], device="meta")
            for m in h["meta"]
        ]
        trees.append(_rank_tree(local, h, leaves))
    try:
        _combine(g, trees, torch.device("meta"), layout, dim, sizes)
    except TreegatherError:
        raise
    except Exception:
        pass


def broadcast(tree: Any, src: int = 0, *, group: Any = None) -> Any:
    """Send rank ``src``'s ``tree`` to every rank of the group.

    Two collectives whatever the tree. The other ranks' ``tree`` is ignored (pass ``None``);
    they receive new tensors on their own device of the same kind as ``src``'s (their current
    CUDA device for CUDA tensors, CPU for CPU tensors or when they have no such device), and
    unpickled copies of the non-tensor leaves. Rank ``src`` gets its own ``tree`` back.

    Args:
        tree: The pytree to send, on rank ``src``; ignored on the other ranks.
        src: The global rank that sends (as in :func:`torch.distributed.broadcast`).
        group: The process group; ``None`` for the default group.

    Returns:
        Rank ``src``'s tree, on every rank.

    Raises:
        StructureMismatchError: The ranks disagree on ``src``.
        LeafTypeError: A leaf of ``src``'s tree cannot travel.

    Example:
        >>> import torch, torch.distributed as dist
        >>> import treegather.distributed as tgd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> config = {"seed": 1234, "weights": torch.tensor([0.25, 0.75])} if dist.get_rank() == 0 else None
        >>> tgd.broadcast(config, src=0)
        {'seed': 1234, 'weights': tensor([0.2500, 0.7500])}
        >>> dist.destroy_process_group()
    """
    g = _group(group)
    root = _root_rank(g, src, "src")
    local = _encode(tree, None, with_spec=True) if g.rank == root else _Local(None, b"")
    rows = _preamble(g, _BROADCAST, root, local)
    device = _data_device(g, rows)
    head_len, data_len = rows[root][3], rows[root][4]
    stride = _padded(head_len) + data_len
    if g.rank == root:
        buf = _message_buffer(local, stride, device)
    else:
        buf = torch.empty(stride, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=g.handle)
    header = _headers([buf], [head_len])[0]
    if "error" in header:
        cls = _ERROR_CLASSES.get(header["error"][0], TreegatherError)
        raise cls(f"on rank {src}: {header['error'][1]}")
    if g.rank == root:
        return tree
    leaves = _decode(header, buf[_padded(head_len) :])
    for i, m in enumerate(header["meta"]):
        if m is not None:
            leaves[i] = leaves[i].to(_receiving_device(m[2]), copy=True)
    return header["spec"].unflatten(leaves)


def _receiving_device(kind: str) -> torch.device:
    """This rank's device of the kind the sender's tensor was on (its current one), else CPU."""
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)
    if module is not None and getattr(module, "is_available", lambda: False)():
        return torch.device(kind, module.current_device())
    return torch.device("cpu")
