"""The errors of :mod:`treegather.distributed`: the same message on every rank.

When the headers travelled (the ranks' plans differ), every rank checks every rank's header with
:func:`check_headers` and :func:`check_leaves`, so that when the trees differ every rank raises
the same error, naming the leaf path and the (global) ranks. Structures that differ take one
more exchange to name every differing node (:func:`node_rows` on each rank, then
:func:`raise_structure_mismatch` on every rank's table). ``gather``'s ``dst`` sends its outcome
to the other ranks, which rebuild its error with :func:`rebuild_error`.
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
from .describe import ROOT, format_problems, leaf_paths
from .payload import DTYPES

__all__ = [
    "ERROR_CLASSES",
    "StructuresDiffer",
    "by_rank",
    "check_headers",
    "check_leaves",
    "node_rows",
    "outcome_of",
    "raise_structure_mismatch",
    "rank_errors",
    "rank_note",
    "rebuild_error",
    "same_layouts",
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


def check_headers(ranks: Sequence[int], headers: list[dict[str, Any]]) -> None:
    """Raise when a rank failed, the ranks passed other layouts, or (:class:`StructuresDiffer`)
    their structures differ: the same on every rank, from the headers alone."""
    failed = [(ranks[i], *h["error"]) for i, h in enumerate(headers) if "error" in h]
    if failed:
        raise rank_errors(failed)
    same_layouts(
        ranks,
        [h["layout"] for h in headers],
        "the ranks passed different layouts, dims or sync_grads (each rank would combine the "
        "trees with other rules)",
        "pass the same layout= and dim= on every rank",
    )
    if len({h["fingerprint"] for h in headers}) > 1:
        raise StructuresDiffer


def check_leaves(
    ranks: Sequence[int],
    headers: list[dict[str, Any]],
    rows: list[list[int]],
    objects: list[list[Any]],
    sizes: list[int | None],
    spec: PyTreeSpec,
    up_spec: PyTreeSpec,
    layout: Any,
    dim: int,
) -> None:
    """Same structure: a tensor at the same paths on every rank, of the dtype its rule needs,
    and ``sizes`` passed on every rank or on none. ``rows``, ``objects`` and ``sizes``: each
    rank's rows of its tensor leaves of >= 1 dim, its other leaves (in leaf order) and its
    ``sizes``."""
    n = up_spec.num_leaves
    kinds = [_up_kinds(h, n) for h in headers]
    if any(k != kinds[0] for k in kinds[1:]):
        mixed = []
        for j, path in enumerate(leaf_paths(up_spec)):
            per_rank = [k[j] for k in kinds]
            if len({p is not None and p.startswith("Tensor(") for p in per_rank}) > 1:
                shown = [_shown(h, objs, j, p) for h, objs, p in zip(headers, objects, per_rank)]
                mixed.append(f"{path}: " + by_rank(ranks, shown))
        if mixed:
            raise StructureMismatchError(
                format_problems(
                    "leaves are tensors on some ranks and other objects on others",
                    mixed,
                    "every rank must pass a tensor at the same paths (e.g. torch.tensor(x) for "
                    "numbers)",
                )
            )
        # Tensors everywhere, of other dtypes: the rules say what is wrong, as gather's do
        # (every rank's values stand in as meta tensors of their dtype and shape).
        plan = resolve(spec, layout, "gather", dim, ROOT)
        stand_ins = (_stand_ins(h, r, o, n) for h, r, o in zip(headers, rows, objects))
        columns = list(zip(*stand_ins))
        problem = diagnose(plan, columns, dim, None)
        if problem is not None:
            raise type(problem)(f"{problem}\n{rank_note(ranks)}")
    if len({s is None for s in sizes}) > 1:
        raise BatchSizeError(
            "sizes= was passed on some ranks only: "
            + by_rank(ranks, ["None" if s is None else str(s) for s in sizes])
            + "\nHint: pass sizes= (this rank's batch size) on every rank, or on none"
        )


def _up_kinds(header: dict[str, Any], n: int) -> list[str | None]:
    """Per leaf of the up-structure: ``"Tensor(dtype)"`` (a tensor that travelled pickled too),
    ``"object"``, or None (taken whole)."""
    meta, groups, held = header["meta"], header["groups"] or {}, header.get("held") or {}
    out: list[str | None] = []
    k = 0
    for pos in range(n):
        sub = groups.get(pos)
        if sub is not None:
            out.append(None)
            k += sub.num_leaves
        else:
            m = meta[k]
            out.append(
                f"Tensor({m[0]})"
                if m is not None
                else f"Tensor({held[k][0]})"
                if k in held
                else "object"
            )
            k += 1
    return out


def _shown(header: dict[str, Any], objects: list[Any], pos: int, kind: str | None) -> str:
    """``kind`` with an object's type name instead of ``"object"``."""
    if kind != "object":
        return str(kind)
    groups = header["groups"] or {}
    k = sum(groups[p].num_leaves if p in groups else 1 for p in range(pos))
    return type(objects[[m is None for m in header["meta"]][:k].count(True)]).__qualname__


def _stand_ins(header: dict[str, Any], rows: list[int], objects: list[Any], n: int) -> list[Any]:
    """Per leaf of the up-structure, what a check of the rules can look at: a meta tensor of
    the leaf's dtype and shape, the object itself, or ``None`` for a node taken whole."""
    leaves: list[Any] = []
    at, found = iter(rows), iter(objects)
    for m in header["meta"]:
        if m is None:
            leaves.append(next(found))
        else:
            shape = () if m[1] is None else (next(at), *m[1])
            leaves.append(torch.empty(shape, dtype=DTYPES[m[0]], device="meta"))
    groups = header["groups"] or {}
    if not groups:
        return leaves
    out: list[Any] = []
    k = 0
    for pos in range(n):
        sub = groups.get(pos)
        out.append(None if sub is not None else leaves[k])
        k += sub.num_leaves if sub is not None else 1
    return out


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
        seen: dict[str, tuple[str, list[int]]] = {}
        for i, (key, shown) in enumerate(layouts):
            seen.setdefault(key, (shown, []))[1].append(ranks[i])
        raise LayoutError(
            format_problems(
                title,
                [
                    f"{shown} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                    for shown, rs in seen.values()
                ],
                hint,
            )
        )


def rank_note(ranks: Sequence[int]) -> str:
    """What a replica of gather's messages is here."""
    if list(ranks) == list(range(len(ranks))):
        return "(replica i above is rank i)"
    return f"(replica i above is the group's rank i, global ranks {list(ranks)})"


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
        (_tree.format_path(ROOT, n.path), _node_name(n.spec), _metadata(n.spec))
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
        format_problems(
            "the ranks passed trees of different structure",
            problems or ["same paths and node types, but different node metadata (static fields)"],
            hint,
        )
    )


def _below(path: str, parent: str) -> bool:
    """Whether ``path`` is a path under ``parent`` (``outputs['a'].b`` under ``outputs['a']``)."""
    return path.startswith(parent) and len(path) > len(parent) and path[len(parent)] in "[."


# ------------------------------------------------------------------------------- gather


def outcome_of(exc: Exception) -> bytes:
    """What ``gather``'s ``dst`` tells the other ranks about an error it raised."""
    return pickle.dumps((type(exc).__name__, isinstance(exc, TreegatherError), str(exc)))


def rebuild_error(payload: bytes, dst: int) -> Exception:
    """The error :func:`outcome_of` describes, to raise on another rank."""
    name, ours, message = pickle.loads(payload)
    if ours:
        return ERROR_CLASSES.get(name, TreegatherError)(message)
    return RuntimeError(f"treegather.distributed.gather failed on rank {dst}: {name}: {message}")
