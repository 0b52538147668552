"""The errors of :mod:`treegather.distributed`: the same message on every rank.

Every rank checks every rank's header of the full exchange (:mod:`treegather.distributed.wire`) with
:func:`check`, so that when the trees differ every rank raises the same error, naming the leaf
path and the (global) ranks. Structures that differ take one more exchange to name every
differing node (:func:`node_rows`, then :func:`raise_structure_mismatch` on every rank's table).
``gather`` sends ``dst``'s outcome to the other ranks, which rebuild it with
:func:`rebuild_error`.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
from optree import PyTreeKind, PyTreeSpec

from .. import _errors, _tree
from .._errors import (
    BatchSizeError,
    LayoutError,
    StructureMismatchError,
    TreegatherError,
    safe_repr,
)
from .._layout import resolve
from .._mismatch import diagnose
from .._tree.batch import node_data, rule_of
from . import wire
from .group import Collective, Group

__all__ = [
    "ERROR_CLASSES",
    "StructuresDiffer",
    "by_rank",
    "check",
    "exchange_objects",
    "name_differences",
    "node_rows",
    "outcome_of",
    "raise_structure_mismatch",
    "rank_errors",
    "same_layouts",
    "rebuild_error",
]

# Every treegather error, by name: what a rank's error header (or a Collector's problem) names,
# raised again as that class on every rank.
ERROR_CLASSES: dict[str, type[TreegatherError]] = {
    cls.__name__: cls
    for cls in vars(_errors).values()
    if isinstance(cls, type) and issubclass(cls, TreegatherError)
}


class StructuresDiffer(Exception):
    """The fingerprints differ: every rank must join the exchange that names the differences."""


def check(
    ranks: Sequence[int],
    headers: list[dict[str, Any]],
    local: wire.Packed,
    layout: Any = None,
    dim: int = 0,
) -> None:
    """Raise when a rank failed or the trees disagree (the same error wherever it runs).

    ``ranks`` are the group's global ranks. Raises :class:`StructuresDiffer` when the
    structures differ: naming the differences takes one more exchange, which every rank must
    then join. Leaves whose dtypes differ between the ranks are named by their rules (under
    ``layout`` and ``dim``), with the same message as :func:`treegather.gather` gives.
    """
    errors = [(ranks[i], *h["error"]) for i, h in enumerate(headers) if "error" in h]
    if errors:
        raise rank_errors(errors)
    same_layouts(
        ranks,
        [h["layout"] for h in headers],
        "the ranks passed different layouts, dims or sync_grads (each rank would combine the "
        "trees with other rules)",
        "pass the same layout= and dim= on every rank",
    )
    if len({h["fingerprint"] for h in headers}) > 1:
        raise StructuresDiffer
    _check_leaf_kinds(ranks, headers, local, layout, dim)
    sizes = [h["sizes"] for h in headers]
    if len({s is None for s in sizes}) > 1:
        raise BatchSizeError(
            "sizes= was passed on some ranks only: "
            + by_rank(ranks, ["None" if s is None else str(s) for s in sizes])
            + "\nHint: pass sizes= (this rank's batch size) on every rank, or on none"
        )


def rank_errors(problems: Sequence[tuple[int, str, str]]) -> TreegatherError:
    """Problems ranks found on their own (rank, error class name, message), as one error of the
    first one's class, grouped by message: what every rank raises."""
    by_message: dict[str, list[int]] = {}
    for rank, _, message in problems:
        by_message.setdefault(message, []).append(rank)
    return ERROR_CLASSES.get(problems[0][1], TreegatherError)(
        "\n".join(
            f"on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {msg}"
            for msg, rs in by_message.items()
        )
    )


def same_layouts(
    ranks: Sequence[int], layouts: Sequence[tuple[str, str]], title: str, hint: str
) -> None:
    """Raise a :class:`LayoutError` unless every rank's ``(key, shown)`` layout is the same."""
    if len({key for key, _ in layouts}) > 1:
        raise LayoutError(
            wire.format_problems(
                title,
                [f"{shown} on {_ranks_text(ranks, rs)}" for shown, rs in _group_by(layouts)],
                hint,
            )
        )


def _check_leaf_kinds(
    ranks: Sequence[int], headers: list[dict[str, Any]], local: wire.Packed, layout: Any, dim: int
) -> None:
    """Same structure: a tensor at the same paths on every rank, of the dtype its rule needs."""
    assert local.up_spec is not None and local.spec is not None
    kinds = [wire.up_kinds(h, local.up_spec.num_leaves) for h in headers]
    if all(k == kinds[0] for k in kinds[1:]):
        return
    mixed = []
    for j, path in enumerate(wire.leaf_paths(local.up_spec)):
        per_rank = [k[j] for k in kinds]
        tensors = [p is not None and p.startswith("Tensor(") for p in per_rank]
        if len(set(tensors)) > 1:
            described = [wire.describe_up(h, j, k) for h, k in zip(headers, per_rank)]
            mixed.append(f"{path}: " + by_rank(ranks, described))
    if mixed:
        raise StructureMismatchError(
            wire.format_problems(
                "leaves are tensors on some ranks and other objects on others",
                mixed,
                "every rank must pass a tensor at the same paths (e.g. torch.tensor(x) for "
                "numbers)",
            )
        )
    # Tensors everywhere, of other dtypes: the rules say what is wrong, as gather's do (every
    # rank's values stand in as meta tensors of their dtype and shape: no bytes are read).
    plan = resolve(local.spec, layout, "gather", dim, wire.ROOT)
    columns = list(zip(*(wire.stand_ins(h, local.up_spec.num_leaves) for h in headers)))
    problem = diagnose(plan, columns, dim, None)
    if problem is not None:
        raise type(problem)(f"{problem}\n{rank_note(ranks)}")


def rank_note(ranks: Sequence[int]) -> str:
    """What a replica of gather's messages is here."""
    if list(ranks) == list(range(len(ranks))):
        return "(replica i above is rank i)"
    return f"(replica i above is the group's rank i, global ranks {list(ranks)})"


def _group_by(values: Sequence[tuple[str, str]]) -> list[tuple[str, list[int]]]:
    """``(key, shown)`` per rank -> ``(shown, group ranks)`` per distinct key, in rank order."""
    seen: dict[str, tuple[str, list[int]]] = {}
    for i, (key, shown) in enumerate(values):
        seen.setdefault(key, (shown, []))[1].append(i)
    return list(seen.values())


def _ranks_text(ranks: Sequence[int], members: Sequence[int]) -> str:
    """``'rank 1'``, ``'ranks 0, 2'`` (global ranks of the group ranks ``members``)."""
    return f"rank{'s' if len(members) > 1 else ''} {', '.join(str(ranks[i]) for i in members)}"


def by_rank(ranks: Sequence[int], values: Sequence[str]) -> str:
    """``'float32 on ranks 0, 2; int64 on rank 1'``."""
    seen: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        seen.setdefault(v, []).append(ranks[i])
    return "; ".join(
        f"{v} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
        for v, rs in seen.items()
    )


# ------------------------------------------------------------------------ structure mismatch


def node_rows(spec: PyTreeSpec) -> list[tuple[str, str, tuple[str, str, str] | None]]:
    """The ``(path, node type, metadata)`` of every node of a structure, for
    :func:`raise_structure_mismatch`: a registered class's metadata (its static fields, a
    TensorDict's keys and names, ...) as a digest the ranks compare (type-aware, without a
    batch node's batch size, as the structure's fingerprint) and its ``repr``."""
    return [
        (_tree.format_path(wire.ROOT, n.path), _node_name(n.spec), _metadata(n.spec))
        for n in _tree.nodes(spec)
    ]


def _node_name(spec: PyTreeSpec) -> str:
    if spec.is_leaf():
        return "a leaf"
    if spec.kind == spec.kind.NONE:
        return "None"
    node_type = spec.type
    return node_type.__qualname__ if node_type is not None else str(spec.kind)


def _metadata(spec: PyTreeSpec) -> tuple[str, str, str] | None:
    """A registered class's metadata: a digest the ranks compare, how it reads, and what its
    class says when it differs (``None`` for other nodes: their differences are their
    children's)."""
    if spec.kind != PyTreeKind.CUSTOM:
        return None
    data = node_data(spec)
    batched = type(data) is _tree.Batched
    key = ("batched", data.key()) if batched else data
    try:
        blob = pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # (unpicklable metadata: compared by how it reads)
        blob = safe_repr(key, None, stable=True).encode()
    shown = safe_repr(data.aux if batched else data, None, stable=True)
    rule = rule_of(spec.type) if spec.type is not None else None
    note = rule.differs if rule is not None else ""
    return hashlib.blake2b(blob, digest_size=16).hexdigest(), shown, note


def raise_structure_mismatch(ranks: Sequence[int], tables: Sequence[Any]) -> NoReturn:
    """Name every node whose path or type differs between the ranks' :func:`node_rows`, and
    every registered node whose metadata differs (where its children agree)."""
    per_rank = [{path: (name, meta) for path, name, meta in t} for t in tables]
    all_paths: dict[str, None] = {}
    for d in per_rank:
        all_paths.update(dict.fromkeys(d))
    problems: list[str] = []
    reported: list[str] = []
    metadata: list[tuple[str, list[Any]]] = []
    for path in all_paths:
        rows = [d.get(path, ("missing", None)) for d in per_rank]
        values = [name for name, _ in rows]
        if len(set(values)) == 1:
            if len({m[0] for _, m in rows if m is not None}) > 1:  # (same type, other metadata)
                metadata.append((path, [m for _, m in rows]))
            continue
        # Below a node reported as missing or of another type, every path differs too.
        if any(_below(path, p) for p in reported):
            continue
        reported.append(path)
        problems.append(f"{path}: " + by_rank(ranks, values))
    static = False
    typed = list(reported)
    for path, shown in metadata:  # (where no node below or above it is missing or another type)
        if any(_below(path, p) or _below(p, path) for p in typed):
            continue
        static = True
        name = per_rank[0][path][0]
        texts = _tree.differing([m[1] for m in shown])
        note = f" ({shown[0][2]})" if shown[0][2] else ""
        problems.append(f"{path}: the {name}'s metadata differs: {by_rank(ranks, texts)}{note}")
    hint = (
        "every rank must pass the same keys, fields and lengths; use the same placeholder on "
        "every rank for values a rank does not have"
    )
    if static:
        hint += (
            "; a registered node's metadata (its static fields; a TensorDict's keys, names, "
            "device and NonTensorData values) must be the same on every rank"
        )
    raise StructureMismatchError(
        wire.format_problems(
            "the ranks passed trees of different structure",
            problems or ["same paths and node types, but different node metadata (static fields)"],
            hint,
        )
    )


def _below(path: str, parent: str) -> bool:
    """Whether ``path`` is a path under ``parent`` (``outputs['a'].b`` under ``outputs['a']``)."""
    return path.startswith(parent) and len(path) > len(parent) and path[len(parent)] in "[."


def _all_gather_bytes(collective: Collective, g: Group, payload: bytes) -> list[Any]:
    """All-gather one pickled object per rank (two collectives)."""
    n = len(payload)
    lengths = torch.empty(len(g.ranks), dtype=torch.int64, device=g.device)
    collective(lengths, torch.tensor([n], dtype=torch.int64, device=g.device), g.handle)
    sizes = lengths.tolist()
    stride = max(sizes)
    mine = torch.zeros(stride, dtype=torch.uint8, device=g.device)
    mine[:n].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    out = torch.empty(stride * len(g.ranks), dtype=torch.uint8, device=g.device)
    collective(out, mine, g.handle)
    return [
        pickle.loads(wire.tensor_bytes(buf[:k]))
        for buf, k in zip(out.view(len(g.ranks), stride), sizes)
    ]


# The preamble's exchange of the ranks' argument problems uses it too (error paths only).
exchange_objects = _all_gather_bytes


def name_differences(collective: Collective, g: Group, local: wire.Packed) -> NoReturn:
    """Exchange the node paths (only on this error path) and name every difference."""
    assert local.up_spec is not None
    table = pickle.dumps(node_rows(local.up_spec), protocol=pickle.HIGHEST_PROTOCOL)
    raise_structure_mismatch(g.ranks, _all_gather_bytes(collective, g, table))


# ------------------------------------------------------------------------------- gather


def outcome_of(exc: Exception) -> bytes:
    """What ``gather``'s ``dst`` tells the other ranks about an error it raised."""
    error = (type(exc).__name__, isinstance(exc, TreegatherError), str(exc))
    return pickle.dumps(error)


def rebuild_error(payload: bytes, dst: int) -> Exception:
    """The error :func:`outcome_of` describes, to raise on another rank."""
    name, ours, message = pickle.loads(payload)
    if ours:
        return ERROR_CLASSES.get(name, TreegatherError)(message)
    return RuntimeError(f"treegather.distributed.gather failed on rank {dst}: {name}: {message}")
