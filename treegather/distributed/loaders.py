"""Where a Collector's rows come from: the dataset indices a loader hands out, observed.

:func:`observe` records what a loader's index sampler hands out as the loader iterates it
(nothing is iterated twice) and what its samplers drop (:mod:`.drops`); :func:`pure_sampler`,
for ``Collector(sampler)``, takes only a sampler that reading again changes nothing in
(:mod:`.samplers`); :func:`index_tensor` checks ``add(indices=...)``; :func:`dataset_key` is
what the ranks compare of the datasets their indices index.
"""

from __future__ import annotations

import contextlib
import operator
from array import array
from collections.abc import Iterable, Iterator
from itertools import accumulate
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    Subset,
)

from .._errors import ArgumentTypeError
from .drops import Drop, drops
from .samplers import chain, reader

__all__ = ["Observation", "index_tensor", "observe", "pure_sampler"]

Tensor = torch.Tensor
OBSERVE = (
    "in a loop of your own, iterate with `for batch in col.observe(loader)`; where a framework "
    "runs the loop, make the Collector with the loader it runs (Collector(trainer.val_dataloaders) "
    "in Lightning) or pass add(outputs, indices=...) with each batch's dataset indices (Lightning "
    "gives them to its prediction writers as batch_indices)"
)


class Observation:
    """One pass over a loader: what its index sampler handed out, and how far the loop got."""

    __slots__ = ("at", "dataset", "drops", "finished", "handed", "length", "started", "yielded")

    def __init__(self) -> None:
        self.dataset: tuple[str, str] | None = None  # what its indices index (dataset_key)
        self.drops: list[Drop] = []  # what its samplers leave out of the dataset (drop_last)
        self.handed: list[array[int] | str] = []  # each batch of indices handed out, copied
        self.length: int | None = None  # len(loader) when it has one
        self.started = False  # the loader iterated the index sampler it was given
        self.yielded = 0  # batches the loop received
        self.finished = False  # the loader ran to its end
        self.at = 0  # what an add notes: batches the loop received; -1 once the loop is over

    def rows(self) -> tuple[Tensor, list[int]]:
        """The indices of the batches the loop received, one after the other (int64), and where
        each batch ends in them (``0`` first); a typed error where one is not dataset indices."""
        received: list[array[int]] = []
        for b, item in enumerate(self.handed[: self.yielded]):
            if isinstance(item, str):
                raise ArgumentTypeError(
                    f"the loader's batch #{b} of indices is not dataset indices ({item}): the "
                    "Collector cannot tell its rows; pass add(outputs, indices=...) and iterate "
                    "the loader itself"
                )
            received.append(item)
        flat = bytearray(b"".join(received))  # (each batch's int64s, one after the other)
        ends = [0, *accumulate(map(len, received))]
        if not flat:
            return torch.zeros(0, dtype=torch.int64), ends
        return index_tensor(torch.frombuffer(flat, dtype=torch.int64), _HANDED), ends


_HANDED = "the indices the loader's sampler handed out"


def _copied(item: Any) -> tuple[Any, array[int] | str]:
    """One item an index sampler hands out (a batch of indices: a list, tuple, tensor, numpy
    array, range or other iterable of ints; or one index) as the loader gets it, and a copy of
    its indices taken now (a sampler may refill one list in place), or why it has none."""
    try:
        kind = type(item)
        if kind is list or kind is tuple or kind is range:
            return item, array("q", item)  # (one C pass)
        if isinstance(item, Tensor) or kind.__module__ == "numpy":
            ok = item.dtype.kind in "iu" if kind.__module__ == "numpy" else _integer(item.dtype)
            if not ok:
                return item, f"{kind.__name__} of {item.dtype}"
            return item, array("q", item.reshape(-1).tolist())
        if hasattr(item, "__index__"):  # one index (a sampler without batches)
            return item, array("q", (operator.index(item),))
        if iter(item) is item:  # read once (a generator): the loader gets what was read
            items = list(item)
            return iter(items), array("q", items)
        return item, array("q", item)
    except (TypeError, ValueError, OverflowError) as exc:
        return item, f"{type(item).__name__}: {exc}"


def _integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


class _Recording:
    """An index sampler seen through: what it hands out is noted, everything else forwarded."""

    def __init__(self, sampler: Any, seen: Observation) -> None:
        self._sampler = sampler
        self._seen = seen

    def __iter__(self) -> Iterator[Any]:
        self._seen.started = True
        handed = self._seen.handed
        for item in self._sampler:
            item, kept = _copied(item)
            handed.append(kept)
            yield item

    def __len__(self) -> int:
        return len(self._sampler)

    def __getattr__(self, name: str) -> Any:  # set_epoch, .sampler, ... (accelerate calls them)
        return getattr(self._sampler, name)


def _base(loader: Any) -> DataLoader[Any]:
    """The torch ``DataLoader`` whose index sampler makes ``loader``'s batches, or a typed error
    (before anything is iterated)."""
    kind = type(loader).__name__
    inner = vars(loader).get("base_dataloader") if hasattr(loader, "__dict__") else None
    base = loader if inner is None else inner  # (accelerate's prepared loaders wrap one)
    why = (
        "accelerate's DataLoaderDispatcher (dispatch_batches=True) loads every batch on rank 0 "
        "and sends each rank its slice: no rank's own indices to observe"
        if kind == "DataLoaderDispatcher"
        else f"this {kind} skips its first batches (accelerate's skip_first_batches)"
        if inner is not None and vars(loader).get("skip_batches", 0)
        else f"it needs a torch DataLoader (or one accelerate prepared), got {kind}"
        if not isinstance(base, DataLoader) or type(base).__iter__ is not DataLoader.__iter__
        else "a DataLoader over an IterableDataset has no sampler of dataset indices to observe"
        if isinstance(base.dataset, IterableDataset)
        else "with in_order=False a DataLoader yields its workers' batches as they come, not in "
        "the order their indices were handed out"
        if base.num_workers and not getattr(base, "in_order", True)
        else None
    )
    if why is not None:
        raise ArgumentTypeError(
            f"Collector.observe: {why}; pass add(outputs, indices=...) with each batch's indices"
        )
    return base


@contextlib.contextmanager
def _recorded(loader: DataLoader[Any], seen: Observation) -> Iterator[None]:
    """While the loader's iterator is made and starts: its index sampler seen through a
    :class:`_Recording` (the attribute ``DataLoader._index_sampler`` reads, and a persistent
    worker iterator's own), put back as it was afterwards, whatever happens."""
    state = vars(loader)
    name = "batch_sampler" if state.get("batch_sampler") is not None else "sampler"
    sampler = state[name]
    recording = _Recording(sampler, seen)
    kept = state.get("_iterator")  # persistent_workers: the iterator reuses its own sampler
    if kept is not None:
        kept._index_sampler = recording
    state[name] = recording
    try:
        yield
    finally:
        state[name] = sampler
        kept = state.get("_iterator")
        if kept is not None and getattr(kept, "_index_sampler", None) is recording:
            kept._index_sampler = sampler  # (this epoch's sampler iterator keeps recording)


def observe(loader: Iterable[Any], seen: Observation) -> Iterator[Any]:
    """``loader``'s batches, as ``for batch in loader`` gives them, with ``seen`` noting the
    index batch behind each. Checks ``loader`` at once (a typed error before anything is
    iterated); the batches come when the generator is iterated."""
    base = _base(loader)
    with contextlib.suppress(TypeError):  # (a sampler with no length: the loader has none)
        seen.length = len(base)  # (accelerate's loaders: their base's length)
    seen.dataset = dataset_key(base.dataset)
    seen.drops = drops(base)
    return _batches(loader, base, seen)


def _batches(loader: Iterable[Any], base: DataLoader[Any], seen: Observation) -> Iterator[Any]:
    with _recorded(base, seen):
        batches = iter(loader)
        first = next(batches, _END)
    if not seen.started:
        raise ArgumentTypeError(
            f"Collector.observe: {type(loader).__name__} made its batches without the index "
            "sampler it holds; pass add(outputs, indices=...) with each batch's indices"
        )
    try:
        if first is not _END:
            seen.yielded = seen.at = 1
            yield first
            for batch in batches:
                seen.yielded += 1
                seen.at = seen.yielded
                yield batch
        seen.finished = True
    finally:  # (finished, left by an error, or by break: that closes this generator at once)
        seen.at = -1


_END: Any = object()


def dataset_key(dataset: Any) -> tuple[str, str]:
    """What a loader's indices index, as the ranks compare it and as shown: the dataset's class
    and length, a ``Subset``'s indices (hashed: ints hash alike in every process)."""
    kind, n = type(dataset), len(dataset) if hasattr(type(dataset), "__len__") else None
    if not isinstance(dataset, Subset):
        return f"{kind.__module__}.{kind.__qualname__}:{n}", f"a {kind.__qualname__} of {n} samples"
    picked = tuple(torch.as_tensor(dataset.indices, dtype=torch.int64).tolist())
    inner = dataset_key(dataset.dataset)
    shown = ", ".join(map(str, picked[:4])) + (", ..." if len(picked) > 4 else "")
    return f"Subset:{hash(picked)}:{inner[0]}", f"a Subset of {n} samples ({shown}) of {inner[1]}"


def pure_sampler(source: Any) -> Any:
    """The index sampler behind ``source`` (a sampler, or a ``DataLoader``'s batch sampler or
    sampler) when reading it again is known to change nothing (:mod:`.samplers`), else a typed
    error."""
    if source is None:
        return None
    if isinstance(source, (list, tuple)) and any(isinstance(x, DataLoader) for x in source):
        raise ArgumentTypeError(
            f"Collector({type(source).__name__}): a {type(source).__name__} of {len(source)} "
            "DataLoaders (a framework's loaders: Lightning's trainer.val_dataloaders with "
            "several); give the Collector the one loader it collects, e.g. "
            "Collector(trainer.val_dataloaders[dataloader_idx])"
        )
    sampler = source
    if isinstance(source, DataLoader):
        sampler = source.batch_sampler if source.batch_sampler is not None else source.sampler
    if reader(sampler) is not None:
        return sampler
    what = chain(sampler).removeprefix("a ")
    held = f"the {what} of this {type(source).__name__}" if sampler is not source else f"a {what}"
    raise ArgumentTypeError(
        f"Collector({type(source).__name__}): {held} is not known to give the same order when "
        "read again (random samplers draw a new one, accelerate's advance their epoch), so the "
        f"Collector will not read it a second time: {OBSERVE}. Collector(sampler) reads "
        "SequentialSampler, DistributedSampler, Lightning's samplers over those, a BatchSampler "
        "over those, accelerate's BatchSamplerShard over one, or a wrapper that hands one of "
        "them on"
    )


def read(sampler: Any) -> Tensor:
    """This epoch's indices of a :func:`pure_sampler` (batches flattened), as int64, read from
    copies where it is a wrapper (:func:`.samplers.reader`)."""
    found = reader(sampler)
    if found is None:  # (it held what it holds now when the Collector was made)
        raise ArgumentTypeError(f"Collector: {chain(sampler)} no longer gives a known order")
    return index_tensor(list(found), "the sampler's indices")


def index_tensor(given: Any, what: str = "indices=") -> Tensor:
    """``given`` (dataset indices: ints, batches of ints, or an integer tensor or array) as a
    flat int64 CPU tensor; a typed error for anything else (a bool mask, floats, negatives)."""
    if not isinstance(given, Tensor):
        if isinstance(given, (list, tuple)) and given and isinstance(given[0], (list, tuple)):
            given = [i for batch in given for i in batch]  # a batch sampler's batches
        if type(given) is list and set(map(type, given)) == {int}:  # (a C pass: 10x as_tensor)
            with contextlib.suppress(OverflowError):  # (past int64: as_tensor says so below)
                given = torch.frombuffer(array("q", given), dtype=torch.int64)
    if not isinstance(given, Tensor):
        try:
            given = torch.as_tensor(given) if len(given) else torch.zeros(0, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ArgumentTypeError(
                f"{what} must be dataset indices (non-negative integers): {exc}"
            ) from None
    if given.dtype == torch.bool or given.is_floating_point() or given.is_complex():
        mask = " (a mask? pass mask.nonzero().flatten())" if given.dtype == torch.bool else ""
        raise ArgumentTypeError(
            f"{what} must be dataset indices (non-negative integers), got {given.dtype}{mask}"
        )
    try:
        flat = given.detach().reshape(-1).to("cpu", torch.int64)
    except (NotImplementedError, RuntimeError) as exc:  # (a meta tensor holds no indices)
        raise ArgumentTypeError(
            f"{what} must be dataset indices, readable on the CPU: {given.device} tensor: {exc}"
        ) from None
    if flat.numel() and int(flat.min()) < 0:
        raise ArgumentTypeError(
            f"{what} must be dataset indices (non-negative integers), got {int(flat.min())}"
        )
    return flat
