"""Coalesced host-device copies: many small tensors moved in one copy per dtype.

Moving a batch of many small tensors to a GPU one ``.to()`` at a time costs one transfer (and
its launch overhead) per tensor. :func:`coalesced_to` packs the small contiguous tensors of each
dtype into one staging buffer (pinned host memory when copying from the CPU to CUDA, so the
copy is asynchronous), makes one copy per dtype, and hands back views of the copied buffer.
Large or non-contiguous tensors (channels-last pieces keep their memory format), and tensors
autograd tracks (a view of a split may not be modified in place, a copy may), are moved one by
one, as ``.to()`` would. The compiled layer uses it for scatters of CPU batches to CUDA devices;
it works between any two devices, which is how it is tested on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["SMALL_BYTES", "coalesced_to"]

Tensor = torch.Tensor
SMALL_BYTES = 1 << 16  # tensors up to this size are packed; larger ones get a copy of their own


def coalesced_to(tensors: Sequence[Tensor], device: torch.device) -> list[Tensor]:
    """``[t.to(device) for t in tensors]``, the small ones in one copy per dtype (and source).

    Values, shapes and dtypes are those of ``.to()``; each packed result is a view of one
    buffer on ``device`` (disjoint from the others). Tensors that require grad (with grad
    enabled) get a copy of their own, differentiable as ``.to()``. Always copies, even to the
    tensors' own device.

    >>> xs = [torch.arange(3.0), torch.ones(2, 2), torch.tensor(7), torch.zeros(0, 5)]
    >>> ys = coalesced_to(xs, torch.device("cpu"))
    >>> [torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(xs, ys)]
    [True, True, True, True]
    >>> ys[0].data_ptr() != xs[0].data_ptr(), ys[0].untyped_storage().data_ptr() == ys[1].untyped_storage().data_ptr()
    (True, True)
    """
    out: list[Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    grad = torch.is_grad_enabled()
    for i, t in enumerate(tensors):
        packable = t.layout == torch.strided and t.is_contiguous() and _nbytes(t) <= SMALL_BYTES
        if packable and not (grad and t.requires_grad):
            groups.setdefault((t.device, t.dtype), []).append(i)
        else:
            out[i] = t.to(device, non_blocking=device.type == "cuda", copy=True)
    for positions in groups.values():
        parts = [tensors[i] for i in positions]
        buffer = _staged(parts, device)
        moved = buffer.to(device, non_blocking=buffer.is_pinned(), copy=True)
        pieces = moved.split([p.numel() for p in parts])
        for i, piece, part in zip(positions, pieces, parts):
            out[i] = piece.view(part.shape)
    return out  # type: ignore[return-value]


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _staged(parts: list[Tensor], device: torch.device) -> Tensor:
    """One flat tensor holding ``parts`` (pinned when it goes from the CPU to CUDA)."""
    flat = [p.detach().reshape(-1) for p in parts]  # (none is tracked: see coalesced_to)
    if device.type == "cuda" and parts[0].device.type == "cpu":
        total = sum(p.numel() for p in parts)
        pinned = torch.empty(total, dtype=parts[0].dtype, pin_memory=True)
        return torch.cat(flat, out=pinned)
    return torch.cat(flat)
