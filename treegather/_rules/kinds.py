"""What torch can do with a tensor's kind: its layout, whether it is nested, its dtype.

torch computes everything for dense tensors of the usual dtypes and less for other kinds: no
``cat`` of sparse CSR tensors, no ``sum`` in float8 or of quantized tensors, no ``equal`` in
complex32 or the bit dtypes, nothing for a meta tensor or an uninitialized parameter, which
hold no data (:func:`no_data`). A rule asks here, once per kind, whether it can combine values
of that kind (:func:`cannot`: the rule combines two small tensors of the kind, made for the
question), and refuses the kinds torch cannot combine with a typed error saying why and what
to use instead (:func:`refusal`). ``first(check=True)`` compares values of every kind
(:func:`same_values`). Only the error paths ask (a gather that failed, or one about to move
tensors between devices): a gather of dense tensors never does.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]

from .._caches import LRU
from .._errors import safe_repr
from .._tree import dtype_text

if TYPE_CHECKING:
    from .base import Combining, GatherRule

__all__ = [
    "ORDINARY",
    "cannot",
    "fix",
    "kind_text",
    "no_data",
    "no_data_text",
    "ordinary",
    "refusal",
    "same_values",
]

Tensor = torch.Tensor
Kind = tuple[torch.layout, torch.dtype, bool, str]
"""What decides which of torch's ops a tensor has: layout, dtype, nested, device type."""

# (the rule's probe, its weighting, the kind) -> "" (torch combines it) or why not
_CANNOT: LRU[Any, str] = LRU("rules.kinds_cannot", maxsize=256, trees=False)
# (dtype, device type) -> how values of that dtype are compared: as they are, upcast, bytes
_COMPARED: LRU[Any, Callable[[Tensor], Tensor]] = LRU(
    "rules.kinds_compared", maxsize=64, trees=False
)


# Dense dtypes every leaf-wise rule combines on every device (tests/test_leaf_kinds.py asks
# :func:`cannot` about each): their tensors are never asked about.
ORDINARY = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)


def ordinary(t: Tensor) -> bool:
    """A dense tensor of a dtype torch computes everything in (what :func:`cannot` need not
    be asked about)."""
    return t.dtype in ORDINARY and t.layout is torch.strided and not t.is_nested


def kind_of(t: Tensor) -> Kind:
    return (t.layout, t.dtype, t.is_nested, t.device.type)


def no_data(t: Tensor) -> bool:
    """A tensor that holds no values: a meta tensor, or a lazy module's uninitialized
    parameter or buffer (whose very shape is unknown)."""
    return isinstance(t, UninitializedTensorMixin) or t.is_meta


def no_data_text(t: Tensor, target: torch.device, shown: str) -> tuple[str, str]:
    """What a rule ``shown`` says of a tensor without data it would gather onto ``target``,
    and the key of its hint."""
    if isinstance(t, UninitializedTensorMixin):
        return f"an {type(t).__name__} holds no data to gather for {shown}", "uninitialized"
    return f"a meta tensor holds no data to gather onto {target} for {shown}", "meta"


def kind_text(t: Tensor) -> str:
    """How messages name a tensor's kind: ``sparse_csr float32``, ``nested (jagged) float32``,
    ``float8_e4m3fn``, ``qint8``."""
    dtype = dtype_text(t.dtype)
    layout = str(t.layout).removeprefix("torch.").strip("_")
    if t.is_nested:
        return f"nested ({layout}) {dtype}"
    if t.layout is not torch.strided:
        return f"{layout} {dtype}"
    return dtype


def fix(t: Tensor) -> str:
    """What to turn a tensor of ``t``'s kind into for torch to compute with it."""
    if t.is_nested:
        return "pad them into dense tensors first (torch.nested.to_padded_tensor(x, 0))"
    if t.layout is not torch.strided:
        return "make them dense first (.to_dense())"
    if t.is_quantized:
        return "dequantize them first (.dequantize())"
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return "cast them to a dtype torch computes in first (e.g. .float())"
    return "view or cast them as a dtype torch computes in first (e.g. .view(torch.uint8))"


def refusal(shown: str, verb: str, t: Tensor, why: str) -> str:
    """The message of a rule that cannot combine tensors of ``t``'s kind."""
    return (
        f"{shown} cannot {verb} {kind_text(t)} tensors: torch has no such operation for them "
        f"({why}); {fix(t)}, or keep the per-replica values with as_list()"
    )


def cannot(rule: GatherRule, t: Tensor, ctx: Combining, shape: tuple[int, ...] = (2, 2)) -> str:
    """Why ``rule`` cannot combine tensors of ``t``'s kind (``""``: it can), asked once per
    kind: ``rule.probe()`` combines two small tensors of the kind (of ``shape``, the second
    one column wider for a rule that pads). A kind no small tensor can be made of (a layout
    torch adds) is not refused here."""
    weighted = ctx.sizes is not None or getattr(rule, "weight", None) is not None
    probe = rule.probe()  # type: ignore[attr-defined]
    key = (probe, weighted, kind_of(t), shape)
    found = _CANNOT.get(key)
    if found is None:
        found = _ask(probe, weighted, t, ctx, shape)
        _CANNOT.put(key, found)
    return found


def _ask(probe: Any, weighted: bool, t: Tensor, ctx: Combining, shape: tuple[int, ...]) -> str:
    wider = (*shape[:-1], shape[-1] + 1) if probe.widens else shape
    a, b = specimen(t, shape), specimen(t, wider)
    if a is None or b is None:
        return ""
    asked = ctx._replace(target=a.device, moving=False, sizes=(1, 2) if weighted else None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch's warnings about prototype kinds)
            probe.combine((a, b), asked)
    except Exception as exc:
        return _said(exc)
    return ""


def _said(exc: BaseException) -> str:
    text = safe_repr(exc, 100, text=str).splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def specimen(like: Tensor, shape: tuple[int, ...]) -> Tensor | None:
    """A small tensor of ``like``'s kind (layout, dtype, nested, device), zeros where it can;
    ``None`` where none can be made."""
    layout, dtype, nested, device = kind_of(like)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            x = _of_dtype(torch.zeros(shape, device=device), dtype)
            if nested:  # rows one shorter each: ragged
                rows = [x[i, : shape[-1] - i] for i in range(shape[0])]
                return torch.nested.as_nested_tensor(rows, layout=layout)
            if layout is torch.strided:
                return x
            if layout is torch._mkldnn:  # type: ignore[attr-defined]
                return x.to_mkldnn()
            if layout in (torch.sparse_bsr, torch.sparse_bsc):
                return x.to_sparse(layout=layout, blocksize=(1, 1))
            return x.to_sparse(layout=layout)
    except Exception:
        return None


def _of_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` (float32 zeros) as ``dtype``: cast, quantized, or its bytes seen as ``dtype``."""
    if torch.empty(0, dtype=dtype).is_quantized:
        return torch.quantize_per_tensor(x, 1.0, 0, dtype)
    try:
        return x.to(dtype)
    except (RuntimeError, NotImplementedError):  # (bits, sub-byte ints: no cast to them)
        raw = torch.zeros(*x.shape[:-1], x.shape[-1] * dtype.itemsize, dtype=torch.uint8)
        return raw.to(x.device).view(dtype)


# ---------------------------------------------------------------------------------- equal


def same_values(x: Tensor, y: Tensor) -> bool:
    """Whether two tensors hold the same values: one kind (layout, dtype, nested), one shape,
    equal values, NaN equal to NaN in the same places.

    Every kind torch has: nested tensors component by component, sparse and mkldnn ones by
    their dense values, a ``MaskedTensor`` by its mask and the data the mask keeps, dtypes
    torch has no ``equal`` for (float8, complex32) in a wider dtype they convert to exactly,
    the bit dtypes (no conversion either) by their bytes, quantized ones by their quantizer and
    stored integers. Tensors without data raise."""
    if (x.layout, x.dtype, x.is_nested) != (y.layout, y.dtype, y.is_nested):
        return False
    if y.device != x.device:
        y = y.to(x.device)
    if x.is_nested:
        xs, ys = x.unbind(), y.unbind()
        return len(xs) == len(ys) and all(map(same_values, xs, ys))
    if x.shape != y.shape:
        return False
    masked = _masked_class()
    if masked is not None and isinstance(x, masked):
        if not isinstance(y, masked):
            return False
        mx: Any = x
        my: Any = y
        mask = mx.get_mask()
        if not same_values(mask, my.get_mask()):
            return False
        return same_values(mx.get_data()[mask], my.get_data()[mask])
    if x.layout is not torch.strided:
        x, y = x.to_dense(), y.to_dense()
    if x.is_quantized:  # (torch.equal reads past the bytes of quint4x2 and quint2x4 values)
        return _quantizer(x) == _quantizer(y) and torch.equal(x.int_repr(), y.int_repr())
    compared = _compared(x)
    x, y = compared(x), compared(y)
    if torch.equal(x, y):
        return True
    if not (x.is_floating_point() or x.is_complex()):
        return False
    if x.is_complex():
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    nan = x.isnan()
    return torch.equal(nan, y.isnan()) and torch.equal(x[~nan], y[~nan])


def _quantizer(t: Tensor) -> tuple[Any, ...]:
    """What maps a quantized tensor's stored integers to its values."""
    scheme = t.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return (scheme, t.q_scale(), t.q_zero_point())
    scales, points = t.q_per_channel_scales(), t.q_per_channel_zero_points()
    return (scheme, t.q_per_channel_axis(), tuple(scales.tolist()), tuple(points.tolist()))


def _masked_class() -> type | None:
    """``torch.masked.MaskedTensor``, where it was imported (no value is one otherwise)."""
    module = sys.modules.get("torch.masked.maskedtensor.core")
    return getattr(module, "MaskedTensor", None)


def _as_is(x: Tensor) -> Tensor:
    return x


def _bytes(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.uint8)


def _compared(x: Tensor) -> Callable[[Tensor], Tensor]:
    """How values of ``x``'s dtype are compared, asked once per dtype: as they are where
    torch has ``equal`` for them, else converted to a wider dtype (exact), else as bytes."""
    key = (x.dtype, x.device.type)
    found = _COMPARED.get(key)
    if found is None:
        found = _how_compared(x)
        _COMPARED.put(key, found)
    return found


def _how_compared(x: Tensor) -> Callable[[Tensor], Tensor]:
    one = specimen(x, (2,))
    if one is None:
        return _as_is
    if _works(lambda: torch.equal(one, one)):
        return _as_is
    wide = torch.complex64 if x.dtype.is_complex else torch.float32
    if (x.dtype.is_floating_point or x.dtype.is_complex) and x.dtype.itemsize < wide.itemsize:

        def upcast(t: Tensor) -> Tensor:
            return t.to(wide)

        if _works(lambda: torch.equal(upcast(one), upcast(one))):
            return upcast
    return _bytes


def _works(call: Callable[[], Any]) -> bool:
    try:
        call()
    except Exception:
        return False
    return True
