"""How ``gather``'s ``dst`` tells the other ranks how the call went.

Only ``dst`` receives the ranks' trees, so only ``dst`` can check and combine them; the other
ranks wait for one small broadcast of the outcome (a second one carries the error message), so
that a mismatch or a failing custom rule raises on every rank, not only on ``dst``: the same
error for treegather's own errors (:func:`treegather.distributed.errors.rebuild_error`), a
``RuntimeError`` naming the original otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import errors
from .group import Group
from .wire import tensor_bytes

__all__ = ["finish_gather"]

_OK, _FAILED, _DIFFERENT_STRUCTURES = 0, 1, 2


def finish_gather(
    g: Group,
    dst: int,
    root: int,
    combine: Callable[[], Any],
    name_differences: Callable[[], None] | None = None,
) -> Any:
    """``dst`` combines and broadcasts the outcome; the other ranks raise what ``dst`` raised.

    ``name_differences`` (the full exchange only) is the exchange every rank joins to name the
    differences when the structures differ; it raises.
    """
    if g.rank != root:
        code, payload = _status(g, dst)
        if code == _OK:
            return None
        if code == _DIFFERENT_STRUCTURES and name_differences is not None:
            name_differences()
        raise errors.rebuild_error(payload, dst)
    try:
        result = combine()
    except errors.StructuresDiffer:
        assert name_differences is not None
        _status(g, dst, _DIFFERENT_STRUCTURES)
        name_differences()
        raise
    except Exception as exc:
        # The other ranks wait for this status: tell them what went wrong, then raise here.
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
