"""The wire format of :mod:`treegather.distributed`: one rank's tree as a header and bytes.

A rank's tree becomes a pickled *header* (a structure fingerprint, each leaf's dtype and shape,
the non-tensor leaves, the structures of the nodes a layout takes whole, ``sizes``) and one
``uint8`` buffer holding the bytes of every dense tensor leaf, grouped by dtype, widest first,
so that every leaf is an aligned zero-copy view of the received bytes. A tensor leaf of another
kind (sparse, nested, quantized, meta, a subclass such as ``Parameter``) travels pickled in the
header (:mod:`.pickling`), and comes back as what it was. :func:`decode` and :func:`rank_tree`
turn a received header and buffer back into that rank's tree.
"""

from __future__ import annotations

import hashlib
import math
import pickle
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from optree import PyTreeSpec

from .. import _layout, _tree
from .._errors import BatchSizeError, LeafTypeError, TreegatherError, safe_repr
from .._rules import kinds
from . import pickling
from .group import receiving_device
from .layout import layout_text

ALIGN = 16  # every region starts 16-byte aligned, so any dtype can be viewed in place
ROOT = "outputs"  # how error messages name the tree (as treegather.gather does)
MAX_LISTED = 10  # problems listed in one message before "... and N more"

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
DTYPE_NAMES: dict[torch.dtype, str] = {d: name for name, d in DTYPES.items()}
ITEMSIZES: dict[str, int] = {name: d.itemsize for name, d in DTYPES.items()}


# ---------------------------------------------------------------------------------- encoding


class Packed(NamedTuple):
    """One rank's tree, ready to send."""

    spec: PyTreeSpec | None  # the whole tree's structure
    header: bytes
    chunks: tuple[torch.Tensor, ...] = ()  # uint8, 1-D: one per dtype group, in packing order
    nbytes: int = 0  # of all chunks together
    devices: frozenset[torch.device] = frozenset()  # of this rank's tensor leaves
    # The structure down to the nodes a whole-value rule (cat_items, as_list, first, a callable)
    # takes whole: only that part must match across ranks. ``spec`` when there are none.
    up_spec: PyTreeSpec | None = None


def structure_fingerprint(spec: PyTreeSpec) -> str:
    """A digest of ``spec``: equal on two ranks iff their structures are equal.

    Type-aware (``True``, ``1`` and ``1.0`` as keys or node metadata differ), blind to batch
    nodes' batch sizes (each rank's travels in its header), blind to dict insertion order (as ``PyTreeSpec`` equality is: the leaves travel in sorted key order), and
    computed without formatting anything: one C walk over the nodes, then their pickled types and
    metadata. Not cached (about a tenth of a millisecond for a thousand leaves).
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
            [n if n == 0 else (_qualname(n[0]), _picklable(n[1]), n[2]) for n in nodes],
            protocol=pickle.HIGHEST_PROTOCOL,
        )
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _qualname(kind: Any) -> str:
    return f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', '?')}"


def _picklable(value: Any) -> Any:
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return f"<{_qualname(type(value))}>"


def leaf_paths(spec: PyTreeSpec) -> list[str]:
    return [_tree.format_path(ROOT, n.path) for n in _tree.nodes(spec) if n.spec.is_leaf()]


def pack_order(meta: Sequence[Any]) -> list[list[int]]:
    """Tensor leaf indices grouped by dtype, widest elements first.

    Laying groups out widest first keeps every leaf aligned to its element size inside a
    16-byte-aligned buffer, so each one is a zero-copy view of the received bytes.
    """
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(meta):
        if m is not None:
            groups.setdefault(m[0], []).append(i)
    order = sorted(groups, key=lambda name: (-ITEMSIZES[name], name))
    return [groups[name] for name in order]


def _flat_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One dtype group as contiguous bytes (on the CPU when the tensors are spread out).

    Conjugate and negative views (``x.conj()``, ``x.conj().imag``) are resolved first: their
    values travel, not the lazy bit that a byte view cannot carry.
    """
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        tensors = [t.cpu() for t in tensors]
    try:
        flat = torch._utils._flatten_dense_tensors(tensors)
    except (AttributeError, RuntimeError):  # pragma: no cover - fallback for exotic tensors
        flat = torch.cat([t.reshape(-1) for t in tensors])
    return flat.resolve_conj().resolve_neg().view(torch.uint8)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a 1-dim ``uint8`` tensor on any device (without numpy, which torch does not
    require).

    >>> tensor_bytes(torch.tensor([104, 105], dtype=torch.uint8)), tensor_bytes(torch.zeros(0, dtype=torch.uint8))
    (b'hi', b'')
    """
    out = bytearray(t.numel())
    if out:
        torch.frombuffer(out, dtype=torch.uint8).copy_(t)
    return bytes(out)


def error_header(cls: type[TreegatherError], message: str) -> bytes:
    return pickle.dumps({"error": (cls.__name__, message)}, protocol=pickle.HIGHEST_PROTOCOL)


def encode(
    tree: Any,
    sizes: Any,
    layout: Any = None,
    dim: int = 0,
    *,
    with_spec: bool = False,
    order: bool = False,
    sync: bool = False,
) -> Packed:
    """Flatten ``tree`` into a pickled header and one byte buffer of all its tensor leaves.

    Problems found here become an error header instead of an exception, so that every rank
    learns of them after the exchange and raises the same error instead of leaving the other
    ranks waiting in a collective. With ``order`` (rank 0), the header also carries the pickled
    up-structure, so that every rank rebuilds the trees with rank 0's dict key order. With
    ``sync``, the header also lists the leaves that require grad (``sync_grads``), and which
    tensors of a value laid out by rows do.
    """
    try:
        return _encode(tree, sizes, layout, dim, with_spec, order, sync)
    except TreegatherError as exc:  # (a tree that contains itself): the same error everywhere
        return Packed(None, error_header(type(exc), str(exc)))
    except Exception as exc:  # a node's flatten function failed, say: still tell the others
        message = f"could not prepare this rank's tree: {type(exc).__name__}: {exc}"
        return Packed(None, error_header(TreegatherError, message))


def _encode(
    tree: Any, sizes: Any, layout: Any, dim: int, with_spec: bool, order: bool, sync: bool
) -> Packed:
    if sizes is not None and (isinstance(sizes, bool) or not isinstance(sizes, int) or sizes < 0):
        message = (
            "sizes must be this rank's non-negative int (e.g. its batch size), got "
            f"{safe_repr(sizes)}"
        )
        return Packed(None, error_header(BatchSizeError, message))
    # The plain full flatten, never a cached structure's flatten_up_to on a tree that may not
    # match it: on a mismatch, optree formats the whole tree (every repr) into its error.
    leaves, spec = _tree.flatten(tree, ROOT)
    up_spec, groups = spec, None
    if layout is not None:
        try:
            plan = _layout.resolve(spec, layout, "gather", dim, ROOT)
        except TreegatherError as exc:
            return Packed(spec, error_header(type(exc), str(exc)))
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
    held: dict[int, tuple[str, str]] = {}  # tensors that travel pickled: (dtype, device type)
    devices: set[torch.device] = set()
    names = DTYPE_NAMES
    for i, leaf in enumerate(leaves):
        if type(leaf) is torch.Tensor and pickling.plain(leaf):
            devices.add(leaf.device)
            if with_spec:
                meta.append((names[leaf.dtype], tuple(leaf.shape), leaf.device.type))
            else:
                meta.append((names[leaf.dtype], tuple(leaf.shape)))
        elif isinstance(leaf, torch.Tensor):  # (sparse, nested, quantized, meta, a subclass)
            devices.add(leaf.device)
            held[i] = (names[leaf.dtype], leaf.device.type)
            meta.append(None)
            objects.append(leaf)
        else:
            meta.append(None)
            # (a value laid out by rows travels detached; sync_grads connects its tensors
            # that required grad, which the header names)
            by_rows = _tree.rows_of(leaf)
            objects.append(leaf if by_rows is None else by_rows.detached().held)
    batch = None
    if _tree.is_batched(up_spec):  # each batch node's size: this rank's tree is rebuilt with it
        batch = [bn.meta.size for bn in _tree.batch_nodes(up_spec)]
    fingerprint = structure_fingerprint(up_spec)
    if groups:
        fingerprint += ":" + ",".join(map(str, groups))
    order_bytes = None
    if order:
        try:
            order_bytes = pickle.dumps(up_spec, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # unpicklable node metadata: each rank keeps its own key order
            order_bytes = None
    grads = grad_positions(leaves) if sync else None
    content = {
        "fingerprint": fingerprint,
        "layout": layout_text(layout, dim, sync),
        "grads": grads,
        "parts": {
            i: by_rows.requiring_grad()
            for i in grads or ()
            if (by_rows := _tree.rows_of(leaves[i])) is not None
        },
        "meta": meta,
        "objects": objects,
        "groups": groups,
        "sizes": sizes,
        "spec": spec if with_spec else None,
        "order": order_bytes,
        "batch": batch,
        "held": held,
    }
    try:
        header = pickling.dumps(content)
    except Exception as exc:
        return Packed(spec, error_header(LeafTypeError, _unpicklable(spec, leaves, exc)))
    with torch.no_grad():
        chunks = tuple(_flat_bytes([leaves[i] for i in idx]) for idx in pack_order(meta))
    nbytes = sum(c.numel() for c in chunks)
    return Packed(spec, header, chunks, nbytes, frozenset(devices), up_spec)


def grad_positions(leaves: Sequence[Any]) -> tuple[int, ...]:
    """The positions of the leaves that require grad (what ``sync_grads`` connects): tensors,
    and values laid out by rows holding one."""
    if not torch.is_grad_enabled():
        return ()
    return tuple(i for i, x in enumerate(leaves) if _requires_grad(x))


def _requires_grad(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.requires_grad
    held = _tree.rows_of(x)
    return held is not None and held.requires_grad


def _unpicklable(spec: PyTreeSpec, leaves: list[Any], exc: Exception) -> str:
    paths = leaf_paths(spec)
    problems = []
    tensors = False
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor) and pickling.plain(leaf):
            continue  # (its bytes travel)
        try:
            pickling.dumps(leaf)
        except Exception as leaf_exc:
            said = safe_repr(leaf_exc, 100, text=str)
            problem = f"{path}: {_tree.describe(leaf)} ({type(leaf_exc).__name__}: {said})"
            if isinstance(leaf, torch.Tensor):
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


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def message_buffer(
    local: Packed, stride: int, device: torch.device, *, header: bool = True
) -> torch.Tensor:
    """``[header | pad | tensor bytes | pad]`` (or only the tensor bytes) as ``stride`` bytes."""
    buf = torch.zeros(stride, dtype=torch.uint8, device=device)
    start = 0
    if header:
        head = torch.frombuffer(bytearray(local.header), dtype=torch.uint8)
        buf[: head.numel()].copy_(head)
        start = padded(head.numel())
    for chunk in local.chunks:
        buf[start : start + chunk.numel()].copy_(chunk)
        start += chunk.numel()
    return buf


def read_headers(
    buffers: torch.Tensor | Sequence[torch.Tensor], lengths: Sequence[int]
) -> list[dict[str, Any]]:
    return [pickle.loads(tensor_bytes(buf[:n])) for buf, n in zip(buffers, lengths)]


def up_kinds(header: dict[str, Any], n: int) -> list[str | None]:
    """Per leaf of the up-structure: ``"Tensor(dtype)"``, ``"object"``, or None (taken whole)."""
    meta, groups, held = header["meta"], header["groups"] or {}, header.get("held") or {}

    def kind(k: int) -> str:
        m = meta[k]
        if m is not None:
            return f"Tensor({m[0]})"
        return f"Tensor({held[k][0]})" if k in held else "object"

    if not groups:
        return [kind(k) for k in range(len(meta))]
    out: list[str | None] = []
    k = 0
    for pos in range(n):
        sub = groups.get(pos)
        if sub is not None:
            out.append(None)
            k += sub.num_leaves
        else:
            out.append(kind(k))
            k += 1
    return out


def stand_ins(header: dict[str, Any], n: int) -> list[Any]:
    """Per leaf of the up-structure, what a check of the rules can look at: a meta tensor of
    the leaf's dtype and shape, the object itself, or ``None`` for a node taken whole."""
    leaves = decode(header, torch.empty(0, dtype=torch.uint8), tensors=False)
    for i, m in enumerate(header["meta"]):
        if m is not None:
            leaves[i] = torch.empty(m[1], dtype=DTYPES[m[0]], device="meta")
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


def describe_up(header: dict[str, Any], pos: int, kind: str | None) -> str:
    """``kind`` with an object's type name instead of ``"object"``."""
    if kind != "object":
        return str(kind)
    leaves = decode(header, torch.empty(0, dtype=torch.uint8), tensors=False)
    groups = header["groups"] or {}
    k = sum(groups[p].num_leaves if p in groups else 1 for p in range(pos))
    return type(leaves[k]).__qualname__


# ---------------------------------------------------------------------------------- decoding


def decode(header: dict[str, Any], data: torch.Tensor, *, tensors: bool = True) -> list[Any]:
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
    for idx in pack_order(meta):
        dtype = DTYPES[meta[idx[0]][0]]
        numels = [math.prod(meta[i][1]) for i in idx]
        nbytes = sum(numels) * ITEMSIZES[meta[idx[0]][0]]
        region = data[offset : offset + nbytes].view(dtype)
        offset += nbytes
        for i, part in zip(idx, region.split(numels)):
            leaves[i] = part.view(meta[i][1])
    return leaves


def place_held(header: dict[str, Any], leaves: list[Any]) -> None:
    """The tensors that travelled pickled (rebuilt on the CPU) on this rank's device of the
    kind the sender's were on (in place); meta tensors stay meta."""
    for i, (_, kind) in (header.get("held") or {}).items():
        if kind not in ("cpu", "meta"):
            leaves[i] = leaves[i].to(receiving_device(kind))


def agreed_up_spec(headers: Sequence[dict[str, Any]], local: Packed) -> PyTreeSpec:
    """The up-structure every rank rebuilds with: rank 0's (its dict key order), else ours.

    Only called once the fingerprints agree, i.e. the structures differ at most in key order.
    """
    assert local.up_spec is not None
    order = headers[0].get("order")
    if order is None:
        return local.up_spec
    try:
        spec = pickle.loads(order)
    except Exception:
        return local.up_spec
    try:
        same = isinstance(spec, PyTreeSpec) and spec == local.up_spec
    except Exception:  # metadata that does not compare to a bool
        same = False
    return spec if same else local.up_spec


def rank_tree(up_spec: PyTreeSpec, header: dict[str, Any], leaves: list[Any]) -> Any:
    """One rank's tree from its leaves: the shared up-structure (with the rank's own batch
    sizes), the rank's own whole nodes."""
    groups = header["groups"]
    batch = header.get("batch")
    if batch:
        sizes = dict(enumerate(batch))
        if groups:
            leaves = up_leaves(up_spec, groups, leaves)
        return _tree.rebuild(up_spec, leaves, sizes, ROOT)
    if not groups:
        return up_spec.unflatten(leaves)
    return up_spec.unflatten(up_leaves(up_spec, groups, leaves))


def up_leaves(up_spec: PyTreeSpec, groups: dict[int, PyTreeSpec], leaves: list[Any]) -> list[Any]:
    """A rank's leaves of the up-structure: its own whole nodes rebuilt from their leaves."""
    up: list[Any] = []
    k = 0
    for pos in range(up_spec.num_leaves):
        sub = groups.get(pos)
        if sub is None:
            up.append(leaves[k])
            k += 1
        else:
            up.append(sub.unflatten(leaves[k : k + sub.num_leaves]))
            k += sub.num_leaves
    return up
