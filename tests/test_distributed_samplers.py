"""Which samplers ``Collector(loader)`` reads again (treegather/distributed/samplers.py), in one
process: wrappers over a known order are known by what they hold and how they iterate, not by
their names; reading them writes on nothing the loader holds; anything else is refused before
anything is drawn. Lightning's own wrappers, under a real Trainer: tests/test_frameworks.py.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

import treegather as tg
import treegather.distributed as tgd

N = 11


class Samples(Dataset[int]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


class Recording:
    """A pass-through as Lightning's predict loaders hold one (``_IndexBatchSamplerWrapper``):
    the batch sampler's attributes copied, the batches it hands out recorded, its own iterator."""

    def __init__(self, batch_sampler: Any) -> None:
        self.__dict__ = {k: v for k, v in vars(batch_sampler).items()}
        self.seen_batch_indices: list[list[int]] = []
        self._batch_sampler = batch_sampler
        self._iterator: Iterator[list[int]] | None = None

    def __iter__(self) -> Recording:
        self.seen_batch_indices = []
        self._iterator = iter(self._batch_sampler)
        return self

    def __next__(self) -> list[int]:
        assert self._iterator is not None
        batch = next(self._iterator)
        self.seen_batch_indices.append(batch)
        return batch

    def __len__(self) -> int:
        return len(self._batch_sampler)


class Appending(Sampler[int]):
    """A pass-through that appends what it hands out to a list it keeps (never replaced)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.handed: list[int] = []

    def __iter__(self) -> Iterator[int]:
        for i in self.sampler:
            self.handed.append(i)
            yield i

    def __len__(self) -> int:
        return len(self.sampler)


class FromSampler(Dataset[int]):
    """A sampler's indices as a dataset (catalyst's ``DatasetFromSampler``, Lightning's
    ``_DatasetSamplerWrapper``)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.listed: list[int] | None = None

    def __getitem__(self, i: int) -> int:
        if self.listed is None:
            self.listed = list(self.sampler)
        return self.listed[i]

    def __len__(self) -> int:
        return len(self.sampler)

    def reset(self) -> None:
        self.listed = list(self.sampler)


class Redistributing(DistributedSampler[int]):
    """A DistributedSampler over another sampler's order (catalyst's and Lightning's
    ``DistributedSamplerWrapper``)."""

    def __init__(self, sampler: Any, **kw: Any) -> None:
        super().__init__(FromSampler(sampler), **kw)

    def __iter__(self) -> Iterator[int]:
        self.dataset.reset()
        return (self.dataset[i] for i in super().__iter__())


class Backwards(Redistributing):
    """A DistributedSampler over another sampler's order, handed out backwards."""

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[::-1])


class Reversed(Appending):
    """Holds a known order and hands it out backwards: not the order it holds."""

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.sampler)[::-1])


class OwnShuffle(Appending):
    """Holds a known order and a generator of its own: shuffles with it."""

    def __init__(self, sampler: Any) -> None:
        super().__init__(sampler)
        self.generator = torch.Generator().manual_seed(0)

    def __iter__(self) -> Iterator[int]:
        order = list(self.sampler)
        return iter([order[j] for j in torch.randperm(len(order), generator=self.generator)])


class EveryOther(BatchSampler):
    """A BatchSampler subclass holding a batch sampler, not a sampler (accelerate's
    ``BatchSamplerShard``): hands out every other batch of it."""

    def __init__(self, batch_sampler: BatchSampler) -> None:  # (no super().__init__: no .sampler)
        self.batch_sampler = batch_sampler

    def __iter__(self) -> Iterator[list[int]]:
        return iter(list(self.batch_sampler)[::2])

    def __len__(self) -> int:
        return (len(self.batch_sampler) + 1) // 2


class Skipping(DistributedSampler[int]):
    """A DistributedSampler subclass that skips its first sample: not its base's order."""

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[1:])


def _plain_loop(loader: DataLoader[Any]) -> tuple[list[int], Any, tgd.Collector]:
    """``Collector(loader)`` and a loop it does not own: every batch added, then exchanged."""
    col = tgd.Collector(loader)
    got = []
    for batch in loader:
        got += batch.tolist()
        col.add({"i": batch})
    return got, col.all_gather(), col


def _recording(shuffle: bool) -> Recording:
    inner = Redistributing(SequentialSampler(Samples()), num_replicas=2, rank=1, shuffle=shuffle)
    return Recording(BatchSampler(inner, 3, drop_last=False))


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize(
    "make",
    [
        _recording,
        lambda shuffle: BatchSampler(Appending(SequentialSampler(Samples())), 4, False),
        lambda shuffle: Appending(DistributedSampler(Samples(), 2, 0, shuffle=shuffle)),
        lambda shuffle: Redistributing(
            Appending(SequentialSampler(Samples())), shuffle=shuffle, num_replicas=3, rank=2
        ),
    ],
    ids=["recording_redistributing", "batches_appending", "appending_distributed", "nested"],
)
def test_a_wrapper_over_a_known_order_is_read_on_copies(make: Any, shuffle: bool) -> None:
    sampler = make(shuffle)
    loader = (
        DataLoader(Samples(), batch_sampler=sampler)
        if isinstance(sampler, (Recording, BatchSampler))
        else DataLoader(Samples(), batch_size=4, sampler=sampler)
    )
    got, result, col = _plain_loop(loader)
    assert result["i"].tolist() == col.indices.tolist() == sorted(got)
    assert len(set(got)) == len(got)
    # the wrapper's records hold the loop's one pass: the Collector read copies
    if isinstance(sampler, Recording):
        assert [i for b in sampler.seen_batch_indices for i in b] == got
    for held in _appending(sampler):
        assert len(held.handed) == len(held)  # (once, by the loop)


def _appending(sampler: Any) -> list[Appending]:
    out = []
    while sampler is not None:
        if isinstance(sampler, Appending):
            out.append(sampler)
        sampler = getattr(sampler, "sampler", None) or getattr(
            getattr(sampler, "dataset", None), "sampler", None
        )
    return out


@pytest.mark.parametrize(
    "make, named",
    [
        (
            lambda g: Recording(BatchSampler(RandomSampler(Samples(), generator=g), 3, False)),
            "Recording over a BatchSampler over a RandomSampler",
        ),
        (
            lambda g: Redistributing(RandomSampler(Samples(), generator=g), num_replicas=2, rank=0),
            "Redistributing over a RandomSampler",
        ),
        (lambda g: Reversed(SequentialSampler(Samples())), "Reversed over a SequentialSampler"),
        (
            lambda g: Backwards(SequentialSampler(Samples()), num_replicas=2, rank=0),
            "Backwards over a SequentialSampler",
        ),
        (
            lambda g: OwnShuffle(SequentialSampler(Samples())),
            "BatchSampler over a OwnShuffle of this",
        ),
        (
            lambda g: Skipping(Samples(), num_replicas=2, rank=0),
            "BatchSampler over a Skipping of this",
        ),
        (
            lambda g: EveryOther(BatchSampler(SequentialSampler(Samples()), 3, False)),
            "EveryOther over a BatchSampler over a SequentialSampler",
        ),
    ],
    ids=[
        "recording_random",
        "redistributing_random",
        "reversed",
        "redistributing_backwards",
        "own_generator",
        "skipping",
        "batch_sampler_subclass_without_sampler",
    ],
)
def test_a_wrapper_not_known_to_repeat_its_order_is_refused(make: Any, named: str) -> None:
    g = torch.Generator().manual_seed(0)
    sampler = make(g)
    loader = (
        DataLoader(Samples(), batch_sampler=sampler)
        if isinstance(sampler, (Recording, BatchSampler))
        else DataLoader(Samples(), batch_size=4, sampler=sampler)
    )
    state, rng = g.get_state(), torch.get_rng_state()
    own = getattr(sampler, "generator", None)
    own_state = None if own is None else own.get_state()
    with pytest.raises(tg.ArgumentTypeError, match="not known to give the same order") as info:
        tgd.Collector(loader)
    text = str(info.value)
    assert named in text, text
    assert "add(outputs, indices=...)" in text and "Collector(trainer.val_dataloaders)" in text
    # nothing was drawn
    assert torch.equal(g.get_state(), state) and torch.equal(torch.get_rng_state(), rng)
    assert own is None or torch.equal(own.get_state(), own_state)


def test_a_list_of_loaders_is_refused_naming_the_one_to_give() -> None:
    loaders = [DataLoader(Samples()), DataLoader(Samples())]  # (trainer.val_dataloaders: several)
    with pytest.raises(tg.ArgumentTypeError, match=r"val_dataloaders\[dataloader_idx\]"):
        tgd.Collector(loaders)


class GlobalShuffle(Appending):
    """Holds a known order and shuffles it with a global generator (torch's, Python's or
    NumPy's): a new order each read, which one read may give as the order it holds."""

    def __init__(self, sampler: Any, draw: str) -> None:
        super().__init__(sampler)
        self.draw = draw

    def __iter__(self) -> Iterator[int]:
        order = list(self.sampler)
        if self.draw == "torch":
            return iter([order[j] for j in torch.randperm(len(order))])
        if self.draw == "python":
            random.shuffle(order)
            return iter(order)
        return iter([order[j] for j in np.random.permutation(len(order))])


@pytest.mark.parametrize(
    "make",
    [
        lambda: RandomSampler(range(2)),
        lambda: GlobalShuffle(SequentialSampler(range(2)), "torch"),
        lambda: GlobalShuffle(SequentialSampler(range(2)), "python"),
        lambda: BatchSampler(GlobalShuffle(SequentialSampler(range(2)), "numpy"), 1, False),
    ],
    ids=["random_sampler_over_range", "torch", "python", "numpy_batches"],
)
def test_a_wrapper_drawing_from_a_global_generator_is_refused_whatever_it_draws(
    make: Any,
) -> None:
    # one read of a shuffle of 2 gives the order it holds half the time: over 8 seeds, that
    # read would have taken it for a pass-through (and the loop's order for that order)
    for seed in range(8):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        states = torch.get_rng_state(), random.getstate(), np.random.get_state()
        with pytest.raises(tg.ArgumentTypeError, match="not known to give the same order"):
            tgd.Collector(DataLoader(Samples(), batch_size=1, sampler=make()))
        # the generators are as they were: refusing drew nothing from the user's streams
        assert torch.equal(torch.get_rng_state(), states[0])
        assert random.getstate() == states[1]
        assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), states[2]))


def test_accelerate_s_batch_sampler_shard_is_refused_naming_what_it_holds() -> None:
    data_loader = pytest.importorskip("accelerate.data_loader")
    inner = BatchSampler(SequentialSampler(Samples()), 3, False)
    shard = data_loader.BatchSamplerShard(inner, num_processes=2, process_index=1)
    with pytest.raises(tg.ArgumentTypeError, match="not known to give the same order") as info:
        tgd.Collector(DataLoader(Samples(), batch_sampler=shard))
    assert "BatchSamplerShard over a BatchSampler over a SequentialSampler" in str(info.value)
