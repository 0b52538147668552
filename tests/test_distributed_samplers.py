"""Which samplers ``Collector(loader)`` reads again (treegather/distributed/samplers.py), in one
process: wrappers over a known order are known by what they hold and how they iterate, not by
their names; reading them writes on nothing the loader holds; anything else is refused before
anything is drawn. Lightning's own wrappers, under a real Trainer: tests/test_frameworks.py.
"""

from __future__ import annotations

import itertools
import pickle
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


class Sharding(BatchSampler):
    """A batch sampler sharded over processes (as accelerate's ``BatchSamplerShard``, not
    named so): batch ``b`` of the one it holds goes to process ``b % num_processes``; with
    ``drop_last``, only whole rounds (every process as many batches)."""

    def __init__(self, batch_sampler: Any, num_processes: int, process_index: int) -> None:
        self.batch_sampler = batch_sampler
        self.num_processes, self.process_index = num_processes, process_index
        self.drop_last = getattr(batch_sampler, "drop_last", False)

    def __iter__(self) -> Iterator[list[int]]:
        batches = list(self.batch_sampler)
        if self.drop_last:
            batches = batches[: len(batches) - len(batches) % self.num_processes]
        return iter(batches[self.process_index :: self.num_processes])

    def __len__(self) -> int:
        n = len(self.batch_sampler)
        if self.drop_last:
            return n // self.num_processes
        return len(range(self.process_index, n, self.num_processes))


class Advancing(Sharding):
    """A sharding batch sampler that advances an epoch of its own at each read (rotates its
    batches by it): another order each time it is read."""

    def __init__(self, batch_sampler: Any, num_processes: int, process_index: int) -> None:
        super().__init__(batch_sampler, num_processes, process_index)
        self.epoch = 0

    def __iter__(self) -> Iterator[list[int]]:
        self.epoch += 1
        batches = list(super().__iter__())
        k = self.epoch % max(1, len(batches))
        return iter(batches[k:] + batches[:k])


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
        lambda shuffle: Sharding(
            BatchSampler(DistributedSampler(Samples(), 2, 1, shuffle=shuffle), 2, False), 2, 1
        ),
    ],
    ids=[
        "recording_redistributing",
        "batches_appending",
        "appending_distributed",
        "nested",
        "sharding",
    ],
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
        (
            lambda g: Advancing(BatchSampler(SequentialSampler(Samples()), 3, False), 2, 1),
            "Advancing over a BatchSampler over a SequentialSampler",
        ),
        (
            lambda g: Sharding(BatchSampler(RandomSampler(Samples(), generator=g), 3, False), 2, 0),
            "Sharding over a BatchSampler over a RandomSampler",
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
        "sharding_advancing_its_epoch",
        "sharding_a_random_order",
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


def _shard_settings() -> list[dict[str, Any]]:
    """Every setting of accelerate's ``BatchSamplerShard``: each boolean its signature takes
    (``split_batches``, ``even_batches``) both ways, with the batch sampler it holds dropping
    its last batch or not, on 1 to 3 processes, over datasets smaller and larger than a round
    of batches."""
    import inspect

    data_loader = pytest.importorskip("accelerate.data_loader")
    signature = inspect.signature(data_loader.BatchSamplerShard)
    flags = [name for name, p in signature.parameters.items() if isinstance(p.default, bool)]
    assert {"split_batches", "even_batches"} <= set(flags), flags
    out = []
    for values in itertools.product((False, True), repeat=len(flags) + 1):
        for n, count in itertools.product((3, 11, 12), (1, 2, 3)):
            *chosen, drop = values
            size = 2 * count if chosen[flags.index("split_batches")] else 2
            out.append(
                {"n": n, "processes": count, "size": size, "drop": drop, **dict(zip(flags, chosen))}
            )
    return out


def _shards(setting: dict[str, Any]) -> list[Any]:
    """One ``BatchSamplerShard`` per process of ``setting``, over one batch sampler each."""
    from accelerate.data_loader import BatchSamplerShard

    kw = {k: v for k, v in setting.items() if k not in ("n", "processes", "size", "drop")}
    return [
        BatchSamplerShard(
            BatchSampler(SequentialSampler(range(setting["n"])), setting["size"], setting["drop"]),
            num_processes=setting["processes"],
            process_index=p,
            **kw,
        )
        for p in range(setting["processes"])
    ]


def test_accelerate_s_batch_sampler_shard_is_read_on_copies() -> None:
    """``Collector(loader)`` over each process's shard (the Hugging Face Trainer's eval loader
    under torchrun) takes the order its loop gets, without writing on the loader's objects;
    the samples no process gets (drop_last) make the exchange an error saying how many."""
    settings = _shard_settings()
    for setting in settings:
        shards = _shards(setting)
        every = set()
        for shard in shards:
            every |= {i for batch in shard for i in batch}
        lost = setting["n"] - len(every)
        for shard in shards:
            state = pickle.dumps({k: v for k, v in vars(shard).items() if k != "batch_sampler"})
            loader = DataLoader(range(setting["n"]), batch_sampler=shard)
            col = tgd.Collector(loader)
            got = []
            for batch in loader:
                got += batch.tolist()
                col.add({"i": batch})
            assert (
                pickle.dumps({k: v for k, v in vars(shard).items() if k != "batch_sampler"})
                == state
            )
            if lost:
                with pytest.raises(tg.BatchSizeError) as info:
                    col.all_gather()
                text = str(info.value)
                assert f"its loader drops {lost} sample(s) of the dataset" in text, (setting, text)
                assert "evaluate without drop_last" in text
                col.reset()
                for batch in loader:
                    col.add({"i": batch})
            result = col.all_gather(partial=bool(lost))
            assert col.indices.tolist() == sorted(set(got)), setting
            assert result is None if not got else result["i"].tolist() == sorted(set(got))
    assert any(s["drop"] and s["processes"] > 1 for s in settings)


def test_a_sharding_wrapper_s_dropped_batches_are_counted() -> None:
    """Not accelerate's: a shard of our own, keeping whole rounds (12 samples in batches of 2
    on 4 processes: the last 2 batches, 4 samples, go to no process)."""
    for index in range(4):
        shard = Sharding(BatchSampler(SequentialSampler(range(12)), 2, True), 4, index)
        loader = DataLoader(range(12), batch_sampler=shard)
        col = tgd.Collector(loader)
        for batch in loader:
            col.add({"i": batch})
        with pytest.raises(
            tg.BatchSizeError,
            match=r"drops 4 sample\(s\) of the dataset: "
            r"Sharding the last 2 of the 6 batches its BatchSampler gives \(4 samples\)",
        ):
            col.all_gather()
