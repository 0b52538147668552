"""Every cache treegather keeps, in one registry: bounded, keyed by type-aware values.

Each cache in the package is an :class:`LRU` (or a :class:`WeakCache`, keyed weakly by the
object it describes) created through this module, so that

- :func:`clear_caches` empties all of them at once (tests start cold with it; so does
  registering a new tree node, since every cached structure may depend on the registry);
- every cache has a bound: an LRU never holds more than ``maxsize`` entries, so a class or a
  tree created per call is kept alive by at most that many entries, never forever;
- keys never merge what Python's ``==`` merges: :func:`typed_key` makes ``True``, ``1`` and
  ``1.0`` three different keys (types are part of every key).

A cache lookup never formats, hashes or ``repr``\\ s user data it was not given as a key.

One table is deliberately not a cache, and so not registered: the inline capacity of each
:mod:`treegather.distributed` process group (``treegather.distributed.group.ProtocolState``),
the one piece of protocol state treegather keeps. Every rank of a group must hold the same
value (it sizes every call's first collective); clearing it on one rank would make that rank's
next first collective another size, which gloo answers by aborting. What the group's calls
cache beside it (the group's fixed facts, the wire plans and payload geometries, the kept
receive buffer) is registered here.

>>> cache = LRU("example", maxsize=2)
>>> cache.put(typed_key(1), "int"); cache.put(typed_key(True), "bool")
>>> cache.get(typed_key(1)), cache.get(typed_key(True)), cache.get(typed_key(1.0))
('int', 'bool', None)
>>> clear_caches(); len(cache)
0
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Any, Generic, TypeVar

__all__ = [
    "LRU",
    "WeakCache",
    "caches",
    "clear_caches",
    "clear_tree_caches",
    "shareable",
    "typed_key",
]

K = TypeVar("K")
V = TypeVar("V")

_REGISTRY: weakref.WeakSet[Any] = weakref.WeakSet()
_REGISTRY_LOCK = threading.Lock()


class _Registered:
    """What every cache shares: a name, a bound, a lock, registration for :func:`clear_caches`."""

    __slots__ = ("__weakref__", "_data", "_lock", "maxsize", "name", "trees")

    def __init__(self, name: str, maxsize: int, *, trees: bool = True) -> None:
        if maxsize < 1:
            raise ValueError(f"cache {name!r} needs maxsize >= 1")
        self.name = name
        self.maxsize = maxsize
        # Whether what is cached depends on which classes are tree nodes (a registration
        # empties such caches; replicas or devices do not depend on it).
        self.trees = trees
        self._data: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()
        with _REGISTRY_LOCK:
            _REGISTRY.add(self)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {len(self._data)}/{self.maxsize})"


class LRU(_Registered, Generic[K, V]):
    """A bounded least-recently-used map, registered for :func:`clear_caches`.

    Thread-safe: a lock around each change; lookups rely on the GIL (see :meth:`get`).
    """

    __slots__ = ()

    def get(self, key: K, default: Any = None) -> Any:
        """The value for ``key`` (marked as just used), else ``default``."""
        # No lock on the hot path: a dict lookup and OrderedDict.move_to_end are each atomic
        # under the GIL; an entry evicted in between is simply not marked.
        data = self._data
        try:
            value = data[key]
            data.move_to_end(key)
        except KeyError:
            return default
        return value

    def put(self, key: K, value: V) -> None:
        """Store ``value``; the least recently used entry goes when the cache is full."""
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def pop(self, key: K, default: Any = None) -> Any:
        """Remove ``key`` and return its value (``default`` when absent)."""
        with self._lock:
            return self._data.pop(key, default)


class WeakCache(_Registered, Generic[K, V]):
    """A map keyed weakly by objects (compared by identity), registered for :func:`clear_caches`.

    An entry lives only as long as its key object: a deleted model frees what was cached for it.
    ``maxsize`` bounds the number of live entries as well (least recently stored goes first).
    Entries are ``id(obj) -> (weakref to obj, value)``.
    """

    __slots__ = ()

    def get(self, obj: Any, default: Any = None) -> Any:
        """The value stored for ``obj`` itself (identity), else ``default``."""
        with self._lock:
            entry = self._data.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return default
        return entry[1]

    def put(self, obj: Any, value: V) -> None:
        """Store ``value`` for as long as ``obj`` lives."""
        key = id(obj)
        self_ref = weakref.ref(self)

        def drop(ref: weakref.ref[Any], key: int = key) -> None:
            cache = self_ref()
            if cache is not None:
                with cache._lock:
                    entry = cache._data.get(key)
                    if entry is not None and entry[0] is ref:
                        del cache._data[key]

        ref = weakref.ref(obj, drop)
        with self._lock:
            self._data[key] = (ref, value)
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def pop(self, obj: Any, default: Any = None) -> Any:
        """Forget ``obj``; return its value (``default`` when absent)."""
        with self._lock:
            entry = self._data.get(id(obj))
            if entry is None or entry[0]() is not obj:
                return default
            del self._data[id(obj)]
            return entry[1]


def caches() -> list[_Registered]:
    """Every live cache in the registry, by name (for tests and debugging).

    >>> all(len(c) <= c.maxsize for c in caches())
    True
    """
    with _REGISTRY_LOCK:
        return sorted(_REGISTRY, key=lambda c: c.name)


def clear_tree_caches() -> None:
    """Empty the caches that depend on which classes are tree nodes (after a registration)."""
    with _REGISTRY_LOCK:
        registered = [c for c in _REGISTRY if c.trees]
    for cache in registered:
        cache.clear()


def clear_caches() -> None:
    """Empty every cache treegather keeps (structures, plans, compiled code, devices, ...).

    The next call of each function then runs cold, exactly as in a fresh process. Registering a
    tree node (:func:`treegather.register_dataclass`, :func:`treegather.register_node`, or a
    class registered with torch's pytree) clears every cache that depends on tree structure.

    >>> import treegather as tg
    >>> tg.clear_caches()
    """
    with _REGISTRY_LOCK:
        registered = list(_REGISTRY)
    for cache in registered:
        cache.clear()


# ------------------------------------------------------------------------- the fast paths


class _FastPaths(threading.local):
    """Whether this thread may take a fast path (see :func:`reference_only`)."""

    on = True


FAST_PATHS = _FastPaths()
"""``FAST_PATHS.on``: read by every fast path before it is taken (one thread-local read)."""


@contextlib.contextmanager
def reference_only() -> Iterator[None]:
    """Within this block (in this thread) every fast path is off, all together: scatter and
    gather run their reference steps (no compiled code, no cached structure or plan), a
    data-parallel step builds fresh replicas instead of re-binding kept ones, and
    :mod:`treegather.distributed` takes the full exchange instead of a cached wire plan (and a
    :class:`~treegather.distributed.Collector` joins its values with :func:`treegather.gather`
    instead of its own concatenation).

    The one switch the differential tests run through: the same call with and without it
    must give the same result, or the same error.

    >>> import torch, treegather as tg
    >>> with reference_only():
    ...     tg.gather([torch.ones(1), torch.zeros(1)], "cpu")
    tensor([1., 0.])
    """
    before = FAST_PATHS.on
    FAST_PATHS.on = False
    try:
        yield
    finally:
        FAST_PATHS.on = before


# ------------------------------------------------------------------------------- typed keys

_ATOMS = (type(None), bool, int, float, complex, str, bytes)
_ATOM_SET = frozenset(_ATOMS)


def typed_key(value: Any) -> Hashable:
    """A hashable key for ``value`` in which the type of every part counts.

    ``True``, ``1`` and ``1.0`` compare equal in Python and would share a dict slot; here they
    do not. Tuples, lists and dicts are keyed by their items (dicts in insertion order), objects
    with a ``_typed_fields()`` method (layout rules) by their type and those fields, anything
    else by identity (callables compare by identity). Iterative: no recursion on nesting depth.

    >>> typed_key(True) == typed_key(1), typed_key((1, "a")) == typed_key((1, "a"))
    (False, True)
    """
    # Post-order build with an explicit stack: (value, children built so far).
    out: list[Any] = []
    stack: list[tuple[int, Any]] = [(0, value)]
    while stack:
        state, item = stack.pop()
        if state == 1:  # all children of a container are on ``out``: fold them
            tag, n = item
            parts = tuple(out[len(out) - n :]) if n else ()
            del out[len(out) - n :]
            out.append((tag, parts))
            continue
        kind = type(item)
        if kind in _ATOMS:
            out.append((kind, item))
        elif kind in (tuple, list):
            types = set(map(type, item))
            if types <= _ATOM_SET:  # (the usual metadata: keys, names) the same key, in C
                out.append((kind, tuple(zip(map(type, item), item))))
                continue
            stack.append((1, (kind, len(item))))
            stack.extend((0, x) for x in reversed(item))
        elif kind is dict:
            stack.append((1, (kind, 2 * len(item))))
            for k, v in reversed(list(item.items())):
                stack.append((0, v))
                stack.append((0, k))
        else:
            key = getattr(item, "_typed_fields", None)
            if key is not None:
                fields = key()
                stack.append((1, (kind, len(fields))))
                stack.extend((0, x) for x in reversed(fields))
            else:
                out.append((kind, id(item), _Identity(item)))
    return out[0]


# Atoms two of which with one typed key cannot be told apart (floats can: -0.0 and 0.0).
_EXACT_ATOMS = frozenset([type(None), bool, int, str, bytes])


def shareable(key: Any, *, equal: bool = False) -> bool:
    """Whether every value with the typed key ``key`` is indistinguishable from the one it was
    made from, so that a cache may hand out that one instead (``equal``: only whether every
    such value equals it in every respect, its text too, so that what is made from it may be
    shared: lists, dicts and objects keyed by their fields allowed).

    True when its parts are immutable atoms (not floats or complex numbers: ``-0.0`` and ``0.0``
    share a key), tuples of them, objects keyed by identity, or objects keyed by such fields
    whose class says that an equal one may stand for them (``_shareable_fields = True``: it
    hands nothing of itself out); False when it holds a list or a dict (an equal copy is
    another object, and mutable) or another object keyed by its fields.

    >>> shareable(typed_key(("a", 1, None))), shareable(typed_key(["a"])), shareable(typed_key(0.0))
    (True, False, False)
    >>> shareable(typed_key(["a"]), equal=True), shareable(typed_key(["a", 0.0]), equal=True)
    (True, False)
    """
    stack = [key]
    while stack:
        part = stack.pop()
        if len(part) == 3:  # (type, id, _Identity): the object itself
            continue
        kind, payload = part
        if kind in _ATOMS:
            if kind not in _EXACT_ATOMS:
                return False
        elif equal or kind is tuple or getattr(kind, "_shareable_fields", False):
            stack.extend(payload)  # (an object that says an equal one may stand for it)
        else:  # a list, a dict, or an object keyed by its fields
            return False
    return True


class _Identity:
    """Holds an object in a key, compared by identity (the id alone could be recycled)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)
