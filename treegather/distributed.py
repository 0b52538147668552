"""Gather pytrees across processes: treegather's layouts on ``torch.distributed``.

:func:`all_gather`, :func:`gather` and :func:`broadcast` move whole pytrees between the ranks of
a process group (gloo on CPU, NCCL on CUDA, any backend with all-gather, gather and broadcast) and
combine them with exactly the rules of the single-process :func:`treegather.gather`: ``cat``
with uneven sizes, ``stack``, ``mean`` weighted by ``sizes``, ``pad``, ``as_list``, ``first`` and
custom callables; non-tensor leaves default to ``as_list()``.

The number of collectives does not grow with the number of leaves. Each call flattens the tree
once and computes a digest of what the ranks must agree on (structure, dict key order and node
metadata, each leaf's dtype and trailing shape, ``layout`` and ``dim``, whether ``sizes`` was
passed), cached in a bounded, type-aware wire plan (see :mod:`treegather._wireplan`). Then:

1. one all-gather of a few integers per rank: the call, ``dst``/``src``, the payload length and
   that digest;
2. when every rank sent the same digest (the usual case: a repeated structure, only the batch
   rows varying): one all-gather (``gather``: a gather to ``dst``) of each rank's payload, its
   row counts followed by one region per dtype and trailing shape written by a single
   ``torch.cat`` straight into the output, and the pickled non-tensor leaves if there are any.
   No header, and no pickle at all for an all-tensor tree; for the default rules the result
   comes out of one ``cat`` per region. Otherwise, every rank alike takes the full exchange:
   one more length exchange and one all-gather of a ``uint8`` buffer per rank holding a pickled
   header (structure fingerprint, layout and dim, per-leaf dtype and shape, the non-tensor
   leaves, ``sizes``) followed by the bytes of every tensor leaf, padded to the longest rank.
   The full exchange is the definition of results and errors; the digest path is a cheaper
   way to the same result;
3. ``gather`` only: one small broadcast of the outcome from ``dst`` (a second one carries the
   error message when there is one).

So a repeated structure costs two collectives (``gather``: three), one whose digests differ
three (four), and a structure mismatch two more, to name every difference. :func:`broadcast`
always sends the header (the receivers have no structure of their own to compare): one length
exchange and one broadcast.
Packing bytes rather than one buffer per dtype keeps the count fixed for any mix of dtypes, and
carries ``bool``, ``bfloat16``, complex and float8 leaves on backends that do not reduce them
(only all-gather, gather and broadcast are used, which never look at the values). Conjugate and
negative views travel as their values. See :mod:`treegather._wire` for the full format.

Every rank checks every other rank's header the same way (``gather``: ``dst`` checks and
broadcasts the outcome), so when the trees differ (a missing
key, a list against a tuple, a tensor against a string, mismatched dtypes or non-cat dims,
``sizes=`` on some ranks only, another ``dst``, another ``layout`` or ``dim``) every rank raises
the same error, naming the
leaf path and the ranks, instead of hanging in a mismatched collective or returning garbage.
Problems found before the exchange (an unpicklable leaf, a layout that does not fit) travel in
the header too, so that the other ranks raise them as well rather than wait. Nodes that the
layout takes whole (``cat_items()``, ``as_list()``, ``first()``, a callable on an inner node)
may differ between ranks, like per-sample lists of uneven length; their structure travels in
the header.

Results are new tensors, detached from autograd, built from the exchanged bytes on every rank
(the calling rank's contribution included), so all ranks compute bitwise-identical results, with
rank 0's dict key order when ranks inserted keys in different orders; they
land on the device of this rank's tensor leaves (the communication device when those are spread
over several devices). Bytes travel on the device torch uses for object collectives (CPU for
gloo, the current GPU for NCCL), or on the GPU when a group with several backends (torch's
default ``cpu:gloo,cuda:nccl``) holds GPU tensors on every rank.

Security:
    Non-tensor leaves and the headers travel as :mod:`pickle` data and are unpickled on the
    receiving ranks, as with :func:`torch.distributed.all_gather_object`. Bytes are only ever
    received from the ranks of the process group you pass (or the default group), so the trust
    boundary is that of ``torch.distributed`` itself: only join process groups whose members you
    trust.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from optree import PyTreeSpec

from treegather import _tree, _wire, _wireplan
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


def _placement(g: _Group, devices: frozenset[torch.device]) -> int:
    """What this rank's tensors want: 0 the exchange device, 1 the accelerator, 2 either."""
    if g.accelerator is None or g.device == g.accelerator:
        return 0
    if not devices:
        return 2
    return 1 if all(d.type == g.accelerator.type for d in devices) else 0


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


# -------------------------------------------------------------------------------- collectives


def _all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _describe_call(g: _Group, row: Sequence[int]) -> str:
    magic, call, root = row[:3]
    if magic != _MAGIC:
        return "not a treegather.distributed call"
    text = f"treegather.distributed.{_CALL_NAMES.get(call, '?')}"
    if 0 <= root < len(g.ranks):
        text += f"(..., {'src' if call == _BROADCAST else 'dst'}={g.ranks[root]})"
    return text


def _preamble(
    g: _Group,
    call: int,
    root: int,
    lengths: tuple[int, int],
    devices: frozenset[torch.device],
    digest: tuple[int, int] = (0, 0),
) -> list[list[int]]:
    """Exchange each rank's call, root, byte lengths, placement and wire-plan digest.

    Checks that the ranks made the same call; ``digest`` is :mod:`treegather._wireplan`'s
    (``(0, 0)`` on the full exchange, or when this rank has no plan).
    """
    row = [_MAGIC, call, root, *lengths, _placement(g, devices), *digest]
    mine = torch.tensor(row, dtype=torch.int64)
    out = torch.empty(len(g.ranks) * len(row), dtype=torch.int64, device=g.device)
    _all_gather_into(out, mine.to(g.device), g.handle)
    rows = out.view(len(g.ranks), len(row)).tolist()
    if len({(r[0], r[1], r[2]) for r in rows}) > 1:
        raise StructureMismatchError(
            _wire.format_problems(
                "the ranks of the group made different treegather.distributed calls",
                [f"rank {g.ranks[i]}: {_describe_call(g, r)}" for i, r in enumerate(rows)],
                "every rank must make the same call, with the same dst/src, in the same order",
            )
        )
    return rows


# -------------------------------------------------------------------------------- validation


class _StructuresDiffer(Exception):
    """The fingerprints differ: every rank must join :func:`_raise_structure_mismatch`."""


def _check(g: _Group, headers: list[dict[str, Any]], local: _wire.Packed) -> None:
    """Raise when a rank failed or the trees disagree (the same error wherever it runs).

    Raises :class:`_StructuresDiffer` when the structures differ: naming the differences takes
    one more exchange, which every rank must then join.
    """
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
    layouts = [h["layout"] for h in headers]
    if len({key for key, _ in layouts}) > 1:
        raise LayoutError(
            _wire.format_problems(
                "the ranks passed different layouts or dims (each rank would combine the trees "
                "with other rules)",
                [f"{shown} on {_ranks_text(g, rs)}" for shown, rs in _group_by(layouts)],
                "pass the same layout= and dim= on every rank",
            )
        )
    if len({h["fingerprint"] for h in headers}) > 1:
        raise _StructuresDiffer
    assert local.up_spec is not None
    kinds = [_wire.up_kinds(h, local.up_spec.num_leaves) for h in headers]
    if any(k != kinds[0] for k in kinds[1:]):
        paths = _wire.leaf_paths(local.up_spec)
        mixed, dtypes = [], []
        for j, path in enumerate(paths):
            per_rank = [k[j] for k in kinds]
            if len(set(per_rank)) == 1:
                continue
            tensors = [p is not None and p.startswith("Tensor(") for p in per_rank]
            if len(set(tensors)) > 1:
                described = [_wire.describe_up(h, j, k) for h, k in zip(headers, per_rank)]
                mixed.append(f"{path}: " + _by_rank(g, described))
            elif all(tensors):
                dtypes.append(f"{path}: " + _by_rank(g, [p[7:-1] for p in per_rank if p]))
        if mixed:
            raise StructureMismatchError(
                _wire.format_problems(
                    "leaves are tensors on some ranks and other objects on others",
                    mixed,
                    "every rank must pass a tensor at the same paths (e.g. torch.tensor(x) for "
                    "numbers)",
                )
            )
        raise ShapeMismatchError(
            _wire.format_problems(
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


def _group_by(values: Sequence[tuple[str, str]]) -> list[tuple[str, list[int]]]:
    """``(key, shown)`` per rank -> ``(shown, group ranks)`` per distinct key, in rank order."""
    seen: dict[str, tuple[str, list[int]]] = {}
    for i, (key, shown) in enumerate(values):
        seen.setdefault(key, (shown, []))[1].append(i)
    return list(seen.values())


def _ranks_text(g: _Group, ranks: Sequence[int]) -> str:
    """``'rank 1'``, ``'ranks 0, 2'`` (global ranks)."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(g.ranks[i]) for i in ranks)}"


def _by_rank(g: _Group, values: Sequence[str]) -> str:
    """``'float32 on ranks 0, 2; int64 on rank 1'``."""
    seen: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        seen.setdefault(v, []).append(g.ranks[i])
    return "; ".join(
        f"{v} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
        for v, rs in seen.items()
    )


def _raise_structure_mismatch(g: _Group, local: _wire.Packed) -> None:
    """Exchange the node paths (only on this error path) and name every difference."""
    assert local.up_spec is not None
    described = [
        (_tree.format_path(_wire.ROOT, n.path), _node_name(n.spec))
        for n in _tree.nodes(local.up_spec)
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
        _wire.format_problems(
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


def _target_device(devices: frozenset[torch.device], carrier: torch.device) -> torch.device:
    """Results go where this rank's tensors are; if they are spread out, where the bytes came."""
    if len(devices) == 1:
        return next(iter(devices))
    return carrier if devices else torch.device("cpu")


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

    A repeated structure (only the batch rows changing) costs two collectives and no pickling
    for an all-tensor tree; see the module docstring for the rest. Every rank must
    call it with a tree of the same structure (nodes the layout takes whole, such as per-sample
    lists under ``cat_items()``, may differ) and the same ``layout``/``dim``; otherwise every
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
        LayoutError: ``layout`` does not fit the tree.

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
    if _FAST_PATH:
        fast = _wireplan.prepare(tree, layout, dim, sizes)
        rows = _fast_preamble(g, _ALL_GATHER, -1, fast)
        if fast is not None and _digests_agree(rows):
            device = _data_device(g, rows)
            stride = _wireplan.padded(max(r[4] for r in rows))
            out = torch.empty(stride * len(g.ranks), dtype=torch.uint8, device=device)
            # In place: this rank's payload is packed straight into its own slot of the output
            # (no send buffer; NCCL and gloo both accept an input that is the rank's chunk).
            mine = out[g.rank * stride : (g.rank + 1) * stride]
            _fast_send(fast, stride, device, mine)
            _all_gather_into(out, mine, g.handle)
            buffers = list(out.view(len(g.ranks), stride))
            return _fast_combine(g, fast, buffers, [r[4] for r in rows], device, layout, dim)
    return _full_all_gather(g, tree, layout, dim, sizes)


def _full_all_gather(g: _Group, tree: Any, layout: Any, dim: int, sizes: int | None) -> Any:
    """The full exchange: one header and bytes per rank, every check; the definition."""
    local = _wire.encode(tree, sizes, layout, dim, order=g.rank == 0)
    rows = _preamble(g, _ALL_GATHER, -1, (len(local.header), local.nbytes), local.devices)
    device = _data_device(g, rows)
    stride = max(_wire.padded(r[3]) + _wire.padded(r[4]) for r in rows)
    out = torch.empty(stride * len(g.ranks), dtype=torch.uint8, device=device)
    _all_gather_into(out, _wire.message_buffer(local, stride, device), g.handle)
    buffers = out.view(len(g.ranks), stride)
    headers = _wire.read_headers(buffers, [r[3] for r in rows])
    try:
        _check(g, headers, local)
    except _StructuresDiffer:
        _raise_structure_mismatch(g, local)
    up_spec = _wire.agreed_up_spec(headers, local)
    trees = [
        _wire.rank_tree(up_spec, h, _wire.decode(h, buf[_wire.padded(r[3]) :]))
        for h, buf, r in zip(headers, buffers, rows)
    ]
    target = _target_device(local.devices, device)
    return _combine(g, trees, target, layout, dim, [h["sizes"] for h in headers])


# ------------------------------------------------------------------------------- fast path

_FAST_PATH = True  # tests turn it off to run every case through the full exchange


def _fast_send(
    fast: _wireplan.Local, stride: int, device: torch.device, buf: torch.Tensor
) -> torch.Tensor:
    """Pack this rank's payload into ``buf`` (``stride`` bytes on ``device``) and return it.

    Each region is one ``cat`` straight into the buffer. When the tensors live on another
    device than the bytes travel on (GPU tensors on gloo), they are packed there and moved in
    one copy for the whole tree instead of one per leaf.
    """
    home = next(iter(fast.devices)) if fast.devices else device
    if home == device:
        _wireplan.payload(fast, buf)
    else:
        staged = torch.empty(stride, dtype=torch.uint8, device=home)
        _wireplan.payload(fast, staged)
        buf.copy_(staged)
    return buf


def _fast_preamble(
    g: _Group, call: int, root: int, fast: _wireplan.Local | None
) -> list[list[int]]:
    if fast is None:
        return _preamble(g, call, root, (0, 0), frozenset())
    return _preamble(g, call, root, (0, fast.nbytes), fast.devices, fast.plan.digest)


def _digests_agree(rows: Sequence[Sequence[int]]) -> bool:
    """Every rank has a wire plan, and the same one (same structure, dtypes, layout, ...)."""
    return rows[0][6:8] != [0, 0] and all(r[6:8] == rows[0][6:8] for r in rows)


def _fast_combine(
    g: _Group,
    fast: _wireplan.Local,
    buffers: Sequence[torch.Tensor],
    nbytes: list[int],
    carrier: torch.device,
    layout: Any,
    dim: int,
) -> Any:
    """Combine the ranks' payloads: vectorised for the default rules, else the rules as usual."""
    plan = fast.plan
    target = _target_device(fast.devices, carrier)
    received = _wireplan.parse(plan, buffers, nbytes, target)
    if plan.vectorised:
        return _wireplan.unpack(plan, received)
    trees = [plan.spec.unflatten(leaves) for leaves in _wireplan.rank_leaves(plan, received)]
    sizes: list[Any] = received.sizes if received.sizes is not None else [None]
    return _combine(g, trees, target, layout, dim, sizes)


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

    Same rules and arguments as :func:`all_gather`, but the bytes travel only to ``dst``
    (three collectives: lengths, one gather to ``dst``, and a small broadcast of the outcome
    from ``dst``). ``dst`` checks the headers and applies the rules, then tells the other
    ranks how it went, so that a structure, dtype or shape mismatch (or any error in a custom
    rule) raises on every rank, not only on ``dst``: the same error for treegather's own
    errors, a ``RuntimeError`` naming the original otherwise. The other ranks therefore
    return once ``dst`` has finished.

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
    if _FAST_PATH:
        fast = _wireplan.prepare(tree, layout, dim, sizes)
        rows = _fast_preamble(g, _GATHER, root, fast)
        if fast is not None and _digests_agree(rows):
            device = _data_device(g, rows)
            stride = _wireplan.padded(max(r[4] for r in rows))
            send = _fast_send(
                fast, stride, device, torch.empty(stride, dtype=torch.uint8, device=device)
            )
            received: list[torch.Tensor] | None = None
            if g.rank == root:
                received = list(torch.empty(len(g.ranks), stride, dtype=torch.uint8, device=device))
            dist.gather(send, received, dst=dst, group=g.handle)
            del send
            return _finish_gather(
                g,
                dst,
                root,
                lambda: _fast_combine(
                    g, fast, received or [], [r[4] for r in rows], device, layout, dim
                ),
            )
    return _full_gather(g, dst, root, tree, layout, dim, sizes)


def _full_gather(
    g: _Group, dst: int, root: int, tree: Any, layout: Any, dim: int, sizes: int | None
) -> Any:
    local = _wire.encode(tree, sizes, layout, dim, order=g.rank == 0)
    rows = _preamble(g, _GATHER, root, (len(local.header), local.nbytes), local.devices)
    device = _data_device(g, rows)
    stride = max(_wire.padded(r[3]) + _wire.padded(r[4]) for r in rows)
    send = _wire.message_buffer(local, stride, device)
    received: list[torch.Tensor] | None = None
    if g.rank == root:
        received = list(torch.empty(len(g.ranks), stride, dtype=torch.uint8, device=device))
    dist.gather(send, received, dst=dst, group=g.handle)

    def combine() -> Any:
        assert received is not None
        headers = _wire.read_headers(received, [r[3] for r in rows])
        _check(g, headers, local)
        up_spec = _wire.agreed_up_spec(headers, local)
        trees = [
            _wire.rank_tree(up_spec, h, _wire.decode(h, buf[_wire.padded(r[3]) :]))
            for h, buf, r in zip(headers, received, rows)
        ]
        target = _target_device(local.devices, device)
        return _combine(g, trees, target, layout, dim, [h["sizes"] for h in headers])

    return _finish_gather(g, dst, root, combine, local)


def _finish_gather(
    g: _Group,
    dst: int,
    root: int,
    combine: Callable[[], Any],
    local: _wire.Packed | None = None,
) -> Any:
    """``dst`` combines and broadcasts the outcome; the other ranks raise what ``dst`` raised."""
    if g.rank != root:
        code, payload = _status(g, dst)
        if code == _OK:
            return None
        if code == _DIFFERENT_STRUCTURES and local is not None:
            _raise_structure_mismatch(g, local)
        raise _rebuild_error(payload, dst)
    try:
        result = combine()
    except _StructuresDiffer:
        assert local is not None
        _status(g, dst, _DIFFERENT_STRUCTURES)
        _raise_structure_mismatch(g, local)
    except Exception as exc:
        # The other ranks wait for this status: tell them what went wrong, then raise here.
        error = (type(exc).__name__, isinstance(exc, TreegatherError), str(exc))
        _status(g, dst, _FAILED, pickle.dumps(error))
        raise
    _status(g, dst, _OK)
    return result


_OK, _FAILED, _DIFFERENT_STRUCTURES = 0, 1, 2


def _status(g: _Group, src: int, code: int = _OK, payload: bytes = b"") -> tuple[int, bytes]:
    """Broadcast ``gather``'s outcome from ``src`` (one collective; two with an error message)."""
    head = torch.tensor([code, len(payload)], dtype=torch.int64, device=g.device)
    dist.broadcast(head, src=src, group=g.handle)
    code, n = head.tolist()
    if not n:
        return code, b""
    buf = torch.empty(n, dtype=torch.uint8, device=g.device)
    if payload:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src=src, group=g.handle)
    return code, buf.cpu().numpy().tobytes()


def _rebuild_error(payload: bytes, dst: int) -> Exception:
    name, ours, message = pickle.loads(payload)
    if ours:
        return _ERROR_CLASSES.get(name, TreegatherError)(message)
    return RuntimeError(f"treegather.distributed.gather failed on rank {dst}: {name}: {message}")


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
    local = _wire.encode(tree, None, with_spec=True) if g.rank == root else _wire.Packed(None, b"")
    rows = _preamble(g, _BROADCAST, root, (len(local.header), local.nbytes), local.devices)
    device = _data_device(g, rows)
    head_len, data_len = rows[root][3], rows[root][4]
    stride = _wire.padded(head_len) + data_len
    if g.rank == root:
        buf = _wire.message_buffer(local, stride, device)
    else:
        buf = torch.empty(stride, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=g.handle)
    header = _wire.read_headers([buf], [head_len])[0]
    if "error" in header:
        cls = _ERROR_CLASSES.get(header["error"][0], TreegatherError)
        raise cls(f"on rank {src}: {header['error'][1]}")
    if g.rank == root:
        return tree
    leaves = _wire.decode(header, buf[_wire.padded(head_len) :])
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
