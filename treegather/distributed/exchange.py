"""Stage 2 of a :mod:`treegather.distributed` call: the collectives, bytes in and bytes out.

Every call starts with one all-gather of ``ROW_BYTES + capacity`` bytes per rank: the rank's
*row* of ten ``int64``::

    [magic, call, root (dst/src), header bytes, payload bytes, placement, digest (2), inline,
     problem]

then, in the same buffer, its payload when :func:`~treegather.distributed.describe.describe`
packed it there (it fits the group's inline *capacity*). What follows depends on the rows alone,
so every rank takes the same way:

1. every rank sent the same digest and its payload inline: that was the whole exchange;
2. the same digests, but a payload did not fit: one all-gather (``gather``: a gather to
   ``dst``) of every payload, packed straight into the receive buffer;
3. a digest differs (a new structure, a rank with a problem, :func:`treegather._caches.
   reference_only`): one all-gather (gather) of every rank's header and payload.

A rank whose argument check failed before the exchange (a ``dst`` that names no rank) says so
in its row; every rank then joins one more exchange of the messages and raises the same error.
``gather``'s ``dst`` then tells the others how the call went (:func:`finish_gather`).

The capacity (:func:`next_capacity`) is protocol state: a function of the rows every rank
received, the same on every rank (ARCHITECTURE.md, "The wire plan, in detail").
"""

from __future__ import annotations

import array
import pickle
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

from .._errors import ArgumentTypeError, StructureMismatchError
from . import errors
from .describe import format_problems
from .group import Group, Problem, data_device, placement, receive_buffer
from .payload import Local, padded, write

__all__ = [
    "ALL_GATHER",
    "Arrived",
    "BROADCAST",
    "COLLECT",
    "GATHER",
    "ROW_BYTES",
    "all_gather",
    "broadcast",
    "finish_gather",
    "gather",
    "next_capacity",
    "objects",
    "tensor_bytes",
]

MAGIC = 0x7467_6472  # identifies a treegather row
ALL_GATHER, GATHER, BROADCAST, COLLECT = 1, 2, 3, 4
CALL_NAMES = {ALL_GATHER: "all_gather", GATHER: "gather", BROADCAST: "broadcast"}
# Positions in a row.
CALL, ROOT, HEADER, NBYTES, PLACEMENT, DIGEST, INLINE, PROBLEM = 1, 2, 3, 4, 5, slice(6, 8), 8, 9
ROW_INTS = 10
ROW_BYTES = 8 * ROW_INTS  # a multiple of 16: the inline payload starts aligned
MAX_INLINE = 1 << 20  # bytes per rank; larger payloads take their own collective
_GRAIN = 1 << 10
_OK, _FAILED, _DIFFERENT_STRUCTURES = 0, 1, 2  # gather's outcome


def _all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    """Every rank's ``inp`` into ``out``, in rank order (torch >= 2.13 names it
    ``all_gather_single``)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


IN_PLACE_MIN = 4 << 20  # bytes per rank from which payloads on the CPU are broadcast in place


def _in_place(g: Group, out: torch.Tensor, stride: int) -> None:
    """Every rank's ``stride`` bytes, written at its place in ``out``, on every rank.

    One all-gather, but for payloads of ``IN_PLACE_MIN`` bytes or more on the CPU: gloo's
    all-gather receives into a temporary of the whole output and copies it over, which doubles
    the call's memory at its peak; each rank's bytes are broadcast from it, in place, instead.
    """
    if out.device.type != "cpu" or stride < IN_PLACE_MIN:
        _all_gather_into(out, out[g.rank * stride : (g.rank + 1) * stride], g.handle)
        return
    for r, src in enumerate(g.ranks):
        dist.broadcast(out[r * stride : (r + 1) * stride], src=src, group=g.handle)


class Arrived(NamedTuple):
    """What the collectives brought: every rank's row, and its payload in ``buf`` (on ``dst``
    only, for ``gather``), with the headers when they travelled (the ranks' plans differ)."""

    rows: list[list[int]]
    buf: torch.Tensor  # uint8, 1-D
    offsets: list[int]  # where each rank's payload starts in ``buf``
    headers: list[dict[str, Any]] | None  # None: every rank has this rank's plan
    heads: list[list[int]] | None = None  # each payload's head ints, when read with the rows

    @property
    def nbytes(self) -> list[int]:
        return [r[NBYTES] for r in self.rows]


class _First(NamedTuple):
    rows: list[list[int]]
    arrived: Arrived | None  # every payload, when they all came inline with the same plan
    agreed: bool


def _first(
    g: Group, call: int, root: int, local: Local, problem: Problem | None, *, inline: bool = True
) -> _First:
    """The call's first collective: every rank's row, and its payload when it came inline."""
    area = g.state.capacity
    stride = ROW_BYTES + area
    here = placement(g, local.devices)
    sent = local.inline if inline and here != 1 and problem is None else None
    if sent is not None and sent.numel() == stride and sent.device == g.device:
        mine = sent
    else:
        mine = torch.zeros(stride, dtype=torch.uint8, device=g.device)
        if sent is not None and sent.numel() == stride:
            mine.copy_(sent)  # (packed where the tensors live: one copy)
        else:
            sent = None
    fields = (MAGIC, call, root, len(local.header), local.nbytes, here)
    row = [*fields, *local.digest, int(sent is not None), int(problem is not None)]
    mine[:ROW_BYTES].view(torch.int64).copy_(
        torch.frombuffer(array.array("q", row), dtype=torch.int64)
    )
    out = torch.empty(stride * len(g.ranks), dtype=torch.uint8, device=g.device)
    _all_gather_into(out, mine, g.handle)
    plan = local.plan
    n = ROW_INTS + (plan.head_ints if sent is not None and plan is not None else 0)
    ints: list[list[int]] = out.view(len(g.ranks), -1)[:, : 8 * n].view(torch.int64).tolist()
    rows = [values[:ROW_INTS] for values in ints]
    # From the rows alone, before anything can raise: every rank keeps the same capacity.
    g.state.capacity = next_capacity(g.state.capacity, rows)
    if any(r[PROBLEM] for r in rows):
        _raise_problems(g, rows, problem)
    _check_calls(g.ranks, rows)
    digest = rows[0][DIGEST]
    agreed = digest != [0, 0] and all(r[DIGEST] == digest for r in rows)
    if not (agreed and all(r[INLINE] for r in rows)):
        return _First(rows, None, agreed)
    offsets = [r * stride + ROW_BYTES for r in range(len(rows))]
    return _First(rows, Arrived(rows, out, offsets, None, [v[ROW_INTS:] for v in ints]), True)


def all_gather(g: Group, call: int, local: Local, problem: Problem | None = None) -> Arrived:
    """Every rank's payload on every rank (one collective, two, or two with the headers)."""
    first = _first(g, call, -1, local, problem)
    if first.arrived is not None:
        return first.arrived
    rows = first.rows
    device = data_device(g, [r[PLACEMENT] for r in rows])
    if first.agreed:
        stride = padded(max(r[NBYTES] for r in rows))
        assert local.plan is not None
        out = receive_buffer(g, stride * len(rows), device, keep=local.plan.vectorised)
        write(local, out[g.rank * stride : (g.rank + 1) * stride])  # (its place in the output)
        _in_place(g, out, stride)
        return Arrived(rows, out, [r * stride for r in range(len(rows))], None)
    stride = max(padded(r[HEADER]) + padded(r[NBYTES]) for r in rows)
    out = torch.empty(stride * len(rows), dtype=torch.uint8, device=device)
    _with_header(local, out[g.rank * stride : (g.rank + 1) * stride])
    _in_place(g, out, stride)
    return _with_headers(rows, out, stride)


def _with_header(local: Local, slot: torch.Tensor) -> None:
    """``slot`` as ``[header | pad | payload | pad]``."""
    head = len(local.header)
    slot.zero_()
    slot[:head].copy_(torch.frombuffer(bytearray(local.header), dtype=torch.uint8))
    if local.plan is not None:
        write(local, slot[padded(head) : padded(head) + padded(local.nbytes)])


def _with_headers(rows: list[list[int]], buf: torch.Tensor, stride: int) -> Arrived:
    """The arrival of headers and payloads at ``stride`` per rank."""
    headers, offsets = [], []
    for r, row in enumerate(rows):
        at = r * stride
        headers.append(pickle.loads(tensor_bytes(buf[at : at + row[HEADER]])))
        offsets.append(at + padded(row[HEADER]))
    return Arrived(rows, buf, offsets, headers)


def gather(
    g: Group, call: int, root: int, dst: int, local: Local, problem: Problem | None = None
) -> Arrived | None:
    """Every rank's payload on rank ``dst`` (``None`` elsewhere), unless every payload came
    inline with the rows, which every rank then holds."""
    first = _first(g, call, root, local, problem)
    if first.arrived is not None:
        return first.arrived
    rows = first.rows
    device = data_device(g, [r[PLACEMENT] for r in rows])
    if first.agreed:
        assert local.plan is not None
        stride = padded(max(r[NBYTES] for r in rows))
        send = torch.empty(stride, dtype=torch.uint8, device=device)
        write(local, send)
    else:
        stride = max(padded(r[HEADER]) + padded(r[NBYTES]) for r in rows)
        send = torch.empty(stride, dtype=torch.uint8, device=device)
        _with_header(local, send)
    if g.rank != root:
        dist.gather(send, None, dst=dst, group=g.handle)
        return None
    keep = first.agreed and local.plan is not None and local.plan.vectorised
    buf = receive_buffer(g, stride * len(rows), device, keep=keep)
    dist.gather(send, list(buf.view(len(rows), stride)), dst=dst, group=g.handle)
    if first.agreed:
        return Arrived(rows, buf, [r * stride for r in range(len(rows))], None)
    return _with_headers(rows, buf, stride)


def broadcast(g: Group, root: int, src: int, local: Local, problem: Problem | None) -> Arrived:
    """Rank ``src``'s header and payload on every rank (two collectives)."""
    rows = _first(g, BROADCAST, root, local, problem, inline=False).rows
    device = data_device(g, [r[PLACEMENT] for r in rows])
    stride = padded(rows[root][HEADER]) + padded(rows[root][NBYTES])
    buf = torch.empty(stride, dtype=torch.uint8, device=device)
    if g.rank == root:
        _with_header(local, buf)
    dist.broadcast(buf, src=src, group=g.handle)
    head = rows[root][HEADER]
    header = pickle.loads(tensor_bytes(buf[:head]))
    return Arrived([rows[root]], buf, [padded(head)], [header])


def finish_gather(
    g: Group,
    dst: int,
    root: int,
    combine: Callable[[], Any],
    name_differences: Callable[[], NoReturn],
) -> Any:
    """``dst`` combines (``combine``) and broadcasts the outcome; the other ranks raise what
    ``dst`` raised (:func:`~treegather.distributed.errors.rebuild_error`), or join the exchange
    that names the differences when the structures differ."""
    if g.rank != root:
        code, payload = _status(g, dst)
        if code == _OK:
            return None
        if code == _DIFFERENT_STRUCTURES:
            name_differences()
        raise errors.rebuild_error(payload, dst)
    try:
        result = combine()
    except errors.StructuresDiffer:
        _status(g, dst, _DIFFERENT_STRUCTURES)
        name_differences()
    except Exception as exc:  # the other ranks wait for this status: tell them, then raise here
        _status(g, dst, _FAILED, errors.outcome_of(exc))
        raise
    _status(g, dst, _OK)
    return result


def _status(g: Group, src: int, code: int = _OK, payload: bytes = b"") -> tuple[int, bytes]:
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
    return code, tensor_bytes(buf)


def objects(g: Group, payload: bytes) -> list[Any]:
    """All-gather one pickled object per rank (two collectives: error paths only)."""
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
        pickle.loads(tensor_bytes(b[:k])) for b, k in zip(out.view(len(g.ranks), stride), sizes)
    ]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a 1-dim ``uint8`` tensor on any device (without numpy).

    >>> tensor_bytes(torch.tensor([104, 105], dtype=torch.uint8)), tensor_bytes(torch.zeros(0, dtype=torch.uint8))
    (b'hi', b'')
    """
    out = bytearray(t.numel())
    if out:
        torch.frombuffer(out, dtype=torch.uint8).copy_(t)
    return bytes(out)


# ------------------------------------------------------------------------------ the rows


def next_capacity(capacity: int, rows: Sequence[Sequence[int]]) -> int:
    """The inline capacity after a call whose first collective returned ``rows``.

    A function of ``rows`` alone (and the previous capacity), so the same on every rank. Only
    an agreed call (all-gather or gather, or a Collector's exchange) moves it: up to its
    largest payload plus a quarter (a Collector's: a sixteenth) when that did not fit, down
    when the payloads shrank below a quarter of it.

    >>> def rows(call, nbytes, digest=(5, 6)):
    ...     return [[MAGIC, call, -1, 0, nbytes, 0, *digest, 1, 0]] * 2
    >>> next_capacity(0, rows(ALL_GATHER, 3000)), next_capacity(65536, rows(ALL_GATHER, 3000))
    (4096, 4096)
    >>> next_capacity(0, rows(ALL_GATHER, 3000, (0, 0))), next_capacity(0, rows(COLLECT, 30000))
    (0, 32768)
    """
    calls = {r[CALL] for r in rows}
    call = calls.pop() if len(calls) == 1 else None
    digest = rows[0][DIGEST]
    agreed = list(digest) != [0, 0] and all(r[DIGEST] == digest for r in rows)
    if call not in (ALL_GATHER, GATHER, COLLECT) or not agreed:
        return capacity
    need = max(r[NBYTES] for r in rows)
    if need > MAX_INLINE or capacity // 4 <= need <= capacity:
        return capacity
    # A Collector's payload is about the same at every evaluation (the same dataset): less
    # headroom, so fewer zeros travel with it.
    room = need // 16 if call == COLLECT else need // 4
    return min(MAX_INLINE, -(-(need + room) // _GRAIN) * _GRAIN)


def call_name(values: Sequence[int]) -> str:
    call, root = values[CALL], values[ROOT]
    if call == COLLECT:
        return "Collector.all_gather" if root < 0 else "Collector.gather"
    return f"treegather.distributed.{CALL_NAMES.get(call, '?')}"


def _check_calls(ranks: Sequence[int], rows: Sequence[Sequence[int]]) -> None:
    """Raise :class:`StructureMismatchError` unless the ranks made the same call."""
    if len({(r[0], r[CALL], r[ROOT]) for r in rows}) > 1:
        shown = []
        for i, values in enumerate(rows):
            text = "not a treegather.distributed call"
            if values[0] == MAGIC:
                text = call_name(values)
                if 0 <= values[ROOT] < len(ranks):
                    text += f"(..., {'src' if values[CALL] == BROADCAST else 'dst'}={ranks[values[ROOT]]})"
            shown.append(f"rank {ranks[i]}: {text}")
        raise StructureMismatchError(
            format_problems(
                "the ranks of the group made different treegather.distributed calls",
                shown,
                "every rank must make the same call, with the same dst/src, in the same order",
            )
        )


def _raise_problems(g: Group, rows: Sequence[Sequence[int]], problem: Problem | None) -> NoReturn:
    """Some rank's arguments failed a check before the exchange (its row says so): every rank
    joins one more exchange of the messages and raises the same error, naming each such rank
    and its call (an :class:`~treegather.ArgumentTypeError` when any argument has the wrong
    type, else a ``ValueError``)."""
    mine = None if problem is None else (problem[0] is ArgumentTypeError, problem[1])
    found = objects(g, pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL))
    problems, typed = [], False
    for rank, (values, item) in enumerate(zip(rows, found)):
        if item is not None:
            typed = typed or item[0]
            problems.append(f"rank {g.ranks[rank]}: {call_name(values)}: {item[1]}")
    message = format_problems(
        "an argument of the call is wrong on some rank (every rank raises this error)",
        problems or ["a rank reported a problem it did not describe"],
        "every rank must make the same call with valid arguments; dst= and src= are global "
        f"ranks of the process group (ranks {g.ranks})",
    )
    raise (ArgumentTypeError if typed else ValueError)(message)
