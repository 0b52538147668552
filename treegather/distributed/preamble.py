"""The first collective of every :mod:`treegather.distributed` call: rows and the inline area.

Every call starts with one all-gather of ``ROW_BYTES + capacity`` bytes per rank. The first
``ROW_BYTES`` are this rank's *row* of ten ``int64``::

    [magic, call, root (dst/src), header bytes, payload bytes, placement, digest (2), inline,
     problem]

``digest`` is the wire plan's (:mod:`treegather.distributed.plan`; ``(0, 0)``: no plan on this rank)
and ``inline`` says whether the rank's wire-plan payload follows the row in the same buffer.
``problem`` says that an argument check this rank made before the exchange failed (a ``dst``
that names no rank): the rank still joins the exchange, and then every rank joins one more to
learn each such rank's message and raises the same error, instead of the others waiting for
a rank that raised on its own.
When every rank sent the same digest and its payload inline, that one collective is the whole
call (``gather``: plus the outcome), up to ``MAX_INLINE`` (1 MiB) per rank; a Collector's
exchange is one such call (``COLLECT`` in the row). Otherwise see :mod:`.protocol`, step 2.

How ``capacity`` follows the payloads: :func:`next_capacity` (ARCHITECTURE.md, "The wire plan,
in detail").
"""

from __future__ import annotations

import array
import pickle
from collections.abc import Sequence
from typing import NamedTuple, NoReturn

import torch

from .._errors import ArgumentTypeError, StructureMismatchError
from . import errors, group, payload, plan
from .group import Collective, Group, Problem
from .payload import Payloads
from .plan import Local
from .wire import format_problems

__all__ = [
    "ROW_BYTES",
    "First",
    "check_calls",
    "exchange",
    "next_capacity",
    "raise_problems",
    "row",
    "write_row",
]

MAGIC = 0x7467_6472  # identifies a treegather preamble
ALL_GATHER, GATHER, BROADCAST, COLLECT = 1, 2, 3, 4
CALL_NAMES = {
    ALL_GATHER: "all_gather",
    GATHER: "gather",
    BROADCAST: "broadcast",
    COLLECT: "Collector.all_gather",  # (Collector.gather when it has a root)
}
# Positions in a row.
CALL, ROOT, HEADER, NBYTES, PLACEMENT, DIGEST, INLINE, PROBLEM = 1, 2, 3, 4, 5, slice(6, 8), 8, 9
ROW_INTS = 10
ROW_BYTES = 8 * ROW_INTS  # a multiple of 16: the inline payload starts aligned
MAX_INLINE = 1 << 20  # bytes per rank; larger payloads take their own collective
_GRAIN = 1 << 10


def row(
    call: int,
    root: int,
    lengths: tuple[int, int],
    placement: int,
    digest: tuple[int, int] = (0, 0),
    inline: bool = False,
    problem: bool = False,
) -> list[int]:
    """This rank's row."""
    return [MAGIC, call, root, *lengths, placement, *digest, int(inline), int(problem)]


def write_row(buf: torch.Tensor, values: Sequence[int]) -> None:
    """Write ``values`` into the first ``ROW_BYTES`` of ``buf`` (``uint8``, any device)."""
    ints = torch.frombuffer(array.array("q", values), dtype=torch.int64)
    buf[:ROW_BYTES].view(torch.int64).copy_(ints)


def digests_agree(rows: Sequence[Sequence[int]]) -> bool:
    """Every rank has a wire plan, and the same one (same structure, dtypes, layout, ...)."""
    first = rows[0][DIGEST]
    return first != [0, 0] and all(r[DIGEST] == first for r in rows)


def all_inline(rows: Sequence[Sequence[int]]) -> bool:
    """Every rank's payload came with its row."""
    return all(r[INLINE] for r in rows)


def check_calls(ranks: Sequence[int], rows: Sequence[Sequence[int]]) -> None:
    """Raise :class:`StructureMismatchError` unless the ranks made the same call."""
    if len({(r[0], r[CALL], r[ROOT]) for r in rows}) > 1:
        raise StructureMismatchError(
            format_problems(
                "the ranks of the group made different treegather.distributed calls",
                [f"rank {ranks[i]}: {_describe_call(ranks, r)}" for i, r in enumerate(rows)],
                "every rank must make the same call, with the same dst/src, in the same order",
            )
        )


def raise_problems(
    collective: Collective, g: Group, rows: Sequence[Sequence[int]], problem: Problem | None
) -> NoReturn:
    """Some rank's arguments failed a check before the first exchange (its row says so): every
    rank joins one more exchange of the ranks' messages and raises the same error, naming each
    such rank and its call. An :class:`~treegather.ArgumentTypeError` when any argument has
    the wrong type, else a ``ValueError``."""
    mine = None if problem is None else (problem[0] is ArgumentTypeError, problem[1])
    found = errors.exchange_objects(
        collective, g, pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL)
    )
    problems, typed = [], False
    for rank, (values, item) in enumerate(zip(rows, found)):
        if item is None:
            continue
        is_type, text = item
        typed = typed or is_type
        problems.append(f"rank {g.ranks[rank]}: {_call_name(values)}: {text}")
    message = format_problems(
        "an argument of the call is wrong on some rank (every rank raises this error)",
        problems or ["a rank reported a problem it did not describe"],
        "every rank must make the same call with valid arguments; dst= and src= are global "
        f"ranks of the process group (ranks {g.ranks})",
    )
    raise (ArgumentTypeError if typed else ValueError)(message)


def _describe_call(ranks: Sequence[int], values: Sequence[int]) -> str:
    magic, call, root = values[:3]
    if magic != MAGIC:
        return "not a treegather.distributed call"
    text = _call_name(values)
    if 0 <= root < len(ranks):
        text += f"(..., {'src' if call == BROADCAST else 'dst'}={ranks[root]})"
    return text


def _call_name(values: Sequence[int]) -> str:
    call, root = values[CALL], values[ROOT]
    if call == COLLECT:
        return "Collector.all_gather" if root < 0 else "Collector.gather"
    return f"treegather.distributed.{CALL_NAMES.get(call, '?')}"


def next_capacity(capacity: int, rows: Sequence[Sequence[int]]) -> int:
    """The inline capacity after a call whose first collective returned ``rows``.

    A function of ``rows`` alone (and the previous capacity), so the same on every rank. Only
    an agreed wire-plan call (all-gather or gather, or a Collector's exchange) moves it: up to
    its largest payload plus a quarter (a Collector's: a sixteenth) when that did not fit, down
    when the payloads shrank below a quarter of it.

    >>> rows = [row(ALL_GATHER, -1, (0, 3000), 0, (5, 6), True)] * 2  # 3000-byte payloads
    >>> next_capacity(0, rows), next_capacity(4096, rows), next_capacity(65536, rows)
    (4096, 4096, 4096)
    >>> next_capacity(0, [row(ALL_GATHER, -1, (0, 3000), 0)] * 2)  # no plan: unchanged
    0
    >>> next_capacity(0, [row(COLLECT, -1, (0, 30000), 0, (5, 6), True)] * 2)
    32768
    """
    calls = {r[CALL] for r in rows}
    call = calls.pop() if len(calls) == 1 else None
    if call not in (ALL_GATHER, GATHER, COLLECT) or not digests_agree(rows):
        return capacity
    need = max(r[NBYTES] for r in rows)
    if need > MAX_INLINE or capacity // 4 <= need <= capacity:
        return capacity
    # A Collector's payload is about the same at every evaluation (the same dataset): less
    # headroom, so fewer zeros travel with it.
    room = need // 16 if call == COLLECT else need // 4
    return min(MAX_INLINE, -(-(need + room) // _GRAIN) * _GRAIN)


class First(NamedTuple):
    """What the first collective of a call returned."""

    rows: list[list[int]]  # every rank's row
    payloads: Payloads  # every rank's inline payload (meaningful when ``inline``)
    fast: Local | None  # this rank's wire-plan call, checked (None: it sent no plan)
    agreed: bool  # every rank sent the same wire plan
    inline: bool  # every rank's payload came with its row
    nbytes: list[int]  # every rank's payload bytes


def exchange(
    collective: Collective,
    g: Group,
    call: int,
    root: int,
    lengths: tuple[int, int],
    devices: frozenset[torch.device],
    fast: Local | None = None,
    *,
    first: bool = True,
    problem: Problem | None = None,
) -> First:
    """All-gather every rank's row, with its wire-plan payload when that fits; check the calls.

    ``collective(out, inp, group)`` is the all-gather (:mod:`treegather.distributed`'s). The
    first collective of a call carries the group's inline area (``g.state.capacity`` bytes per
    rank, the same on every rank), filled or zeroed; a later one (``first=False``) only rows.
    The row and the payload's head are written, and read back, together. ``problem``: what is
    wrong with this rank's arguments (then no plan is sent); when any rank has one, every rank
    raises the same error (:func:`raise_problems`).
    """
    area = g.state.capacity if first else 0
    stride = ROW_BYTES + area
    out = torch.empty(stride * len(g.ranks), dtype=torch.uint8, device=g.device)
    mine = out[g.rank * stride : (g.rank + 1) * stride]
    placement = group.placement(g, devices)
    if problem is not None:
        fast = None
        write_row(mine, row(call, root, lengths, placement, problem=True))
        if area:
            mine[ROW_BYTES:].zero_()
        inline = False
    else:
        fast, inline = _fill(g, mine, (call, root, lengths, placement), fast)
    n = ROW_INTS + (fast.plan.head_ints if inline and fast is not None else 0)
    ints = _exchanged(collective, g, out, mine, n, problem)
    rows = [values[:ROW_INTS] for values in ints]
    heads = [values[ROW_INTS:] for values in ints] if n > ROW_INTS else None
    payloads = Payloads(out, ROW_BYTES, stride, heads)
    nbytes = [r[NBYTES] for r in rows]
    return First(rows, payloads, fast, digests_agree(rows), all_inline(rows), nbytes)


def _fill(
    g: Group, mine: torch.Tensor, fields: tuple[int, int, tuple[int, int], int], fast: Local | None
) -> tuple[Local | None, bool]:
    """Write this rank's row (``fields``: call, root, lengths, placement) and, when it fits,
    its payload after it. Returns the plan this rank sends (``None``: none) and whether its
    payload is inline.
    """
    area = mine.numel() - ROW_BYTES
    inline = fast is not None and fast.nbytes <= area and fields[3] != 1
    if fast is not None and not inline:
        fast = plan.checked(fast)  # packed later, once the ranks agreed: check it now
    if fast is not None and inline:
        values = row(*fields, fast.plan.digest, inline=True)
        if payload.send(fast, mine.numel(), g.device, mine, prefix=values):
            return fast, True
        plan.refuted(fast)
        fast = None  # another device, layout or shape past the first tensor: no plan from here
    write_row(mine, row(*fields) if fast is None else row(*fields, fast.plan.digest))
    if area:
        mine[ROW_BYTES:].zero_()
    return fast, False


def _exchanged(
    collective: Collective,
    g: Group,
    out: torch.Tensor,
    mine: torch.Tensor,
    n: int,
    problem: Problem | None,
) -> list[list[int]]:
    """The first collective, once this rank's slot ``mine`` of ``out`` is written: every
    rank's first ``n`` ints (its row, then the head of an inline payload), the capacity moved
    on, the ranks' problems raised, the calls checked."""
    # In place: this rank's chunk of the output is its input (NCCL and gloo both accept that).
    collective(out, mine, g.handle)
    ints: list[list[int]] = out.view(len(g.ranks), -1)[:, : 8 * n].view(torch.int64).tolist()
    rows = [values[:ROW_INTS] for values in ints]
    # From the rows alone, before anything can raise: every rank keeps the same capacity.
    g.state.capacity = next_capacity(g.state.capacity, rows)
    if any(r[PROBLEM] for r in rows):
        raise_problems(collective, g, rows, problem)
    check_calls(g.ranks, rows)
    return ints
