"""What the rule matrices share (``test_rule_edges.py``, ``test_leaf_kinds.py``): the gather
rules they run, what a cell expects, how a result is compared with it, and the runner of one
call.

A cell expects one of three outcomes: :class:`Exact` (the value one device gives), :class:`Typed`
(a :class:`treegather.TreegatherError` whose message names the leaf's path, and the rule where
the rule refuses the values) or :class:`Users` (a custom rule's own exception, kept with a note
naming the path and the rule). Anything else a call raises -- a raw ``RuntimeError``,
``NotImplementedError``, ``TypeError`` or ``ZeroDivisionError`` from torch or from treegather's
internals -- fails the cell.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

import treegather as tg
from treegather import _caches, _compiled

WARM_CALLS = _compiled.COMPILE_AFTER + 2
"""Calls of one case: cold, seen, then compiled."""


def amax(values: list[Any], device: torch.device) -> Any:
    """The custom rule: the elementwise maximum over the replicas (tensors only)."""
    return torch.stack(values).amax(0).to(device)


RULES: dict[str, Any] = {
    "cat": tg.cat(),
    "stack": tg.stack(),
    "mean": tg.mean(),
    "sum": tg.sum(),
    "pad": tg.pad(),
    "as_list": tg.as_list(),
    "first": tg.first(check=True),
    "cat_items": tg.cat_items(),
    "custom": amax,
}
SHOWN = {  # how the messages name each rule
    "cat": "cat()",
    "stack": "stack()",
    "mean": "mean()",
    "sum": "sum()",
    "pad": "pad()",
    "as_list": "as_list()",
    "first": "first(check=True)",
    "cat_items": "cat_items()",
    "custom": "custom rule 'amax'",
}


class Exact(NamedTuple):
    value: Any


class Typed(NamedTuple):
    error: type[tg.TreegatherError]
    text: str
    """What the message says, besides the path (and the rule's name, where ``rule``)."""
    rule: bool = True


class Users(NamedTuple):
    """A custom rule's own exception (kept, with a note naming the path and the rule)."""

    error: type[BaseException]


Expect = Exact | Typed | Users


def custom(
    values: tuple[Any, ...], device: torch.device | None = None, rule: Callable[..., Any] = amax
) -> Expect:
    """What the custom rule itself does with ``values`` (the rule only passes them on), for
    the target ``device`` (default: the CPU)."""
    try:
        return Exact(rule(list(values), device or torch.device("cpu")))
    except Exception as exc:
        return Users(type(exc))


# ---------------------------------------------------------------------------------- equal


def equal(a: Any, b: Any, *, strict: bool = False) -> bool:
    """Equal in type, dtype, layout, shape and value, NaN equal to NaN (recursing into
    containers). Tensors of every kind torch has: sparse and mkldnn ones by their dense
    values, nested ones component by component, quantized ones by their stored integers,
    meta ones by dtype and shape, dtypes without arithmetic (float8, sub-byte) by their
    values in a wider dtype or by their bytes, ``MaskedTensor`` by its data and mask. Tensors
    that cannot be compared (whose shape cannot be read) are not equal, or, ``strict``, raise."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        if isinstance(a, torch.nn.parameter.UninitializedTensorMixin) and not strict:
            return a.dtype == b.dtype  # (no shape, no data)
        if strict:
            return _equal_tensors(a, b)
        try:
            return _equal_tensors(a, b)
        except Exception:
            return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=True))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(
            equal(x, y, strict=strict) for x, y in zip(a, b, strict=True)
        )
    if isinstance(a, dict):
        return list(a) == list(b) and all(equal(a[k], b[k], strict=strict) for k in a)
    if isinstance(a, (complex, np.complexfloating)):
        return equal(a.real, b.real) and equal(a.imag, b.imag)
    if a is None:
        return True
    return bool(a == b) or bool(a != a and b != b)  # (NaN: equal to NaN)


def _equal_tensors(a: torch.Tensor, b: torch.Tensor) -> bool:
    if (a.dtype, a.layout, a.device, a.is_nested) != (b.dtype, b.layout, b.device, b.is_nested):
        return False
    if a.is_nested:
        x, y = a.unbind(), b.unbind()
        return len(x) == len(y) and all(map(_equal_tensors, x, y))
    if a.shape != b.shape:
        return False
    masked = getattr(torch.masked, "MaskedTensor", ())
    if isinstance(a, masked):
        return _equal_tensors(a.get_data(), b.get_data()) and _equal_tensors(
            a.get_mask(), b.get_mask()
        )
    if type(a) is not torch.Tensor:  # (a subclass that is no wrapper: its data)
        a, b = a.as_subclass(torch.Tensor), b.as_subclass(torch.Tensor)
    if a.is_meta:
        return True
    if a.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    if a.is_quantized:  # (its quantizer, its stored integers: torch.equal misreads quint2x4)
        same_scale = a.q_scale() == b.q_scale() and a.q_zero_point() == b.q_zero_point()
        return same_scale and bool(torch.equal(a.int_repr(), b.int_repr()))
    if not _has_arithmetic(a.dtype):
        try:  # float8, complex32: exact in a wider dtype
            wide = torch.complex64 if a.dtype.is_complex else torch.float32
            a, b = a.to(wide), b.to(wide)
        except (RuntimeError, NotImplementedError):  # (bits, sub-byte ints): their bytes
            a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    try:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    except AssertionError:
        return False
    return True


def _has_arithmetic(dtype: torch.dtype) -> bool:
    try:
        torch.zeros(1, dtype=dtype).sum()
    except (RuntimeError, NotImplementedError):
        return False
    return True


# ---------------------------------------------------------------------------------- runs


class Outcome(NamedTuple):
    value: Any
    error: BaseException | None


def run(call: Callable[[], Any]) -> Outcome:
    try:
        return Outcome(call(), None)
    except Exception as exc:
        return Outcome(None, exc)


def problem(
    shown: str, expect: Expect, got: Outcome, path: re.Pattern[str], where: str
) -> str | None:
    """What is wrong with ``got`` for a case that should give ``expect`` (``None``: nothing):
    ``shown`` is how the messages name the rule, ``path`` where they name the leaf, ``where``
    the path as a custom rule's note gives it."""
    if isinstance(expect, Exact):
        if got.error is not None:
            return f"raised {type(got.error).__name__}: {got.error}"
        return None if equal(got.value, expect.value) else f"gave {got.value!r}"
    if got.error is None:
        return f"gave {got.value!r}, expected {expect.error.__name__}"
    message, notes = str(got.error), "\n".join(getattr(got.error, "__notes__", ()))
    if isinstance(expect, Users):
        wanted = f"raised by the gather rule {shown} at {where}"
        if type(got.error) is not expect.error or wanted not in notes:
            return f"raised {type(got.error).__name__}: {message} (notes: {notes!r})"
        return None
    named = not expect.rule or shown in message
    if expect.error is tg.TreegatherError:  # (any of treegather's typed errors)
        typed = isinstance(got.error, tg.TreegatherError)
    else:
        typed = type(got.error) is expect.error
    if not typed or not path.search(message) or not named:
        return f"raised {type(got.error).__name__}: {message!r}, expected {expect}"
    return None if expect.text in message else f"says {message!r}, expected {expect}"


def differential(call: Callable[[], Any], check: Callable[[Outcome], str | None]) -> str | None:
    """What is wrong with ``call``: the plain path's outcome (``reference_only``) as ``check``
    finds it, or the first call of the compiled path (cold, seen, compiled) that differs from
    the plain path's outcome; ``None`` when both are right."""
    with _caches.reference_only():
        plain = run(call)
    found = check(plain)
    if found is not None:
        return f"plain path {found}"
    tg.clear_caches()
    for n in range(WARM_CALLS):  # cold, seen, compiled
        fast = run(call)
        if not same(fast, plain):
            return f"call {n} of the compiled path differs: {fast}"
    return None


def same(a: Outcome, b: Outcome) -> bool:
    """The same result, or the same error type and message."""
    if a.error is not None or b.error is not None:
        return type(a.error) is type(b.error) and str(a.error) == str(b.error)
    return equal(a.value, b.value)
