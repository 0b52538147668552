"""How values are pickled between ranks: torch's own pickling, but dense tensors as their bytes.

A tensor that is not a dense ``torch.Tensor`` (sparse, nested, quantized, meta, a subclass such
as ``Parameter``, ``MaskedTensor`` or a user's ``__torch_function__`` class) travels as torch
pickles it, so that it comes back as what it was, as it does within one process. torch pickles
a dense tensor through its typed storage, which cannot be unpickled for some dtypes (float8,
the unsigned ints above 8 bits, complex32, the bit dtypes: ``UntypedStorage has no attribute
dtype``), and every dense tensor inside another value (a sparse tensor's indices and values, a
subclass's data) goes that way too: :func:`dumps` pickles each dense ``torch.Tensor`` as its
dtype, shape and bytes instead, rebuilt on the CPU (results are new tensors, without autograd
history). :func:`loads` is :func:`pickle.loads`.

>>> x = {"ids": torch.arange(3).to(torch.uint16), "w": torch.ones(2).to_sparse()}
>>> back = loads(dumps(x))
>>> back["ids"], back["w"].layout
(tensor([0, 1, 2], dtype=torch.uint16), torch.sparse_coo)
"""

from __future__ import annotations

import copyreg
import io
import pickle
from typing import Any

import torch

__all__ = ["dumps", "loads", "plain"]

Tensor = torch.Tensor
PROTOCOL = pickle.HIGHEST_PROTOCOL
_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def plain(t: Tensor) -> bool:
    """A dense ``torch.Tensor`` (no subclass) with data: what travels as its bytes."""
    return (
        type(t) is Tensor
        and t.layout is torch.strided
        and not (t.is_quantized or t.is_nested or t.is_meta)
    )


def _reduce(t: Tensor) -> Any:
    """A dense tensor as its dtype, shape and bytes; any other as torch reduces it."""
    if not plain(t):
        return t.__reduce_ex__(PROTOCOL)
    flat = t.detach().reshape(-1).resolve_conj().resolve_neg().cpu().contiguous()
    data = bytearray(flat.numel() * flat.element_size())
    if data:  # (without numpy, which torch does not require)
        torch.frombuffer(data, dtype=torch.uint8).copy_(flat.view(torch.uint8))
    return _rebuild, (str(t.dtype), tuple(t.shape), bytes(data))


def _rebuild(dtype: str, shape: tuple[int, ...], data: bytes) -> Tensor:
    """A tensor of ``dtype`` and ``shape`` from its bytes, on the CPU."""
    raw = torch.empty(0, dtype=torch.uint8)
    if data:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(_DTYPES[dtype]).view(shape)


class _Pickler(pickle.Pickler):
    dispatch_table = copyreg.dispatch_table.copy()
    dispatch_table[Tensor] = _reduce


def dumps(value: Any) -> bytes:
    """``value`` pickled, dense tensors as their bytes (see the module)."""
    buf = io.BytesIO()
    _Pickler(buf, PROTOCOL).dump(value)
    return buf.getvalue()


loads = pickle.loads
