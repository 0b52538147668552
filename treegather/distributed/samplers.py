"""Which samplers the Collector may read again: an order that reading again changes nothing in.

Known by their class: torch's ``SequentialSampler`` and ``DistributedSampler``, Lightning's
``UnrepeatedDistributedSampler``, a list, tuple, range or tensor of indices, a ``BatchSampler``
over one of those. A wrapper over one of them is known by what it holds and how it iterates,
not by its name (a framework's private class may change):

- a *pass-through* (Lightning's predict loaders record the batches they hand out in one):
  everything it holds is a sampler known here or plain data (numbers, strings, containers, a
  live iterator), and a copy of it hands out exactly what one of the samplers it holds does;
  that sampler is read instead.
- a *redistributing* ``DistributedSampler`` (Lightning's and catalyst's
  ``DistributedSamplerWrapper``, Lightning's ``UnrepeatedDistributedSamplerWrapper``, which the
  Trainer puts in its predict loaders): its ``dataset`` holds one sampler known here (and plain
  data), and a copy of it hands out that sampler's items at the positions its base class's order
  names.
- a *sharding* wrapper (accelerate's ``BatchSamplerShard``, in the loaders ``Accelerator.prepare``
  and the Hugging Face ``Trainer`` make): it holds one sampler known here, plain data, and its
  process's place among the processes sharing it (ints ``num_processes`` > ``process_index`` >=
  0); a copy of it hands out this process's share, a function of what it holds alone: its read
  writes nothing on the copy (its plain data compare equal before and after), and two copies
  read alike. That read is its order.

Every read is of copies (:func:`reader`): a wrapper's records, a live iterator and whatever a
read writes (a list the wrapper's dataset keeps) stay as they were in the loader's objects.
A copy whose read draws from torch's, Python's or NumPy's global random generator is not known
(one draw may give the order it holds by chance: a shuffle of 2 samples, half the time); those
generators are put back as they were.
"""

from __future__ import annotations

import copy
import pickle
import random
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, Sampler, SequentialSampler

__all__ = ["at", "chain", "place", "reader", "wrapped"]

Tensor = torch.Tensor
_LIGHTNING = ("lightning.pytorch.overrides.distributed", "pytorch_lightning.overrides.distributed")
_INDICES = (list, tuple, range, Tensor)
_PLAIN = (type(None), bool, int, float, str, bytes, list, tuple, dict, set, frozenset)


def _own_order(kind: type) -> bool:
    """Whether ``kind``'s own ``__iter__`` is an order that reading again changes nothing in."""
    if kind in (SequentialSampler, DistributedSampler):
        return True
    return kind.__qualname__ == "UnrepeatedDistributedSampler" and kind.__module__ in _LIGHTNING


def _sampler_like(value: Any) -> bool:
    """A sampler a wrapper may read (a torch ``Sampler``, or an object that iterates and has a
    length), not plain data."""
    if isinstance(value, _PLAIN) or isinstance(value, Tensor) or isinstance(value, Iterator):
        return False
    kind = type(value)
    return isinstance(value, Sampler) or (hasattr(kind, "__iter__") and hasattr(kind, "__len__"))


def _held(obj: Any) -> dict[str, Any] | None:
    """The samplers ``obj`` holds, by attribute, when everything else it holds is plain data (or
    a live iterator); ``None`` otherwise, or when it has no ``__dict__``."""
    state = getattr(obj, "__dict__", None)
    if not isinstance(state, dict):
        return None
    held = {k: v for k, v in state.items() if _sampler_like(v)}
    plain = all(isinstance(v, (*_PLAIN, Iterator)) for k, v in state.items() if k not in held)
    return held if plain else None


def _copied(obj: Any, replace: dict[str, Any]) -> Any:
    """A shallow copy of ``obj`` with ``replace`` set, its containers copied and its live
    iterators dropped: reading the copy writes on nothing ``obj`` holds."""
    out = copy.copy(obj)
    state = vars(out)
    for k, v in state.items():
        if isinstance(v, (list, dict, set)):
            state[k] = copy.copy(v)
        elif isinstance(v, Iterator):
            state[k] = None
    state.update(replace)
    return out


def _items(items: Iterable[Any]) -> list[Any]:
    """What a sampler hands out, comparable with ``==`` (a tensor batch as a list)."""
    return [x.tolist() if isinstance(x, Tensor) else x for x in items]


def _drawn(copied: Any) -> list[Any] | None:
    """What ``copied`` hands out (:func:`_items`), or ``None`` when reading it drew from torch's,
    Python's or NumPy's global random generator (an order drawn anew each read, however alike
    this one is); each generator is put back as it was, drawn or not."""
    before = _global_states()
    try:
        items = _items(copied)
    finally:
        after = _global_states()
        _restore(before)
    return items if _same(before, after) else None


def _global_states() -> tuple[Any, Any, Any]:
    numpy = sys.modules.get("numpy")  # (a wrapper drawing from NumPy imported it)
    return torch.get_rng_state(), random.getstate(), numpy and numpy.random.get_state()


def _same(a: tuple[Any, Any, Any], b: tuple[Any, Any, Any]) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and pickle.dumps(a[2]) == pickle.dumps(b[2])


def _restore(states: tuple[Any, Any, Any]) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    numpy = sys.modules.get("numpy")
    if states[2] is not None and numpy is not None:
        numpy.random.set_state(states[2])


def reader(sampler: Any) -> Any:
    """Something to read ``sampler``'s order from now (itself, copies of what it holds, or the
    items a copy handed out), reading which writes on nothing the loader holds; ``None`` when
    that order is not known to be the same each time it is read."""
    kind = type(sampler)
    if kind in _INDICES or _own_order(kind):
        return sampler
    try:
        if kind is BatchSampler:
            inner = reader(sampler.sampler)
            if inner is None or inner is sampler.sampler:
                return None if inner is None else sampler
            return _copied(sampler, {"sampler": inner})
        if isinstance(sampler, DistributedSampler):
            return _redistributing(sampler)
        if place(sampler) is not None:
            return _sharding(sampler)
        return _pass_through(sampler)
    except Exception:  # (a wrapper that does not copy or iterate as one: not known)
        return None


def place(sampler: Any) -> tuple[int, int, str, Any] | None:
    """Where a *sharding* wrapper stands: ``(process_index, num_processes, name, held)``, the
    one sampler it holds under ``name``; ``None`` for any other object."""
    held = _held(sampler)
    state = getattr(sampler, "__dict__", None) or {}
    index, count = state.get("process_index"), state.get("num_processes")
    if held is None or len(held) != 1 or type(index) is not int or type(count) is not int:
        return None
    if not 0 <= index < count:
        return None
    ((name, inner),) = held.items()
    return index, count, name, inner


def at(sampler: Any, index: int) -> Any:
    """A copy of a sharding wrapper (:func:`place`) standing at another ``process_index``."""
    out = _copied(sampler, {})
    vars(out)["process_index"] = index
    return out


def _pass_through(wrapper: Any) -> Any:
    held = _held(wrapper)
    if not held:
        return None
    readers = {k: reader(v) for k, v in held.items()}
    if any(r is None for r in readers.values()):
        return None  # (it may read a sampler that draws a new order)
    handed = _drawn(_copied(wrapper, readers))
    if handed is None:
        return None
    return next((r for r in readers.values() if _items(r) == handed), None)


def _sharding(wrapper: Any) -> list[Any] | None:
    """What a sharding wrapper hands this process (:func:`place`), read from copies: ``None``
    unless the read is a function of what it holds (it writes nothing on the copy, draws from
    no global generator, and two copies read alike)."""
    found = place(wrapper)
    assert found is not None
    name, inner = found[2], reader(found[3])
    if inner is None:
        return None
    reads = []
    for _ in range(2):
        copied = _copied(wrapper, {name: inner})
        before = _plain(copied, name)
        handed = _drawn(copied)
        if before is None or handed is None or _plain(copied, name) != before:
            return None  # (an epoch it advances, a seed it draws: another order next time)
        reads.append(handed)
    return reads[0] if reads[0] == reads[1] else None


def _plain(obj: Any, held: str) -> bytes | None:
    """``obj``'s state but the sampler it holds under ``held``, as bytes that compare equal
    while it is unchanged (a live iterator stands as its type); ``None`` when it does not
    pickle."""
    state = {
        k: type(v).__qualname__ if isinstance(v, Iterator) else v
        for k, v in vars(obj).items()
        if k != held
    }
    try:
        return pickle.dumps(state, pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None


def _redistributing(sampler: DistributedSampler[Any]) -> Any:
    base = next((b for b in type(sampler).__mro__[1:] if _own_order(b)), None)
    dataset = sampler.dataset
    held = _held(dataset)
    if base is None or held is None or len(held) != 1:
        return None
    ((name, inner),) = held.items()
    inner = reader(inner)
    if inner is None:
        return None
    copied = _copied(sampler, {"dataset": _copied(dataset, {name: inner})})
    items = _items(inner)
    positions = list(base.__iter__(copied))  # type: ignore[attr-defined]
    if _drawn(copied) != [items[i] for i in positions]:
        return None
    return copied


def chain(sampler: Any) -> str:
    """``sampler`` as an error names it: the class, then what it wraps (``a BatchSampler over a
    RandomSampler``)."""
    names: list[str] = []
    seen: set[int] = set()
    while sampler is not None and id(sampler) not in seen and len(names) < 6:
        seen.add(id(sampler))
        names.append(type(sampler).__name__)
        sampler = wrapped(sampler)
    return "a " + " over a ".join(names)


def wrapped(sampler: Any) -> Any:
    """What ``sampler`` wraps, where it is one of the wrappers above (else ``None``)."""
    if type(sampler) in _INDICES or _own_order(type(sampler)):
        return None
    state = getattr(sampler, "__dict__", None) or {}
    if isinstance(sampler, BatchSampler) and "sampler" in state:  # (a subclass may hold none)
        return state["sampler"]
    dataset = state.get("dataset") if isinstance(sampler, DistributedSampler) else None
    held = _held(sampler if dataset is None else dataset) or {}
    inner = {id(getattr(v, "sampler", None)) for v in held.values()}
    return next((v for v in held.values() if id(v) not in inner), None)
