"""What a value treegather does not know holds: where it keeps a tensor, if it does.

A leaf that is no registered node (an unregistered class, a ``UserDict``, a PyG ``Data``) is
sent whole to every device by default; when it holds the batch, that is the batch on every
device. :func:`held_tensor` says where such a value holds a tensor of one or more dims (what
the default scatter rule would split), from its state alone: a bounded, breadth-first walk of
its instance ``__dict__`` and ``__slots__`` values, and of the dicts, lists and tuples among
them, at most :data:`DEPTH` levels down and :data:`BUDGET` values in all. It calls no code of
the value's class (no property, no ``__getattr__``, no ``__iter__`` or ``__getitem__`` of its
own: dicts, lists and tuples, subclasses included, are read with the built-in types' own
methods), so reading it has no effect and cannot fail. A ``torch.nn.Module`` is never entered:
its tensors are its parameters and buffers, the state of a computation, not the rows of a
batch. A class (a ``type``) is not walked either: its attributes are definitions.
"""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Iterator
from itertools import islice
from typing import Any

import torch

from .paths import format_path

__all__ = ["BUDGET", "DEPTH", "held_tensor"]

DEPTH = 4
"""Levels below the value the walk reads (a PyG ``Data``'s tensors are 3 down:
``._store._mapping['x']``)."""
BUDGET = 256
"""Values the walk reads at most, in all: a huge object costs no more than that."""

Tensor = torch.Tensor
_NOTHING = frozenset([type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device])
_NO_STATE = (type, torch.nn.Module)


def held_tensor(value: Any) -> tuple[str, Tensor] | None:
    """Where ``value`` holds a tensor of one or more dims (its path from ``value``, as a user
    types it, and the tensor), the nearest first; ``None`` when its state, read within the
    walk's bounds, holds none.

    >>> import torch
    >>> class Batch:
    ...     def __init__(self): self.meta, self.parts = "train", {"ids": torch.zeros(8)}
    >>> held_tensor(Batch())[0], held_tensor(torch.nn.Linear(2, 2)), held_tensor("text")
    (".parts['ids']", None, None)
    """
    if type(value) in _NOTHING or isinstance(value, _NO_STATE):
        return None
    budget = BUDGET
    seen = {id(value)}
    todo: deque[tuple[Any, tuple[tuple[Any, str], ...]]] = deque([(value, ())])
    while todo:
        node, path = todo.popleft()
        for entry, style, child in _state(node, budget):
            budget -= 1
            kind = type(child)
            if kind in _NOTHING:
                continue
            where = (*path, (entry, style))
            if isinstance(child, Tensor):
                if child.dim():
                    return format_path("", where), child
            elif len(where) < DEPTH and id(child) not in seen and not isinstance(child, _NO_STATE):
                seen.add(id(child))
                todo.append((child, where))
        if budget <= 0:
            return None
    return None


def _state(node: Any, budget: int) -> Iterator[tuple[Any, str, Any]]:
    """``(entry, style, value)`` of what ``node`` holds, at most ``budget`` of them, read with
    the built-in types' own functions (a subclass's overrides are not called)."""
    if budget <= 0:
        return iter(())
    if isinstance(node, dict):
        return iter([(k, "key", v) for k, v in islice(dict.items(node), budget)])
    if isinstance(node, (list, tuple)):
        items = list.__iter__(node) if isinstance(node, list) else tuple.__iter__(node)
        return iter([(i, "index", v) for i, v in enumerate(islice(items, budget))])
    return islice(_attributes(node, budget), budget)


def _attributes(node: Any, budget: int) -> Iterator[tuple[Any, str, Any]]:
    """``node``'s instance attributes: its ``__dict__`` (when its class has a real one) and its
    ``__slots__``, read through the descriptors Python made for them, never a property."""
    cls = type(node)
    mro = cls.__mro__
    for klass in mro:
        found = klass.__dict__.get("__dict__")
        if found is not None:
            if type(found) is types.GetSetDescriptorType:
                state = found.__get__(node, cls)
                if type(state) is dict:
                    yield from [(k, "attr", v) for k, v in islice(dict.items(state), budget)]
            break
    for klass in mro:
        names = klass.__dict__.get("__slots__", ())
        for name in (names,) if isinstance(names, str) else names:
            if not isinstance(name, str) or name in ("__dict__", "__weakref__"):
                continue
            private = name.startswith("__") and not name.endswith("__")
            stored = f"_{klass.__name__.lstrip('_')}{name}" if private else name
            slot = klass.__dict__.get(stored)
            if type(slot) is not types.MemberDescriptorType:
                continue
            try:
                yield stored, "attr", slot.__get__(node, cls)  # (as the user types it)
            except AttributeError:  # an empty slot
                continue
