"""How ``mean`` and ``sum`` combine numbers rather than tensors: Python's and numpy's scalars.

The result is computed from the values' exact values, never in their own narrow dtype, and then
given the type numpy's (or Python's) own reduction of them would have:

- Python numbers: ints add exactly; a mean is a float (or a complex), each division correctly
  rounded; a float mean whose sum would overflow (``1e308`` twice) is taken share by share.
  ``Fraction`` and ``Decimal`` values stay what they are: their mean (weighted by ints: the
  rows) is exact, a ``Fraction`` or a ``Decimal`` (in the current decimal context); numbers
  Python cannot add together (a ``Decimal`` and a ``float``) are refused.
- numpy scalars: read exactly with ``.item()`` (Python ints, Python floats: float16, float32 and
  float64 exactly; ``longdouble`` stays itself), combined as Python numbers are, then stored in
  the dtype :func:`numpy.mean` or :func:`numpy.sum` gives an array of them: a mean of integers is
  float64, of floats their own dtype (rounded once: ``float16(60000)`` twice averages to
  ``60000``, not ``inf``; ``int8(100)`` twice to ``100.0``, not ``-28.0``); a sum of integers
  narrower than 64 bits is int64 (uint64 when unsigned), as numpy accumulates them. A float sum
  beyond its dtype is ``inf``, as a tensor's (torch's float16 sum) and a Python float's are; an
  integer sum that its dtype cannot hold is refused (:func:`sum_of` raises), where numpy and
  torch would wrap around.

numpy is not a dependency: it is only looked at when a value is one of its scalars (so it is
imported already).
"""

from __future__ import annotations

import builtins
import cmath
import decimal
import numbers
import sys
from collections.abc import Sequence
from typing import Any

from .._errors import LeafTypeError, ShapeMismatchError

__all__ = ["mean_of", "result_type_name", "sum_of"]


def mean_of(col: Sequence[Any], weights: Sequence[float] | None) -> Any:
    """The mean of the numbers ``col``, weighted by ``weights`` (non-negative reals; ``None``:
    equally); weights that are all 0 give NaN (the mean of no items)."""
    dtype = _numpy_dtype(col)
    try:
        if dtype is None:
            return _mean(col, weights)
        np = _numpy()
        with np.errstate(over="ignore"):  # (a longdouble sum that overflows: taken by shares)
            mean = _mean([v.item() if hasattr(v, "item") else v for v in col], weights)
    except OverflowError:  # Python ints beyond any float
        raise ShapeMismatchError(_BEYOND.format(what="mean()")) from None
    except TypeError:  # (a Decimal and a float, say: Python adds neither to the other)
        raise LeafTypeError(_MIXED.format(what="mean()", types=_types(col))) from None
    out = dtype if dtype.kind in "fc" else np.dtype("float64")  # (numpy.mean's dtype)
    return out.type(mean)


def sum_of(col: Sequence[Any]) -> Any:
    """The sum of the numbers ``col``; a :class:`ShapeMismatchError` for numpy integers whose
    sum their result dtype cannot hold."""
    dtype = _numpy_dtype(col)
    try:
        if dtype is None:
            return builtins.sum(col)
        np = _numpy()
        with np.errstate(over="ignore"):  # a float sum beyond the dtype is inf, as a tensor's is
            total = builtins.sum(v.item() if hasattr(v, "item") else v for v in col)
    except OverflowError:  # Python ints beyond any float, added to floats
        raise ShapeMismatchError(_BEYOND.format(what="sum()")) from None
    except TypeError:
        raise LeafTypeError(_MIXED.format(what="sum()", types=_types(col))) from None
    out = np.empty(0, dtype).sum().dtype  # numpy's accumulator: int8 -> int64, uint8 -> uint64
    if out.kind in "iu":
        info = np.iinfo(out)
        if not info.min <= total <= info.max:
            raise ShapeMismatchError(
                f"sum() of numpy {dtype} values is {total}, which {out} cannot hold (numpy and "
                "torch would wrap around); convert them to Python ints first for an exact sum"
            )
    with np.errstate(over="ignore"):
        return out.type(total)


_BEYOND = (
    "{what} of these numbers is beyond a float: a Python int above 1.8e308 mixed with floats, "
    "or divided; gather such ints with as_list()"
)
_MIXED = (
    "{what} cannot add numbers of types {types}: Python adds none of them to the other; "
    "return one type from every replica, or gather them with as_list()"
)


def _types(col: Sequence[Any]) -> str:
    return ", ".join(dict.fromkeys(type(v).__qualname__ for v in col))


def result_type_name(x: Any, mean: bool) -> str:
    """For :func:`treegather.explain`: the type the mean (``mean``) or the sum of numbers like
    ``x`` has (``float``, ``complex``, ``int``; numpy's: ``numpy.float64``, ``numpy.int64``)."""
    np = sys.modules.get("numpy")
    if np is None or not isinstance(x, np.generic):
        if mean:
            return "complex" if isinstance(x, complex) else "float"
        return type(x).__qualname__
    if mean:
        dtype = x.dtype if x.dtype.kind in "fc" else np.dtype("float64")
    else:
        dtype = np.empty(0, x.dtype).sum().dtype
    return f"numpy.{dtype.type.__name__}"


def _mean(col: Sequence[Any], weights: Sequence[float] | None) -> Any:
    """:func:`mean_of` of Python numbers (and ``longdouble`` scalars, which compute in kind)."""
    n = len(col)
    if weights is None:
        total = builtins.sum(col)
        if type(total) is int or _finite(total) or not all(map(_finite, col)):
            return total / n
        return builtins.sum(v / n for v in col)  # the sum overflowed; the shares cannot
    whole = builtins.sum(weights)
    if not whole:  # weights that are all 0: the mean of no items
        return float("nan")
    if all(map(_exact, col)) and all(type(w) is int for w in weights):  # exact
        return builtins.sum(v * w for v, w in zip(col, weights, strict=True)) / whole
    # Each value times its share: never a product larger than the value; a share of 0 leaves
    # the value out (the NaN mean of an empty shard).
    return builtins.sum(v * _share(v, w, whole) for v, w in zip(col, weights, strict=True) if w)


def _exact(v: Any) -> bool:
    """A number whose products and sums are exact (ints, ``Fraction``, ``Decimal``)."""
    return isinstance(v, (numbers.Rational, decimal.Decimal))


def _share(v: Any, w: float, whole: float) -> Any:
    """Weight ``w``'s share of ``whole``, in a type ``v`` multiplies by: a ``Decimal`` for a
    ``Decimal`` (which takes no float), else ``w / whole``."""
    if isinstance(v, decimal.Decimal):
        return decimal.Decimal(w) / decimal.Decimal(whole)
    return w / whole


def _finite(x: Any) -> bool:
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.generic):  # (a longdouble beyond a Python float)
        return bool(np.isfinite(x))
    return cmath.isfinite(x)


def _numpy() -> Any:
    return sys.modules["numpy"]


def _numpy_dtype(col: Sequence[Any]) -> Any:
    """numpy's result dtype of ``col`` when any value is a numpy scalar, else ``None``."""
    np = sys.modules.get("numpy")
    if np is None or not any(isinstance(v, np.generic) for v in col):
        return None
    return np.result_type(*col)
