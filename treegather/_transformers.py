"""transformers' key/value caches as tree nodes, registered once transformers is in use.

Never imported by ``import treegather`` unless ``transformers.cache_utils`` is already loaded:
:mod:`treegather._tree` calls :func:`register_caches` when it notices the module (at import, and
whenever torch's pytree registry has grown, which every transformers model import does).

- ``DynamicCache`` (and its ``cache_utils`` subclasses ``MtpCache`` and ``DFlashCache``) is a node
  whose child ``layers`` is a list of ``{"keys": ..., "values": ...}``: scatter splits each
  layer's tensors along the batch dim, gather concatenates them, so a gathered cache is one
  cache of the whole batch and a scattered one gives each replica its own cache (the caller's
  is never touched: ``update`` concatenates into new tensors). Its layers may be
  ``DynamicLayer``, ``DynamicSlidingWindowLayer`` (Mistral, Gemma) or ``DummyLayer``; every
  other attribute of the cache or a layer must be a plain value (kept as metadata, which
  replicas must agree on) or a 0-dim tensor (rebuilt on each shard's device).
- ``EncoderDecoderCache`` (T5, BART, Whisper) is a node of its two caches.
- What cannot be split or combined batch-wise stays whole, as an :class:`~treegather._tree.Opaque`
  child that says why: ``StaticCache`` (its layers are buffers preallocated for
  ``max_cache_len`` and written in place by the forward, so a shard would write into the
  caller's cache), ``QuantizedCache`` (backend-packed tensors), an offloading cache, and a
  ``DynamicCache`` holding any other layer type (linear-attention / recurrent states, indexed
  layers). :func:`treegather.scatter` refuses such a leaf (unless the layout says
  ``broadcast()``); gather keeps the per-replica caches as a list, as for any leaf it cannot
  combine.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable
from typing import Any

import torch

from ._tree.registry import Opaque, register_default, watch

__all__ = ["register_caches"]

_ATOMS = (type(None), bool, int, float, str)
# Layer classes whose whole state is keys/values along the batch dim plus plain metadata.
_SPLIT_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer", "DummyLayer")
_DYNAMIC = ("DynamicCache", "MtpCache", "DFlashCache")


class _Tensor0:
    """A 0-dim tensor attribute kept as metadata: its dtype and value (rebuilt per device)."""

    __slots__ = ("dtype", "value")
    _shareable_fields = True  # (immutable: an equal one may stand for it in a cached structure)

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype = t.dtype
        self.value = t.item()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Tensor0)
            and other.dtype == self.dtype
            and type(other.value) is type(self.value)
            and other.value == self.value
        )

    def __hash__(self) -> int:
        return hash((self.dtype, self.value))

    def __repr__(self) -> str:
        return f"tensor({self.value!r}, dtype={self.dtype})"

    def _typed_fields(self) -> tuple[Any, ...]:
        """For :func:`treegather._caches.typed_key`."""
        return (str(self.dtype), self.value)


def _statics(obj: Any, skip: Iterable[str], data: Any = None) -> tuple[tuple[str, Any], ...] | str:
    """``obj``'s attributes but ``skip`` as sorted ``(name, value)`` metadata, or why not.

    A ``torch.device`` attribute of an object whose ``data`` is a tensor is the data's device
    (rebuilt so, never compared: replicas on several GPUs agree); otherwise it is kept.
    """
    out = []
    for name, value in sorted(vars(obj).items()):
        if name in skip:
            continue
        if type(value) in _ATOMS or isinstance(value, (type, _Device)):
            out.append((name, value))  # (a _Device: a template's, see _restore)
        elif isinstance(value, torch.device):
            if isinstance(data, torch.Tensor) and data.device == value:
                out.append((name, _DATA_DEVICE))
            else:
                out.append((name, _Device(str(value))))
        elif isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad:
            out.append((name, _Tensor0(value)))
        else:
            return f"its attribute {name!r} is a {type(value).__qualname__}"
    return tuple(out)


class _Device(str):
    """A ``torch.device`` attribute as metadata (``""``: the device of the object's data)."""

    __slots__ = ()
    _shareable_fields = True  # (immutable: an equal one may stand for it in a cached structure)

    def __repr__(self) -> str:
        return f"device({str.__repr__(self)})"

    def _typed_fields(self) -> tuple[Any, ...]:
        """For :func:`treegather._caches.typed_key`: by value (a new one per flatten)."""
        return (str(self),)


_DATA_DEVICE = _Device("")


def _restore(obj: Any, statics: tuple[tuple[str, Any], ...], device: torch.device | None) -> None:
    for name, value in statics:
        if value is _DATA_DEVICE:
            # the data's device; rebuilt around placeholders (the compiled layer's template of
            # the structure), the marker itself, so that flattening it gives the same metadata
            value = _DATA_DEVICE if device is None else device
        elif isinstance(value, _Device):
            value = torch.device(value)
        elif isinstance(value, _Tensor0):
            value = torch.tensor(value.value, dtype=value.dtype, device=device or "cpu")
        obj.__dict__[name] = value


class _Meta:
    """A DynamicCache's metadata, ``(cache statics, per-layer (class, statics))``.

    Compared and hashed by value; its type-aware key (:func:`treegather._caches.typed_key`,
    which the compiled layer's guard computes on every call) is one text: the parts' ``repr``
    (which tells ``True``, ``1`` and ``1.0`` apart) and the classes' identities.
    """

    __slots__ = ("_text", "parts")
    # An equal one may stand for it in a cached structure: unflatten only reads its parts
    # (plain values, classes, and the immutable _Device and _Tensor0).
    _shareable_fields = True

    def __init__(self, parts: tuple[Any, ...]) -> None:
        self.parts = parts
        self._text: str | None = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Meta) and other.parts == self.parts

    def __hash__(self) -> int:
        return hash(self.parts)

    def __repr__(self) -> str:
        return repr(self.parts)

    def _typed_fields(self) -> tuple[Any, ...]:
        if self._text is None:
            statics, layers = self.parts
            classes = [v for _, v in statics if isinstance(v, type)] + [c for c, _ in layers]
            self._text = f"{self.parts!r}#{[id(c) for c in classes]}"
        return (self._text,)


# ------------------------------------------------------------------------------ DynamicCache


def _dynamic_parts(cache: Any, module: types.ModuleType) -> _Meta | str:
    """``(cache statics, per-layer (class, statics))`` or the reason it cannot be split."""
    if getattr(cache, "offloading", False):
        return "it offloads its layers to the CPU (with a stream per device)"
    statics = _statics(cache, ("layers",))
    if isinstance(statics, str):
        return statics
    split = tuple(getattr(module, name) for name in _SPLIT_LAYERS)
    layers = []
    for i, layer in enumerate(cache.layers):
        if type(layer) not in split:
            return (
                f"its layer {i} is a {type(layer).__qualname__} (only DynamicLayer, "
                "DynamicSlidingWindowLayer and DummyLayer hold just batch-wise keys and values)"
            )
        own = _statics(layer, ("keys", "values"), layer.keys)
        if isinstance(own, str):
            return f"in its layer {i}, {own}"
        layers.append((type(layer), own))
    return _Meta((statics, tuple(layers)))


def _flatten_dynamic(module: types.ModuleType) -> Any:
    def flatten(cache: Any) -> tuple[list[Any], Any, tuple[str, ...]]:
        parts = _dynamic_parts(cache, module)
        if isinstance(parts, str):
            return [_opaque(cache, parts)], None, ("layers",)
        layers = [{"keys": layer.keys, "values": layer.values} for layer in cache.layers]
        return [layers], parts, ("layers",)

    return flatten


def _unflatten_dynamic(cls: type) -> Any:
    def unflatten(parts: Any, children: Iterable[Any]) -> Any:
        (layers,) = children
        if parts is None:
            return _whole(layers)
        statics, layer_parts = parts.parts
        cache: Any = object.__new__(cls)
        _restore(cache, statics, None)
        built = []
        for (layer_cls, own), kv in zip(layer_parts, layers):
            layer = object.__new__(layer_cls)
            keys = kv["keys"]
            _restore(layer, own, keys.device if isinstance(keys, torch.Tensor) else None)
            layer.keys, layer.values = keys, kv["values"]
            built.append(layer)
        cache.layers = built
        return cache

    return unflatten


# ----------------------------------------------------------------------- EncoderDecoderCache


def _flatten_encoder_decoder(module: types.ModuleType) -> Any:
    dynamic = tuple(getattr(module, name) for name in _DYNAMIC)

    def flatten(cache: Any) -> tuple[list[Any], Any, tuple[str, ...]]:
        names = ("self_attention_cache", "cross_attention_cache")
        reason = None
        for name in names:
            inner = getattr(cache, name)
            if type(inner) not in dynamic:
                reason = f"its {name} is a {type(inner).__qualname__}"
            else:
                parts = _dynamic_parts(inner, module)
                if isinstance(parts, str):
                    reason = f"its {name} cannot be split: {parts}"
            if reason:
                return [_opaque(cache, reason)], None, ("caches",)
        statics = _statics(cache, (*names, "is_updated"))
        if isinstance(statics, str):
            return [_opaque(cache, statics)], None, ("caches",)
        updated = tuple(sorted(cache.is_updated.items())) if hasattr(cache, "is_updated") else None
        children = [cache.self_attention_cache, cache.cross_attention_cache]
        return children, (statics, updated), names

    return flatten


def _unflatten_encoder_decoder(cls: type) -> Any:
    def unflatten(parts: Any, children: Iterable[Any]) -> Any:
        values = list(children)
        if parts is None:
            return _whole(values[0])
        statics, updated = parts
        cache: Any = object.__new__(cls)
        _restore(cache, statics, None)
        cache.self_attention_cache, cache.cross_attention_cache = values
        if updated is not None:
            cache.is_updated = dict(updated)
        return cache

    return unflatten


# ------------------------------------------------------------------------- kept whole


def _opaque(cache: Any, reason: str) -> Opaque:
    name = type(cache).__qualname__
    return Opaque(
        cache,
        f"a {name} treegather cannot split along the batch ({reason}), so it would be sent "
        "whole to every device; run this call on one device, or mark it broadcast() in the "
        "layout (every replica then shares this one cache and writes into it)",
    )


def _flatten_whole(why: str) -> Any:
    def flatten(cache: Any) -> tuple[list[Any], Any, tuple[str, ...]]:
        return [_opaque(cache, why)], None, ("layers",)

    return flatten


def _unflatten_whole(_: Any, children: Iterable[Any]) -> Any:
    (child,) = children
    return _whole(child)


def _whole(child: Any) -> Any:
    """An opaque child back: its value; after a gather that kept every replica's (as a list,
    or any container of them), the same container of the replicas' caches."""
    if isinstance(child, Opaque):
        return child.value
    if isinstance(child, list):
        return [_whole(c) for c in child]
    return child


_WHOLE = {
    "StaticCache": "its layers are buffers preallocated for max_cache_len that the forward "
    "writes in place",
    "QuantizedCache": "its layers hold backend-packed quantized tensors",
}


def register_caches(module: types.ModuleType) -> None:
    """Register ``transformers.cache_utils``' cache classes (``module``) as treegather nodes.

    Classes already registered with treegather (by the user) are left as they are.
    """
    todo: list[tuple[type, Any, Any]] = []
    for name in _DYNAMIC:
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            todo.append((cls, _flatten_dynamic(module), _unflatten_dynamic(cls)))
    cls = getattr(module, "EncoderDecoderCache", None)
    if isinstance(cls, type):
        todo.append((cls, _flatten_encoder_decoder(module), _unflatten_encoder_decoder(cls)))
    for name, why in _WHOLE.items():
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            todo.append((cls, _flatten_whole(why), _unflatten_whole))
    for cls, flatten, unflatten in todo:  # (the user's own registration wins)
        register_default(cls, flatten, unflatten)


_registered = False


def _sync() -> None:
    """Register the caches once ``transformers.cache_utils`` is loaded: called at import and
    whenever torch's pytree registry has grown (which importing any transformers model does),
    so there is no cost on the hot path, and ``import treegather`` never imports transformers."""
    global _registered
    module = sys.modules.get("transformers.cache_utils")
    if _registered or module is None:
        return
    _registered = True
    register_caches(module)


watch(_sync)
