"""``torch.nn.utils.rnn.PackedSequence`` as a value laid out by rows its own way.

A ``PackedSequence`` is a namedtuple of ``data`` (every sequence's steps, time-major: step 0 of
each sequence, then step 1, ...), ``batch_sizes`` (how many sequences are still running at each
step) and the sort permutation. None of its fields is laid out by rows: split field by field,
or joined field by field (``batch_sizes`` concatenated), it comes back as another batch without
an error. Here it is a node of one :class:`~treegather._tree.Rows` child: scatter unpacks it,
cuts its sequences like the batch and packs each shard again; gather unpacks every replica's,
joins the sequences in order and packs them again (sorted without a permutation when the
original was, and the joined sequences still are). A user's own registration of the class wins.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence, pack_sequence, unpack_sequence

from ._tree.batch import Rows, RowsKind, rows_kind, unwrapped
from ._tree.registry import register_default

__all__ = ["PACKED"]


def _rows(packed: PackedSequence) -> int:
    return int(packed.batch_sizes[0]) if packed.batch_sizes.numel() else 0


def _packed(sequences: list[torch.Tensor], sorted_before: bool) -> PackedSequence:
    lengths = [len(s) for s in sequences]
    ordered = sorted_before and all(a >= b for a, b in itertools.pairwise(lengths))
    return pack_sequence(sequences, enforce_sorted=ordered)


def _split(packed: PackedSequence, sizes: Sequence[int]) -> list[PackedSequence]:
    if not _rows(packed):
        return [packed for _ in sizes]
    sequences = unpack_sequence(packed)
    sorted_before = packed.sorted_indices is None
    out, start = [], 0
    for n in sizes:
        out.append(_packed(sequences[start : start + n], sorted_before))
        start += n
    return out


def _join(values: Sequence[PackedSequence]) -> PackedSequence:
    sequences = [s for v in values if _rows(v) for s in unpack_sequence(v)]
    return _packed(sequences, all(v.sorted_indices is None for v in values))


def _to(packed: PackedSequence, device: torch.device) -> PackedSequence:
    return packed if packed.data.device == device else packed.to(device)  # type: ignore[arg-type]


PACKED = rows_kind(RowsKind("PackedSequence", _rows, _split, _join, _to))


def _flatten(packed: PackedSequence) -> tuple[list[Any], None, tuple[str]]:
    return [Rows(packed, PACKED)], None, ("rows",)


def _unflatten(_: None, children: Iterable[Any]) -> Any:
    (child,) = children
    return unwrapped(child)


register_default(PackedSequence, _flatten, _unflatten)
