"""Gather pytrees across processes: treegather's layouts on ``torch.distributed``.

:func:`all_gather`, :func:`gather` and :func:`broadcast` move whole pytrees between the ranks of
a process group (gloo on CPU, NCCL on CUDA, any backend with all-gather, gather and broadcast) and
combine them with exactly the rules of the single-process :func:`treegather.gather`: ``cat``
with uneven sizes, ``stack``, ``mean`` weighted by ``sizes``, ``pad``, ``as_list``, ``first`` and
custom callables; non-tensor leaves default to ``as_list()``.

The number of collectives does not grow with the number of leaves. A call finds its cached wire
plan (:mod:`treegather._wireplan`: structure, dict key order and node metadata, each leaf's
dtype and trailing shape, ``layout``, ``dim``, whether ``sizes`` was passed, and a digest of it)
and then:

1. one all-gather of every rank's row (the call, ``dst``/``src``, lengths, the digest) and, in
   the same buffer, its payload when that fits the group's inline capacity
   (:mod:`treegather._dist_preamble`): the row counts and one region per dtype and trailing
   shape, each written by one ``torch.cat``, then the pickled non-tensor leaves if there are any
   (:mod:`treegather._dist_payload`; no header, no pickle for an all-tensor tree). When every
   rank sent the same digest and its payload inline, that is the whole exchange;
2. same digests, but a payload did not fit (large tensors, rows that grew): one all-gather
   (``gather``: a gather to ``dst``) of every payload, packed straight into the output. A digest
   differs: every rank takes the full exchange (:mod:`treegather._wire`), one more length
   exchange and one buffer per rank holding a pickled header (structure fingerprint, layout and
   dim, per-leaf dtype and shape, the non-tensor leaves, ``sizes``) and the bytes of every tensor
   leaf. The full exchange is the definition of results and errors; the wire plan is a cheaper
   way to the same result;
3. ``gather`` only: one small broadcast of the outcome from ``dst`` (:mod:`treegather._dist_outcome`).

So a repeated structure costs one collective (``gather``: two), or two (three) while its payload
does not fit; digests that differ three (four), and a structure mismatch two more, to name every
difference. :func:`broadcast` always sends the header (the receivers have no structure of their
own to compare): one length exchange and one broadcast. Only all-gather, gather and broadcast are
used, which never look at the values: ``bool``, ``bfloat16``, complex and float8 leaves travel on
any backend; conjugate and negative views travel as their values.

Every rank checks every rank's header the same way (``gather``: ``dst`` checks and broadcasts the
outcome; :mod:`treegather._dist_errors`), so when the trees differ (a missing key, a list against
a tuple, a tensor against a string, mismatched dtypes or non-cat dims, ``sizes=`` on some ranks
only, another ``dst``, ``layout`` or ``dim``) every rank raises the same error naming the leaf
path and the ranks, instead of hanging in a mismatched collective. Problems found before the
exchange (an unpicklable leaf, a layout that does not fit) travel in the header too, and a
``dst``/``src`` that names no rank of the group travels in the first exchange's row. Nodes that
the layout takes whole (``cat_items()``, ``as_list()``, ``first()``, a callable on an inner node)
may differ between ranks, like per-sample lists of uneven length.

Results are new tensors, detached from autograd, built from the exchanged bytes on every rank
(its own contribution included), so all ranks compute bitwise-identical results, with rank 0's
dict key order; they land on the device of this rank's tensor leaves (the communication device
when those are spread over several). Bytes travel on the device torch uses for object
collectives (CPU for gloo, the current GPU for NCCL), or on the GPU when a group with several
backends (torch's default ``cpu:gloo,cuda:nccl``) holds GPU tensors on every rank.

Security:
    Non-tensor leaves and the headers travel as :mod:`pickle` data and are unpickled on the
    receiving ranks, as with :func:`torch.distributed.all_gather_object`, only from the ranks of
    the process group you pass: only join process groups whose members you trust.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from treegather import (
    _dist_combine,
    _dist_errors,
    _dist_group,
    _dist_outcome,
    _dist_payload,
    _wire,
    _wireplan,
)
from treegather import _dist_preamble as _pre
from treegather._dist_group import Group
from treegather._errors import ArgumentTypeError, TreegatherError, check_dim

__all__ = ["all_gather", "gather", "broadcast"]

_FAST_PATH = True  # tests turn it off to run every case through the full exchange


# -------------------------------------------------------------------------------- collectives


def _all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


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

    A repeated structure (only the batch rows changing) costs one collective while its payload
    fits the group's inline capacity (a few hundred KiB per rank), else two, and no pickling for
    an all-tensor tree; see the module docstring for the rest. Every rank must
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
    g = _dist_group.group(group)
    dim, problem = _checked_dim(dim)  # a bad dim travels in the first exchange
    if not _FAST_PATH or problem is not None:
        return _full_all_gather(g, tree, layout, dim, sizes, problem=problem)
    fast = _wireplan.prepare(tree, layout, dim, sizes)
    opening = _pre.exchange(_all_gather_into, g, _pre.ALL_GATHER, -1, *_fast_lengths(fast), fast)
    fast, nbytes = opening.fast, opening.nbytes
    if fast is None or not opening.agreed:
        return _full_all_gather(g, tree, layout, dim, sizes, first=False)
    if opening.inline:
        return _dist_combine.fast(g.ranks, fast, opening.payloads, nbytes, g.device, layout, dim)
    device = _dist_group.data_device(g, [r[_pre.PLACEMENT] for r in opening.rows])
    stride = _wireplan.padded(max(nbytes))
    keep = fast.plan.vectorised  # the results are copies: the group may keep the buffer
    out = _dist_group.receive_buffer(g, stride * len(g.ranks), device, keep=keep)
    # In place: this rank's payload is packed straight into its own slot of the output.
    mine = out[g.rank * stride : (g.rank + 1) * stride]
    _dist_payload.send(fast, stride, device, mine)
    _all_gather_into(out, mine, g.handle)
    payloads = _dist_payload.Payloads(out, 0, stride)
    return _dist_combine.fast(g.ranks, fast, payloads, nbytes, device, layout, dim)


def _full_all_gather(
    g: Group,
    tree: Any,
    layout: Any,
    dim: int,
    sizes: int | None,
    *,
    first: bool = True,
    problem: _dist_group.Problem | None = None,
) -> Any:
    """The full exchange: one header and bytes per rank, every check; the definition."""
    if problem is not None:  # the first exchange raises it on every rank
        local = _wire.Packed(None, b"")
    else:
        local = _wire.encode(tree, sizes, layout, dim, order=g.rank == 0)
    lengths = (len(local.header), local.nbytes)
    rows = _pre.exchange(
        _all_gather_into,
        g,
        _pre.ALL_GATHER,
        -1,
        lengths,
        local.devices,
        first=first,
        problem=problem,
    ).rows
    device = _dist_group.data_device(g, [r[_pre.PLACEMENT] for r in rows])
    stride = max(_wire.padded(r[_pre.HEADER]) + _wire.padded(r[_pre.NBYTES]) for r in rows)
    out = torch.empty(stride * len(g.ranks), dtype=torch.uint8, device=device)
    _all_gather_into(out, _wire.message_buffer(local, stride, device), g.handle)
    buffers = list(out.view(len(g.ranks), stride))
    headers = _wire.read_headers(buffers, [r[_pre.HEADER] for r in rows])
    try:
        _dist_errors.check(g.ranks, headers, local)
    except _dist_errors.StructuresDiffer:
        _dist_errors.name_differences(_all_gather_into, g, local)
    return _dist_combine.full(g.ranks, headers, buffers, rows, local, device, layout, dim)


# ------------------------------------------------------------------------------- fast path


def _checked_dim(dim: Any) -> tuple[int, _dist_group.Problem | None]:
    """``dim`` as an int (``numpy.int64`` too), or what is wrong with it. Never raises: the
    problem travels in the first exchange, so that every rank raises it, none waits."""
    if type(dim) is int:
        return dim, None
    try:
        return check_dim(dim, "dim"), None
    except ArgumentTypeError as exc:
        return 0, (ArgumentTypeError, str(exc).partition(": ")[2])


def _either(*problems: _dist_group.Problem | None) -> _dist_group.Problem | None:
    """This rank's problems as one (``None``: none)."""
    found = [p for p in problems if p is not None]
    if not found:
        return None
    typed = any(cls is ArgumentTypeError for cls, _ in found)
    return (ArgumentTypeError if typed else found[0][0]), "; ".join(text for _, text in found)


def _fast_lengths(
    fast: _wireplan.Local | None,
) -> tuple[tuple[int, int], frozenset[torch.device]]:
    """The row's lengths and this rank's devices, for a wire-plan call."""
    return ((0, 0), frozenset()) if fast is None else ((0, fast.nbytes), fast.devices)


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

    Same rules and arguments as :func:`all_gather`, but the result is built on ``dst`` only
    (three collectives: lengths, one gather to ``dst``, and a small broadcast of the outcome
    from ``dst``; two for a repeated structure whose payload fits the inline capacity, which
    rides with the lengths to every rank). ``dst`` checks the headers and applies the rules, then tells the other
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
        ValueError: ``dst`` names no rank of the group on some rank (raised on every rank;
            :class:`~treegather.ArgumentTypeError` when it is not an int).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import treegather as tg, treegather.distributed as tgd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> preds = {"logits": torch.ones(3, 2), "ids": ["a", "b", "c"]}  # per-sample ids
        >>> tgd.gather(preds, dst=0, layout={"logits": tg.cat(), "ids": tg.cat_items()})
        {'logits': tensor([[1., 1.], [1., 1.], [1., 1.]]), 'ids': ['a', 'b', 'c']}
        >>> dist.destroy_process_group()
    """
    g = _dist_group.group(group)
    # A dst that names no rank (or a bad dim) travels in the first exchange: every rank
    # raises, none waits.
    root, bad_root = _dist_group.root_rank(g, dst, "dst")
    if bad_root is None:
        dst = g.ranks[root]
    dim, bad_dim = _checked_dim(dim)
    problem = _either(bad_root, bad_dim)
    if not _FAST_PATH or problem is not None:
        return _full_gather(g, dst, root, tree, layout, dim, sizes, problem=problem)
    fast = _wireplan.prepare(tree, layout, dim, sizes)
    opening = _pre.exchange(_all_gather_into, g, _pre.GATHER, root, *_fast_lengths(fast), fast)
    fast, nbytes = opening.fast, opening.nbytes
    if fast is None or not opening.agreed:
        return _full_gather(g, dst, root, tree, layout, dim, sizes, first=False)
    if opening.inline:
        device, payloads = g.device, opening.payloads
    else:
        device = _dist_group.data_device(g, [r[_pre.PLACEMENT] for r in opening.rows])
        payloads = _gather_payloads(g, dst, root, fast, _wireplan.padded(max(nbytes)), device)
    return _dist_outcome.finish_gather(
        g,
        dst,
        root,
        lambda: _dist_combine.fast(g.ranks, fast, payloads, nbytes, device, layout, dim),
    )


def _gather_payloads(
    g: Group, dst: int, root: int, fast: _wireplan.Local, stride: int, device: torch.device
) -> _dist_payload.Payloads:
    """Gather every rank's payload to ``dst`` (elsewhere, what is returned is not read)."""
    send = torch.empty(stride, dtype=torch.uint8, device=device)
    _dist_payload.send(fast, stride, device, send)
    if g.rank != root:
        dist.gather(send, None, dst=dst, group=g.handle)
        return _dist_payload.Payloads(send, 0, stride)
    buf = _dist_group.receive_buffer(g, stride * len(g.ranks), device, keep=fast.plan.vectorised)
    dist.gather(send, list(buf.view(len(g.ranks), stride)), dst=dst, group=g.handle)
    return _dist_payload.Payloads(buf, 0, stride)


def _full_gather(
    g: Group,
    dst: int,
    root: int,
    tree: Any,
    layout: Any,
    dim: int,
    sizes: int | None,
    *,
    first: bool = True,
    problem: _dist_group.Problem | None = None,
) -> Any:
    if problem is not None:  # the first exchange raises it on every rank
        local = _wire.Packed(None, b"")
    else:
        local = _wire.encode(tree, sizes, layout, dim, order=g.rank == 0)
    lengths = (len(local.header), local.nbytes)
    rows = _pre.exchange(
        _all_gather_into, g, _pre.GATHER, root, lengths, local.devices, first=first, problem=problem
    ).rows
    device = _dist_group.data_device(g, [r[_pre.PLACEMENT] for r in rows])
    stride = max(_wire.padded(r[_pre.HEADER]) + _wire.padded(r[_pre.NBYTES]) for r in rows)
    send = _wire.message_buffer(local, stride, device)
    received: list[torch.Tensor] | None = None
    if g.rank == root:
        received = list(torch.empty(len(g.ranks), stride, dtype=torch.uint8, device=device))
    dist.gather(send, received, dst=dst, group=g.handle)

    def combine() -> Any:
        assert received is not None
        headers = _wire.read_headers(received, [r[_pre.HEADER] for r in rows])
        _dist_errors.check(g.ranks, headers, local)
        return _dist_combine.full(g.ranks, headers, received, rows, local, device, layout, dim)

    return _dist_outcome.finish_gather(
        g, dst, root, combine, lambda: _dist_errors.name_differences(_all_gather_into, g, local)
    )


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
        ValueError: ``src`` names no rank of the group on some rank (raised on every rank;
            :class:`~treegather.ArgumentTypeError` when it is not an int).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import treegather.distributed as tgd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> config = {"seed": 1234, "weights": torch.tensor([0.25, 0.75])} if dist.get_rank() == 0 else None
        >>> tgd.broadcast(config, src=0)
        {'seed': 1234, 'weights': tensor([0.2500, 0.7500])}
        >>> dist.destroy_process_group()
    """
    g = _dist_group.group(group)
    # A src that names no rank travels in the first exchange: every rank raises, none waits.
    root, problem = _dist_group.root_rank(g, src, "src")
    if problem is None:
        src = g.ranks[root]
    local = _wire.encode(tree, None, with_spec=True) if g.rank == root else _wire.Packed(None, b"")
    lengths = (len(local.header), local.nbytes)
    rows = _pre.exchange(
        _all_gather_into, g, _pre.BROADCAST, root, lengths, local.devices, problem=problem
    ).rows
    device = _dist_group.data_device(g, [r[_pre.PLACEMENT] for r in rows])
    head_len, data_len = rows[root][_pre.HEADER], rows[root][_pre.NBYTES]
    stride = _wire.padded(head_len) + data_len
    if g.rank == root:
        buf = _wire.message_buffer(local, stride, device)
    else:
        buf = torch.empty(stride, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=g.handle)
    header = _wire.read_headers([buf], [head_len])[0]
    if "error" in header:
        cls = _dist_errors.ERROR_CLASSES.get(header["error"][0], TreegatherError)
        raise cls(f"on rank {src}: {header['error'][1]}")
    if g.rank == root:
        return tree
    leaves = _wire.decode(header, buf[_wire.padded(head_len) :])
    for i, m in enumerate(header["meta"]):
        if m is not None:
            leaves[i] = leaves[i].to(_dist_group.receiving_device(m[2]), copy=True)
    return header["spec"].unflatten(leaves)
