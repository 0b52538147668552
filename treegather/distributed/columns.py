"""A Collector's payload, and its exchange in one collective (the fast layer beside the definition).

One rank's adds, joined by :class:`~treegather.distributed.collector.Collector`, are a
:class:`Payload`: the dataset index of every row, the rows of every add, and per position of
the plan of one add one value: a tensor of every row (per-sample tensors), a list of strings
as :class:`~treegather.distributed.samples.Texts`, anything else
:class:`~treegather.distributed.samples.Opaque`.

The *definition* of the exchange is one :func:`treegather.distributed.all_gather` of every
rank's payload under ``as_list()`` (the existing machinery; ``gather``: to ``dst``). This module
is the fast way to the same payloads: when every rank's payload has the same digest (the
structure of its first add and what each position is, each tensor's dtype and trailing shape,
the layout), every rank's bytes travel in the call's first collective, after its row
(:func:`~treegather.distributed.preamble.exchange_written`), or in one more all-gather when one
does not fit the group's inline capacity (``gather``: a gather to ``dst``, then the outcome).
Otherwise (a rank with a problem or with nothing added, a digest that differs, a value this
layer does not pack, tensors off the CPU) that rank's row carries no digest, and every rank
takes the definition, one collective later. On a group whose exchanges run on the GPU (NCCL)
every rank takes the definition at once.
:func:`treegather.reference_only` turns this layer off.

One rank's bytes, each part starting 16-byte aligned::

    [head: rows, adds, pickled bytes, then (bytes, items) per position] [dataset index per row]
    [rows per add] [per position: a tensor's bytes or UTF-8 bytes] [pickled: the Opaque values]
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .._caches import LRU
from . import outcome, preamble
from .group import Group, all_gather_into, receive_buffer, root_rank
from .group import group as process_group
from .plan import PACKABLE, padded
from .samples import Mine, Opaque, Texts
from .wire import tensor_bytes

__all__ = ["MIN_RUN", "Done", "Payload", "exchange", "leading_run"]

Tensor = torch.Tensor
INT64 = 8
# rows, adds, pickled bytes, then the indices' leading run (first, step, length); then two
# ints per position
HEAD = 6
MIN_RUN = 16  # indices from which a leading arithmetic run is sent as three ints
FIRST_VALUE = 3  # the parts: the head, the dataset indices, the rows per add, then the values
# Per (structure, what each position is, the layout's key): the digest the ranks compare.
_DIGESTS: LRU[Any, tuple[int, int]] = LRU("distributed.collector_digests", maxsize=64)


class Payload(NamedTuple):
    """One rank's adds, as they travel."""

    indices: Tensor  # the dataset index of every row, in add order
    rows: Tensor  # rows per add
    values: tuple[Any, ...]  # per plan position: a tensor of every row, Texts, or Opaque
    # (the structure down to the nodes taken whole, what each position is, the first add's)
    shape: Opaque
    # The leading arithmetic run of ``indices`` (first, step, length), when the sender knew it
    # (None: worked out when packed).
    run: tuple[int, int, int] | None = None


class Done(NamedTuple):
    """What :func:`exchange` returns when every rank's payload took the fast way."""

    result: Any  # what ``finish`` made of every rank's payloads (not returned but on dst)
    is_root: bool  # this rank is ``dst`` (always, for an all-gather)


class _Packed(NamedTuple):
    digest: tuple[int, int]
    descs: tuple[tuple[Any, ...], ...]  # per position: ("t", dtype, trailing), ("s",), ("o",)
    head: list[int]
    parts: list[Tensor]  # uint8, flat, one per part (the head first)
    spans: list[tuple[int, int]]  # (start, bytes) of each part
    nbytes: int


def exchange(
    local: Any,
    own: Sequence[Any],
    call: str,
    dst: int | None,
    group: Any,
    finish: Callable[[list[Payload]], Any],
) -> Done | None:
    """``finish`` of every rank's :class:`Payload` (in group rank order), each rank's bytes in
    one collective with the call's row, or ``None``: some rank cannot take this way, so every
    rank takes the definition. A group whose small exchanges run off the CPU (NCCL) takes the
    definition with no collective here.

    When the payloads came with the rows (or for an all-gather) every rank has them all and
    runs ``finish``, so that what it raises, it raises on every rank. A gather whose payloads
    do not fit sends them to ``dst`` alone (one ``gather``); ``dst`` runs ``finish`` and
    broadcasts the outcome, as :func:`treegather.distributed.gather` does.

    ``local`` is this rank's payload, or anything else when it has none to send (a problem to
    report, nothing added): then this rank sends no digest. ``own``: its values before they
    were made to travel (its strings are taken from there, not decoded). A ``dst`` that names
    no rank reaches every rank in this first collective, and every rank raises it. ``call``:
    what else must agree (the layout's key, ``partial``), folded into the digest.
    """
    g = process_group(group)
    if g.device.type != "cpu":  # (the same on every rank of the group) the definition, at once
        return None
    root, problem = (-1, None) if dst is None else root_rank(g, dst, "dst")
    try:  # (whatever goes wrong here, the definition meets it too, and on every rank)
        packed = _pack(local, call) if isinstance(local, Payload) else None
    except Exception:
        packed = None
    digest, nbytes = (packed.digest, packed.nbytes) if packed is not None else ((0, 0), 0)

    def write(out: Tensor) -> None:
        assert packed is not None
        _write(packed, out)

    rows, first = preamble.exchange_written(
        all_gather_into, g, preamble.COLLECT, root, digest, nbytes, write, problem
    )
    if packed is None or not preamble.digests_agree(rows):
        return None
    assert isinstance(local, Payload)
    is_root = root in (-1, g.rank)
    if preamble.all_inline(rows):
        payloads = _read(g, first.buf, first.offset, first.stride, packed, local, own)
        return Done(finish(payloads), is_root)
    stride = padded(max(r[preamble.NBYTES] for r in rows))
    if dst is None:
        buf = receive_buffer(g, stride * len(g.ranks), g.device, keep=True)
        mine = buf[g.rank * stride : (g.rank + 1) * stride]
        _write(packed, mine)
        mine[packed.nbytes :].zero_()
        all_gather_into(buf, mine, g.handle)
        return Done(finish(_read(g, buf, 0, stride, packed, local, own)), True)
    send = torch.empty(stride, dtype=torch.uint8, device=g.device)
    _write(packed, send)
    send[packed.nbytes :].zero_()
    if not is_root:
        dist.gather(send, None, dst=dst, group=g.handle)
        return Done(outcome.finish_gather(g, dst, root, lambda: None), False)
    buf = receive_buffer(g, stride * len(g.ranks), g.device, keep=True)
    dist.gather(send, list(buf.view(len(g.ranks), stride)), dst=dst, group=g.handle)
    payloads = _read(g, buf, 0, stride, packed, local, own)
    return Done(outcome.finish_gather(g, dst, root, lambda: finish(payloads)), True)


# -------------------------------------------------------------------------------- packing


def _pack(local: Payload, call: str) -> _Packed | None:
    """This rank's bytes, or ``None`` when a value is not one this layer packs."""
    descs: list[tuple[Any, ...]] = []
    first, step, run = local.run if local.run is not None else leading_run(local.indices)
    head = [local.indices.numel(), local.rows.numel(), 0, first, step, run]
    parts = [_bytes(local.indices[run:]), local.rows.view(torch.uint8)]  # (rows: made dense)
    opaque: list[Any] = []
    for value in local.values:
        if type(value) is Tensor:
            if (
                value.dim() == 0
                or value.dtype not in PACKABLE
                or value.layout != torch.strided
                or value.device.type != "cpu"
                or value.requires_grad
            ):
                return None
            descs.append(("t", value.dtype, tuple(value.shape[1:])))
            data = _bytes(value)
            head += [data.numel(), value.shape[0]]
        elif type(value) is Texts:
            descs.append(("s",))
            data = value.data
            head += [data.numel(), value.items]
        elif type(value) is Opaque:
            descs.append(("o",))
            opaque.append(value)
            head += [0, 0]
            continue
        else:
            return None
        parts.append(data)
    if opaque:
        try:
            blob = pickle.dumps(opaque, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            return None  # the definition names what cannot travel
        head[2] = len(blob)
        parts.append(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    digest = _digest(local.shape.value, tuple(descs), call)
    if digest is None:
        return None
    parts.insert(0, torch.tensor(head, dtype=torch.int64).view(torch.uint8))
    spans, nbytes = _spans(head, descs)
    return _Packed(digest, tuple(descs), head, parts, spans, nbytes)


def leading_run(indices: Tensor) -> tuple[int, int, int]:
    """The leading arithmetic run of ``indices`` (first, step > 0, length; length 0: none),
    sent as three ints instead of its rows: ``DistributedSampler(shuffle=False)`` gives every
    rank one run (and its padding after it).

    >>> leading_run(torch.tensor([1, 3, 5, 7] * 5)), leading_run(torch.arange(4, 40, 2))
    ((0, 0, 0), (4, 2, 18))
    """
    n = indices.numel()
    if n < MIN_RUN:
        return 0, 0, 0
    first, second = indices[:2].tolist()
    step = second - first
    if step <= 0 or abs(first) + step * n >= 1 << 62:
        return 0, 0, 0
    same = indices == torch.arange(first, first + step * n, step)
    run = n if bool(same.all()) else int(same.cumprod(0).sum())
    return (first, step, run) if run >= MIN_RUN else (0, 0, 0)


def _bytes(t: Tensor) -> Tensor:
    """``t``'s values as flat ``uint8`` (a view when it is dense)."""
    if t.is_conj() or t.is_neg() or not t.is_contiguous():
        t = t.resolve_conj().resolve_neg().contiguous()
    return t.view(-1).view(torch.uint8)


def _spans(head: Sequence[int], descs: Sequence[tuple[Any, ...]]) -> tuple[list[Any], int]:
    """(start, bytes) of every part of a rank's bytes, from its head; and their total."""
    sizes = [INT64 * len(head), INT64 * (head[0] - head[5]), INT64 * head[1]]
    sizes += [head[HEAD + 2 * j] for j, d in enumerate(descs) if d[0] != "o"]
    if head[2]:
        sizes.append(head[2])
    spans, at = [], 0
    for n in sizes:
        spans.append((at, n))
        at += padded(n)
    return spans, at


def _write(packed: _Packed, out: Tensor) -> None:
    """Write the parts into ``out`` (``uint8``, at least ``nbytes``), the gaps zeroed."""
    end = 0
    for (start, n), part in zip(packed.spans, packed.parts):
        if start > end:
            out[end:start].zero_()
        out[start : start + n].copy_(part)
        end = start + n
    if packed.nbytes > end:
        out[end : packed.nbytes].zero_()


def _digest(
    shape: tuple[Any, ...], descs: tuple[tuple[Any, ...], ...], text: str
) -> tuple[int, int] | None:
    """What must agree between the ranks, as two int64 (``(0, 0)`` is "no digest")."""
    spec, kinds = shape[:2]
    try:  # (the bytes, not the spec, in the key: equal specs may order a dict's keys otherwise)
        raw_spec = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None
    key = (raw_spec, tuple(kinds), descs, text)
    found = _DIGESTS.get(key, False)
    if found is not False:
        return found
    h = hashlib.blake2b(raw_spec, digest_size=16)
    h.update(repr((list(kinds), [tuple(map(str, d)) for d in descs], text)).encode())
    raw = h.digest()
    digest = (
        int.from_bytes(raw[:8], "little", signed=True) or 1,
        int.from_bytes(raw[8:], "little", signed=True),
    )
    _DIGESTS.put(key, digest)
    return digest


# -------------------------------------------------------------------------------- reading


def _read(
    g: Group,
    buf: Tensor,
    base: int,
    stride: int,
    mine: _Packed,
    local: Payload,
    own: Sequence[Any],
) -> list[Payload]:
    """Every rank's payload from the buffer (views of it); this rank's strings as it sent them."""
    world = len(g.ranks)
    width = INT64 * len(mine.head)
    heads: list[list[int]] = (
        buf.view(world, stride)[:, base : base + width].view(torch.int64).tolist()
    )
    out: list[Payload] = []
    for r, head in enumerate(heads):
        at = r * stride + base
        spans, _ = _spans(head, mine.descs)
        parts = [buf[at + s : at + s + n] for s, n in spans]
        rows = head[0]
        values: list[Any] = []
        k = FIRST_VALUE
        blob = pickle.loads(tensor_bytes(parts[-1])) if head[2] else []
        opaque = iter(blob)
        for j, desc in enumerate(mine.descs):
            if desc[0] == "t":
                dtype, trailing = desc[1], desc[2]
                values.append(parts[k].view(dtype).view(rows, *trailing))
                k += 1
            elif desc[0] == "s":  # this rank's own strings as they were added (not decoded)
                items = head[HEAD + 2 * j + 1]
                values.append(Mine(own[j]) if r == g.rank else Texts(parts[k], items))
                k += 1
            else:
                values.append(next(opaque))
        indices = parts[1].view(torch.int64)
        first, step, run = head[3:HEAD]
        if run:  # the leading run, sent as three ints
            line = torch.arange(first, first + step * run, step)
            indices = torch.cat([line, indices]) if indices.numel() else line
        per_add = parts[2].view(torch.int64)
        out.append(Payload(indices, per_add, tuple(values), local.shape, (first, step, run)))
    return out
