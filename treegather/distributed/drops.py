"""What a loader leaves out of its dataset: ``drop_last``, counted from what its samplers hold.

An evaluation is complete when it has seen the dataset: every index its sampler chain would
give with nothing dropped, not what survived ``drop_last``. :func:`drops` walks the chain from
the loader's index sampler down (:func:`.samplers.wrapped`) and counts, from lengths alone
(nothing is iterated), what each sampler that drops leaves out. Each is known by what it holds
and how it iterates, never by its name:

- a batch sampler that iterates as torch's ``BatchSampler`` does, with ``drop_last=True`` (the
  one ``DataLoader(batch_size=..., drop_last=True)`` makes): the last ``len(sampler) %
  batch_size`` indices of its sampler;
- a ``DistributedSampler`` (or a wrapper built on its positions) with ``drop_last=True``: the
  last ``len(dataset) - total_size`` samples of its dataset, which no rank gets;
- a *sharding* wrapper (:func:`.samplers.place`: accelerate's ``BatchSamplerShard``): the
  batches of the batch sampler it holds that no process gets, from the lengths of copies of it
  standing at each ``process_index`` (the last ones, as a shard that keeps every process's
  batch count equal drops them).

A sampler whose length cannot be read is not counted.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from .samplers import at, place, wrapped

__all__ = ["Drop", "drops"]


class Drop(NamedTuple):
    """What one sampler of a loader's chain leaves out."""

    samples: int | None  # how many samples (None: only batches are known)
    text: str  # where and how many: "DataLoader(drop_last=True) the last 2 of the 6 ..."


def drops(source: Any) -> list[Drop]:
    """What ``source`` (a ``DataLoader``, one accelerate prepared, or a sampler) leaves out of
    the indices its chain would give with nothing dropped, one entry per sampler that drops
    some, the dataset's end first (none: ``[]``)."""
    loader = source if isinstance(source, DataLoader) else None
    node = source
    if loader is not None:  # (accelerate's loaders: the attributes their base DataLoader holds)
        node = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    out: list[Drop] = []
    seen: set[int] = set()
    while node is not None and id(node) not in seen and len(seen) < 8:
        seen.add(id(node))
        try:
            found = _drop(node, loader)
        except (TypeError, ValueError, AttributeError):  # (a length it cannot give)
            found = None
        if found is not None:
            out.append(found)
        node = wrapped(node)
    return out[::-1]


def _drop(node: Any, loader: DataLoader[Any] | None) -> Drop | None:
    state = getattr(node, "__dict__", None) or {}
    if state.get("drop_last") is True and _iterates_as(node, BatchSampler):
        n, size = len(node.sampler), node.batch_size
        left = n % size
        if not left:
            return None
        own = loader is not None and loader.batch_size is not None and node is loader.batch_sampler
        where = "DataLoader(drop_last=True)" if own else "a BatchSampler(drop_last=True)"
        return Drop(
            left,
            f"{where} the last {left} of the {n} indices its {_name(node.sampler)} gives (a "
            f"batch of fewer than {size})",
        )
    if state.get("drop_last") is True and isinstance(node, DistributedSampler):
        whole: int = len(node.dataset)  # type: ignore[arg-type]
        kept: int = node.total_size
        if kept >= whole:
            return None
        data = "the dataset's" if wrapped(node) is None else f"the {_name(wrapped(node))}'s"
        return Drop(
            whole - kept,
            f"{type(node).__name__}(drop_last=True) the last {whole - kept} of {data} {whole} "
            f"samples, which no rank gets ({whole} is no multiple of {node.num_replicas} ranks)",
        )
    found = place(node)
    if found is None:
        return None
    _, count, _, inner = found
    batches = len(inner)
    handed = sum(len(at(node, p)) for p in range(count))
    if handed >= batches:
        return None
    lost = batches - handed
    sizes = _batch_sizes(inner)
    samples = None if sizes is None else sum(sizes[handed:])
    of = "" if samples is None else f" ({samples} samples)"
    return Drop(
        samples,
        f"{type(node).__name__} the last {lost} of the {batches} batches its {_name(inner)} "
        f"gives{of}, which none of its {count} processes gets (each gets as many batches)",
    )


def _iterates_as(node: Any, base: type) -> bool:
    """Whether ``node`` is a ``base`` that iterates as ``base`` does (its ``__iter__``)."""
    return isinstance(node, base) and type(node).__iter__ is base.__iter__  # type: ignore[attr-defined]


def _batch_sizes(batches: Any) -> list[int] | None:
    """Each batch's size, for a batch sampler iterating as torch's ``BatchSampler`` (full
    batches, the last one short unless dropped); ``None`` for others."""
    if not _iterates_as(batches, BatchSampler):
        return None
    n, size = len(batches.sampler), batches.batch_size
    count = len(batches)
    return [min(size, n - b * size) for b in range(count)]


def _name(sampler: Any) -> str:
    return type(sampler).__name__
