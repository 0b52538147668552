"""Each call's collectives, in order: the wire plan's path and the full exchange.

:func:`all_gather`, :func:`gather` and :func:`broadcast` are the bodies of the public functions
of :mod:`treegather.distributed` (whose docstrings document the arguments); :class:`Collector`
calls them too. The number of collectives does not grow with the number of leaves. A call finds
its cached wire plan (:mod:`~treegather.distributed.plan`: structure, dict key order and node
metadata, each leaf's dtype and trailing shape, ``layout``, ``dim``, whether ``sizes`` was
passed, and a digest of it) and then:

1. one all-gather of every rank's row (the call, ``dst``/``src``, lengths, the digest) and, in
   the same buffer, its payload when that fits the group's inline capacity
   (:mod:`~treegather.distributed.preamble`): the row counts and one region per dtype and
   trailing shape, each written by one ``torch.cat``, then the pickled non-tensor leaves if
   there are any (:mod:`~treegather.distributed.payload`; no header, no pickle for an
   all-tensor tree). When every rank sent the same digest and its payload inline, that is the
   whole exchange;
2. same digests, but a payload did not fit (large tensors, rows that grew): one all-gather
   (``gather``: a gather to ``dst``) of every payload, packed straight into the output. A digest
   differs: every rank takes the full exchange (:mod:`~treegather.distributed.wire`), one more
   length exchange and one buffer per rank holding a pickled header (structure fingerprint,
   layout and dim, per-leaf dtype and shape, the non-tensor leaves, ``sizes``) and the bytes of
   every tensor leaf. The full exchange is the definition of results and errors; the wire plan
   is a cheaper way to the same result (:func:`treegather.reference_only` turns it off);
3. ``gather`` only: one small broadcast of the outcome from ``dst``
   (:mod:`~treegather.distributed.outcome`).

What each kind of call costs, in collectives: ARCHITECTURE.md, "The wire plan, in detail". The
results are built by :mod:`~treegather.distributed.combine`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._caches import FAST_PATHS
from .._errors import ArgumentTypeError, TreegatherError, check_dim
from . import combine, errors, grads, outcome, payload, plan, preamble, wire
from .group import (
    Group,
    Problem,
    all_gather_into,
    data_device,
    receive_buffer,
    receiving_device,
    root_rank,
)
from .group import group as process_group

__all__ = ["all_gather", "broadcast", "gather"]


# -------------------------------------------------------------------------------- collectives


_all_gather_into = all_gather_into  # (the name the calls below look up, for tests to wrap)


# ------------------------------------------------------------------------------- the calls


def all_gather(
    tree: Any,
    layout: Any,
    group: Any,
    dim: int,
    sizes: int | None,
    sync_grads: bool,
    call: int = preamble.ALL_GATHER,
) -> Any:
    """:func:`treegather.distributed.all_gather`; ``call``: what the rows say it is (how
    errors name it)."""
    sync = bool(sync_grads)
    out, leaves = _all_gather(process_group(group), tree, layout, dim, sizes, sync, call)
    # A public call without sync_grads: a backward through its result says to pass it.
    return out if sync or call != preamble.ALL_GATHER else grads.unsynced(out, leaves, tree)


def _all_gather(
    g: Group, tree: Any, layout: Any, dim: int, sizes: int | None, sync: bool, call: int
) -> tuple[Any, list[Any] | None]:
    """The result, and this rank's leaves as the wire plan read them (``None``: not read)."""
    dim, problem = _checked_dim(dim)  # a bad dim travels in the first exchange
    if not FAST_PATHS.on or problem is not None:
        return _full_all_gather(g, tree, layout, dim, sizes, call, True, problem, sync), None
    fast = plan.prepare(tree, layout, dim, sizes, sync)
    leaves = None if fast is None else fast.leaves
    opening = preamble.exchange(_all_gather_into, g, call, -1, *_fast_lengths(fast), fast)
    fast, nbytes = opening.fast, opening.nbytes
    if fast is None or not opening.agreed:
        return _full_all_gather(g, tree, layout, dim, sizes, call, False, None, sync), leaves
    if opening.inline:
        return combine.fast(g, fast, opening.payloads, nbytes, g.device, layout, dim), leaves
    device = data_device(g, [r[preamble.PLACEMENT] for r in opening.rows])
    stride = plan.padded(max(nbytes))
    keep = fast.plan.vectorised  # the results are copies: the group may keep the buffer
    out = receive_buffer(g, stride * len(g.ranks), device, keep=keep)
    # In place: this rank's payload is packed straight into its own slot of the output.
    mine = out[g.rank * stride : (g.rank + 1) * stride]
    payload.send(fast, stride, device, mine)
    _all_gather_into(out, mine, g.handle)
    payloads = payload.Payloads(out, 0, stride)
    return combine.fast(g, fast, payloads, nbytes, device, layout, dim), leaves


def _full_opening(
    g: Group,
    tree: Any,
    layout: Any,
    dim: int,
    sizes: int | None,
    call: int,
    root: int,
    first: bool,
    problem: Problem | None,
    sync: bool = False,
) -> tuple[wire.Packed, list[list[int]], torch.device, int]:
    """The full exchange's start: this rank's header and bytes, every rank's row (``first``:
    in the call's first collective), where the bytes travel, and each rank's share of them."""
    if problem is not None:  # the first exchange raises it on every rank
        local = wire.Packed(None, b"")
    else:
        local = wire.encode(tree, sizes, layout, dim, order=g.rank == 0, sync=sync)
    lengths = (len(local.header), local.nbytes)
    rows = preamble.exchange(
        _all_gather_into, g, call, root, lengths, local.devices, first=first, problem=problem
    ).rows
    device = data_device(g, [r[preamble.PLACEMENT] for r in rows])
    stride = max(wire.padded(r[preamble.HEADER]) + wire.padded(r[preamble.NBYTES]) for r in rows)
    return local, rows, device, stride


def _full_all_gather(
    g: Group,
    tree: Any,
    layout: Any,
    dim: int,
    sizes: int | None,
    call: int,
    first: bool,
    problem: Problem | None,
    sync: bool,
) -> Any:
    """The full exchange: one header and bytes per rank, every check; the definition."""
    local, rows, device, stride = _full_opening(
        g, tree, layout, dim, sizes, call, -1, first, problem, sync
    )
    out = torch.empty(stride * len(g.ranks), dtype=torch.uint8, device=device)
    _all_gather_into(out, wire.message_buffer(local, stride, device), g.handle)
    buffers = list(out.view(len(g.ranks), stride))
    headers = wire.read_headers(buffers, [r[preamble.HEADER] for r in rows])
    try:
        errors.check(g.ranks, headers, local, layout, dim)
    except errors.StructuresDiffer:
        errors.name_differences(_all_gather_into, g, local)
    return combine.full(g, headers, buffers, rows, local, device, layout, dim, tree)


def _checked_dim(dim: Any) -> tuple[int, Problem | None]:
    """``dim`` as an int (``numpy.int64`` too), or what is wrong with it. Never raises: the
    problem travels in the first exchange, so that every rank raises it, none waits."""
    if type(dim) is int:
        return dim, None
    try:
        return check_dim(dim, "dim"), None
    except ArgumentTypeError as exc:
        return 0, (ArgumentTypeError, str(exc).partition(": ")[2])


def _either(*problems: Problem | None) -> Problem | None:
    """This rank's problems as one (``None``: none)."""
    found = [p for p in problems if p is not None]
    if not found:
        return None
    typed = any(cls is ArgumentTypeError for cls, _ in found)
    return (ArgumentTypeError if typed else found[0][0]), "; ".join(text for _, text in found)


def _fast_lengths(
    fast: plan.Local | None,
) -> tuple[tuple[int, int], frozenset[torch.device]]:
    """The row's lengths and this rank's devices, for a wire-plan call."""
    return ((0, 0), frozenset()) if fast is None else ((0, fast.nbytes), fast.devices)


def gather(
    tree: Any,
    dst: int,
    layout: Any,
    group: Any,
    dim: int,
    sizes: int | None,
    finish: Callable[[Any], Any] | None = None,
    call: int = preamble.GATHER,
) -> Any:
    """:func:`treegather.distributed.gather`; ``dst`` applies ``finish`` to the result, within
    the outcome it sends (an error there raises on every rank); ``call`` as for
    :func:`all_gather`."""
    g = process_group(group)
    # A dst that names no rank (or a bad dim) travels in the first exchange: every rank
    # raises, none waits.
    root, bad_root = root_rank(g, dst, "dst")
    if bad_root is None:
        dst = g.ranks[root]
    dim, bad_dim = _checked_dim(dim)
    problem = _either(bad_root, bad_dim)
    if not FAST_PATHS.on or problem is not None:
        return _full_gather(g, dst, root, tree, layout, dim, sizes, call, True, problem, finish)
    fast = plan.prepare(tree, layout, dim, sizes)
    opening = preamble.exchange(_all_gather_into, g, call, root, *_fast_lengths(fast), fast)
    fast, nbytes = opening.fast, opening.nbytes
    if fast is None or not opening.agreed:
        return _full_gather(g, dst, root, tree, layout, dim, sizes, call, False, None, finish)
    if opening.inline:
        device, payloads = g.device, opening.payloads
    else:
        device = data_device(g, [r[preamble.PLACEMENT] for r in opening.rows])
        payloads = _gather_payloads(g, dst, root, fast, plan.padded(max(nbytes)), device)
    return outcome.finish_gather(
        g,
        dst,
        root,
        _then(finish, lambda: combine.fast(g, fast, payloads, nbytes, device, layout, dim)),
    )


def _then(finish: Callable[[Any], Any] | None, combine: Callable[[], Any]) -> Callable[[], Any]:
    return combine if finish is None else lambda: finish(combine())


def _gather_payloads(
    g: Group, dst: int, root: int, fast: plan.Local, stride: int, device: torch.device
) -> payload.Payloads:
    """Gather every rank's payload to ``dst`` (elsewhere, what is returned is not read)."""
    send = torch.empty(stride, dtype=torch.uint8, device=device)
    payload.send(fast, stride, device, send)
    if g.rank != root:
        dist.gather(send, None, dst=dst, group=g.handle)
        return payload.Payloads(send, 0, stride)
    buf = receive_buffer(g, stride * len(g.ranks), device, keep=fast.plan.vectorised)
    dist.gather(send, list(buf.view(len(g.ranks), stride)), dst=dst, group=g.handle)
    return payload.Payloads(buf, 0, stride)


def _full_gather(
    g: Group,
    dst: int,
    root: int,
    tree: Any,
    layout: Any,
    dim: int,
    sizes: int | None,
    call: int,
    first: bool,
    problem: Problem | None,
    finish: Callable[[Any], Any] | None,
) -> Any:
    local, rows, device, stride = _full_opening(
        g, tree, layout, dim, sizes, call, root, first, problem
    )
    send = wire.message_buffer(local, stride, device)
    received: list[torch.Tensor] | None = None
    if g.rank == root:
        received = list(torch.empty(len(g.ranks), stride, dtype=torch.uint8, device=device))
    dist.gather(send, received, dst=dst, group=g.handle)

    def result() -> Any:
        assert received is not None
        headers = wire.read_headers(received, [r[preamble.HEADER] for r in rows])
        errors.check(g.ranks, headers, local, layout, dim)
        return combine.full(g, headers, received, rows, local, device, layout, dim)

    return outcome.finish_gather(
        g,
        dst,
        root,
        _then(finish, result),
        lambda: errors.name_differences(_all_gather_into, g, local),
    )


def broadcast(tree: Any, src: int, group: Any) -> Any:
    """:func:`treegather.distributed.broadcast`."""
    g = process_group(group)
    # A src that names no rank travels in the first exchange: every rank raises, none waits.
    root, problem = root_rank(g, src, "src")
    if problem is None:
        src = g.ranks[root]
    local = wire.encode(tree, None, with_spec=True) if g.rank == root else wire.Packed(None, b"")
    lengths = (len(local.header), local.nbytes)
    rows = preamble.exchange(
        _all_gather_into, g, preamble.BROADCAST, root, lengths, local.devices, problem=problem
    ).rows
    device = data_device(g, [r[preamble.PLACEMENT] for r in rows])
    head_len, data_len = rows[root][preamble.HEADER], rows[root][preamble.NBYTES]
    stride = wire.padded(head_len) + data_len
    if g.rank == root:
        buf = wire.message_buffer(local, stride, device)
    else:
        buf = torch.empty(stride, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=g.handle)
    header = wire.read_headers([buf], [head_len])[0]
    if "error" in header:
        cls = errors.ERROR_CLASSES.get(header["error"][0], TreegatherError)
        raise cls(f"on rank {src}: {header['error'][1]}")
    if g.rank == root:
        return tree
    leaves = wire.decode(header, buf[wire.padded(head_len) :])
    for i, m in enumerate(header["meta"]):
        if m is not None:
            leaves[i] = leaves[i].to(receiving_device(m[2]), copy=True)
    wire.place_held(header, leaves)
    return header["spec"].unflatten(leaves)
