"""How :mod:`treegather.distributed` compares layouts across ranks: a type-aware text key.

:func:`layout_text` turns a layout and ``dim`` into a key that is equal on two ranks exactly when
they combine the trees with the same rules (type-aware: ``1`` and ``True`` differ; dict
insertion order ignored; callables named by module and qualified name, which do not depend on
the process), and a text to show in error messages. The wire plan folds the key into its
digest; the full exchange carries both in its header.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree

from .. import _tree
from .._caches import LRU, shareable, typed_key
from .._errors import safe_repr
from .._layout import ByPath, path_text
from .._rules import Custom, Rule

__all__ = ["layout_text"]


class _Shown(str):
    """A string that ``repr``\\ s as itself (to print a layout with described rules)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def _describe_rule(value: Any) -> tuple[str, str]:
    """One layout entry as ``(key, shown)``: the key is type-aware and process-independent."""
    if isinstance(value, Custom) or (callable(value) and not isinstance(value, (Rule, ByPath))):
        fn = value.fn if isinstance(value, Custom) else value
        name = _callable_name(fn)
        return f"callable:{name}", f"custom rule {getattr(fn, '__qualname__', name)}"
    if isinstance(value, Rule) and dataclasses.is_dataclass(value):
        fields = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
        fields = [(n, ("callable", _callable_name(v)) if callable(v) else v) for n, v in fields]
        key = type(value).__qualname__ + "".join(
            f"|{n}={type(v).__name__}:{safe_repr(v, None, stable=True)}" for n, v in fields
        )
        return key, value.describe()
    if isinstance(value, ByPath):
        parts = [
            (p, *_describe_rule(r), "?" if o else "")
            for (p, _, r), o in zip(value.patterns, value._optional_at)
        ]
        default = _describe_rule(value.default)
        # Patterns are dotted strings or exact tuple paths: typed, in an order of their own;
        # an optional one is marked (a rank where it matches nothing does not raise).
        keys = sorted(
            f"{type(p).__name__}:{safe_repr(p, None, stable=True)}{o}={k}" for p, k, _, o in parts
        )
        key = "by_path:" + "|".join(keys) + f"|={default[0]}"
        inner = ", ".join(f"{path_text(p)}: {s}" for p, _, s, _ in parts)
        optional = f", optional={safe_repr(value.optional, None)}" if value.optional else ""
        return key, f"by_path({{{inner}}}, default={default[1]}{optional})"
    if value is None or type(value) in (bool, int, float, str):
        return f"{type(value).__name__}:{value!r}", repr(value)
    return f"object:{type(value).__module__}.{type(value).__qualname__}", type(value).__qualname__


def _callable_name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


# The texts of immutable layouts (by_path, a rule) whose typed key tells them apart.
_TEXTS: LRU[Any, tuple[str, str]] = LRU("distributed.layout_texts", maxsize=128, trees=False)


def layout_text(layout: Any, dim: Any, sync: bool = False) -> tuple[str, str]:
    """``(key, shown)`` for a layout and ``dim`` (and ``sync_grads``): equal keys iff the ranks
    combine alike.

    The key is type-aware (``1`` and ``True`` differ), ignores dict insertion order, and names
    callables by module and qualified name (process-independent); ``shown`` is for messages.

    >>> import treegather as tg
    >>> layout_text({"x": tg.stack()}, 0)[1]
    "layout {'x': stack()}, dim=0"
    >>> layout_text(None, 0)[0] == layout_text(None, False)[0]
    False
    """
    key = None
    if type(dim) is int and isinstance(layout, (ByPath, Rule)):
        typed = layout._key if type(layout) is ByPath else typed_key(layout)
        key = (typed, dim, bool(sync)) if shareable(typed, equal=True) else None
        if (found := _TEXTS.get(key)) is not None:
            return found
    text = _layout_text(layout, dim, sync)
    if key is not None:
        _TEXTS.put(key, text)
    return text


def _layout_text(layout: Any, dim: Any, sync: bool) -> tuple[str, str]:
    atoms = (bool, int, float, str, type(None))
    dim_key = f"{type(dim).__name__}:{dim!r}" if type(dim) in atoms else f"?{type(dim)}"
    if sync:
        plain = layout_text(layout, dim)
        return f"{plain[0]};sync_grads", f"{plain[1]}, sync_grads=True"
    if layout is None:
        return f"None;{dim_key}", f"layout None, dim={safe_repr(dim)}"
    leaves, spec = optree.tree_flatten(layout, none_is_leaf=True, namespace=_tree.NAMESPACE)
    described = [_describe_rule(leaf) for leaf in leaves]
    key = safe_repr(spec, None, stable=True) + "".join(f";{k}" for k, _ in described)
    shown = spec.unflatten([_Shown(s) for _, s in described])
    return key + f";{dim_key}", f"layout {safe_repr(shown, None)}, dim={safe_repr(dim)}"
