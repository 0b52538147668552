"""The Collector with the loaders people use, on the shared gloo groups of 2 and 3 ranks.

Every loader of the matrix (torch's samplers and batch samplers, a length-bucketing batch
sampler, accelerate's prepared loaders, Lightning's ``UnrepeatedDistributedSampler`` where it is
installed, an ``IterableDataset``) runs two epochs, shuffled and not, with 0 and 2 workers,
through ``col.observe(loader)`` and, where the sampler may be read again, the plain loop over
``Collector(loader)``. Each rank also runs the same loader, built the same way, without a
Collector. The tests check, per case and epoch: every sample the ranks' loaders yielded comes
back once, in dataset order, each row its own sample (its ``x`` and name are the dataset's);
each rank's loader yielded the same batches as without a Collector, and its sampler, generators
and epoch counters end the same.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import spawned_groups
import torch
import torch.distributed as dist
from spawned_groups import WORLD_SIZES
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)

import treegather as tg
import treegather.distributed as tgd

N = 29  # samples: uneven over 2 and 3 ranks and over batches of 4
LOADER_WORKERS = True  # (spawned_groups: the ranks' fork servers import this module)
BATCH = 4
EPOCHS = 2
X = torch.randn(N, 3, generator=torch.Generator().manual_seed(0))
LAYOUT = tg.by_path({"name": tg.cat_items()})
HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None


class Samples(Dataset[dict[str, Any]]):
    """Sample ``i``: its index, its features and its name (each row says which sample it is)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"i": i, "x": X[i], "name": f"s{i}"}


class Stream(IterableDataset[dict[str, Any]]):
    """This rank's samples as a stream, split between the loader's workers."""

    def __init__(self, rank: int, world: int, shuffle: bool, epoch: int) -> None:
        self.rank, self.world, self.shuffle, self.epoch = rank, world, shuffle, epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        mine = list(range(self.rank, N, self.world))
        if self.shuffle:
            g = torch.Generator().manual_seed(100 + self.epoch)
            mine = [mine[j] for j in torch.randperm(len(mine), generator=g).tolist()]
        info = get_worker_info()
        if info is not None:
            mine = mine[info.id :: info.num_workers]
        return iter(Samples()[i] for i in mine)


class Buckets(Sampler[list[int]]):
    """A length-bucketing batch sampler: this rank's samples sorted by a length, cut into
    batches, the batches shuffled each epoch (its own generator)."""

    def __init__(self, rank: int, world: int, shuffle: bool) -> None:
        self.mine = sorted(range(rank, N, world), key=lambda i: (i * 7) % 5)
        self.shuffle = shuffle
        self.generator = torch.Generator().manual_seed(11 + rank)

    def __iter__(self) -> Iterator[list[int]]:
        batches = [self.mine[k : k + BATCH] for k in range(0, len(self.mine), BATCH)]
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=self.generator)]
        return iter(batches)

    def __len__(self) -> int:
        return -(-len(self.mine) // BATCH)


def _shard(rank: int, world: int) -> list[int]:
    return list(range(rank, N, world))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@dataclasses.dataclass
class Built:
    loader: Any
    epoch: Callable[[int], None] = lambda e: None  # before each epoch (set_epoch)
    state: Callable[[], Any] = lambda: None  # generators, epoch counters at the end
    plain: bool = False  # Collector(loader) with a plain loop is allowed
    given: bool = False  # batches name their indices (add(indices=...))
    drops: bool = False  # it drops samples (drop_last): the result takes them with partial=True


def _torch_loader(sampler: Any = None, workers: int = 0, **kw: Any) -> DataLoader[Any]:
    return DataLoader(
        Samples(),
        batch_size=kw.pop("batch_size", BATCH),
        sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,
        **kw,
    )


def _state(*objs: Any) -> list[Any]:
    out = []
    for obj in objs:
        if isinstance(obj, torch.Generator):
            out.append(obj.get_state().clone())
        else:
            out.append(obj)
    return out


def _distributed(rank: int, world: int, shuffle: bool, workers: int, drop: bool) -> Built:
    s = DistributedSampler(Samples(), world, rank, shuffle=shuffle, seed=5, drop_last=drop)
    state = lambda: _state(s.epoch)  # noqa: E731
    return Built(_torch_loader(s, workers), s.set_epoch, state, plain=True, drops=drop)


def _random(rank: int, world: int, shuffle: bool, workers: int) -> Built:
    g = _gen(21 + rank)  # every rank evaluates every sample, in an order of its own
    s = RandomSampler(Samples(), generator=g) if shuffle else SequentialSampler(Samples())
    return Built(_torch_loader(s, workers), state=lambda: _state(g), plain=not shuffle)


def _subset(rank: int, world: int, shuffle: bool, workers: int) -> Built:
    g = _gen(31 + rank)
    s = SubsetRandomSampler(_shard(rank, world), generator=g) if shuffle else _shard(rank, world)
    return Built(_torch_loader(s, workers), state=lambda: _state(g), plain=not shuffle)


def _weighted(rank: int, world: int, shuffle: bool, workers: int) -> Built:
    g = _gen(41 + rank)
    weights = torch.zeros(N)
    weights[_shard(rank, world)] = 1.0
    # shuffled: drawn with replacement (samples twice, samples never); else each once
    n = len(_shard(rank, world))
    s = WeightedRandomSampler(weights, n, replacement=shuffle, generator=g)
    return Built(_torch_loader(s, workers), state=lambda: _state(g))


def _batch_sampler(rank: int, world: int, shuffle: bool, workers: int) -> Built:
    s = DistributedSampler(Samples(), world, rank, shuffle=shuffle, seed=6)
    loader = DataLoader(
        Samples(),
        batch_sampler=BatchSampler(s, BATCH, drop_last=False),
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    return Built(loader, s.set_epoch, lambda: _state(s.epoch), plain=True)


def _buckets(rank: int, world: int, shuffle: bool, workers: int) -> Built:
    b = Buckets(rank, world, shuffle)
    loader = DataLoader(
        Samples(), batch_sampler=b, num_workers=workers, persistent_workers=workers > 0
    )
    return Built(loader, state=lambda: _state(b.generator))


def _accelerate(even: bool) -> Callable[..., Built]:
    def build(rank: int, world: int, shuffle: bool, workers: int) -> Built:
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.manual_seed(1234)  # (as accelerate.utils.set_seed: the ranks shuffle alike)
        config = DataLoaderConfiguration(even_batches=even, use_seedable_sampler=True)
        accelerator = Accelerator(cpu=True, dataloader_config=config)
        assert accelerator.num_processes == world  # (it joined the group: shards, not copies)
        raw = DataLoader(Samples(), batch_size=BATCH, shuffle=shuffle, num_workers=workers)
        loader = accelerator.prepare(raw)
        assert type(loader.batch_sampler).__name__ == "BatchSamplerShard"

        def state() -> Any:
            batches = loader.batch_sampler
            while hasattr(batches, "batch_sampler"):  # (accelerate's shard, then the user's)
                batches = batches.batch_sampler
            inner = getattr(batches, "sampler", None)
            generator = getattr(inner, "generator", None)
            return _state(loader.iteration, getattr(inner, "epoch", None), generator)

        return Built(loader, state=state, plain=not shuffle)  # (shuffled: a seeded epoch)

    return build


def _lightning(rank: int, world: int, shuffle: bool, workers: int) -> Built:
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

    s = UnrepeatedDistributedSampler(Samples(), num_replicas=world, rank=rank, shuffle=shuffle)
    return Built(_torch_loader(s, workers), s.set_epoch, lambda: _state(s.epoch), plain=True)


class _Streams:
    """A stream loader per epoch (the dataset is made for its epoch)."""

    def __init__(self, rank: int, world: int, shuffle: bool, workers: int) -> None:
        self.args = rank, world, shuffle
        self.workers = workers
        self.epoch = 0

    def __iter__(self) -> Iterator[Any]:
        data = Stream(*self.args, self.epoch)
        return iter(DataLoader(data, batch_size=BATCH, num_workers=self.workers))


def _stream(rank: int, world: int, shuffle: bool, workers: int) -> Built:
    streams = _Streams(rank, world, shuffle, workers)
    return Built(streams, lambda e: setattr(streams, "epoch", e), given=True)


CASES: dict[str, Callable[..., Built]] = {
    "DistributedSampler": lambda r, w, s, k: _distributed(r, w, s, k, drop=False),
    "DistributedSampler(drop_last)": lambda r, w, s, k: _distributed(r, w, s, k, drop=True),
    "RandomSampler": _random,
    "SubsetRandomSampler": _subset,
    "WeightedRandomSampler": _weighted,
    "batch_sampler=BatchSampler(DistributedSampler)": _batch_sampler,
    "batch_sampler=Buckets": _buckets,
    "accelerate(even_batches=True)": _accelerate(True),
    "accelerate(even_batches=False)": _accelerate(False),
    "UnrepeatedDistributedSampler": _lightning,
    "IterableDataset": _stream,
}
SKIP = {"UnrepeatedDistributedSampler": not HAS_LIGHTNING}
SETTINGS = [(s, k) for s in (False, True) for k in (0, 2)]


def _epochs(built: Built, spelling: str | None) -> list[Any]:
    """Two epochs of ``built``'s loader: each the indices of every batch this rank's loop
    received, and (with a Collector) the result and ``col.indices``."""
    out = []
    for e in range(EPOCHS):
        built.epoch(e)
        seen: list[list[int]] = []
        col = tgd.Collector(built.loader) if spelling == "plain" else tgd.Collector()
        batches = built.loader
        if spelling == "observe":
            batches = col.observe(built.loader)
        for batch in batches:
            seen.append(batch["i"].tolist())
            if spelling is not None:
                rows = {"i": batch["i"], "x": batch["x"], "name": batch["name"]}
                col.add(rows, indices=batch["i"] if built.given else None)
        result = col.all_gather(LAYOUT, partial=built.drops) if spelling is not None else None
        out.append((seen, result, col.indices))
    return out


# (importing Lightning takes seconds of its own in every rank)
@spawned_groups.register("loaders.matrix", budget_s=45 + 60 * HAS_LIGHTNING)
def _matrix(rank: int, world: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for name, build in CASES.items():
        if SKIP.get(name):
            continue
        given = False
        for shuffle, workers in SETTINGS:
            if workers == 0 or given:  # the loader alone (a sampler's: the same at 0 workers)
                alone = build(rank, world, shuffle, workers)
                out[(name, shuffle, "alone", workers)] = (_epochs(alone, None), alone.state())
                spellings = ["observe", "plain"] if alone.plain else ["observe"]
                given = alone.given
                if given:  # (a stream's workers each yield part of it)
                    spellings = ["indices="]
            for spelling in spellings:
                built = build(rank, world, shuffle, workers)
                try:
                    got = (_epochs(built, spelling), built.state())
                except Exception as exc:  # (every rank raises alike: reported by the test)
                    got = ("raised", f"{type(exc).__name__}: {exc}")
                out[(name, shuffle, workers, spelling)] = got
    dist.barrier()
    return out


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world = request.param
    return world, spawned_groups.results(world, tmp_path_factory)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_every_loader_gives_every_sample_once_in_dataset_order(ranks: Any, name: str) -> None:
    if SKIP.get(name):
        pytest.skip(f"{name}: its package is not installed")
    world, results = ranks
    per_rank = [res["loaders.matrix"] for res in results]
    checked = 0
    for key in per_rank[0]:
        if key[0] != name or key[2] == "alone":
            continue
        _, shuffle, workers, spelling = key
        got = [mine[key] for mine in per_rank]
        assert got[0][0] != "raised", (key, got[0])
        at = workers if spelling == "indices=" else 0
        alone = [mine[(name, shuffle, "alone", at)] for mine in per_rank]
        for r in range(world):
            # The loader yielded what it yields without a Collector, and ends in the same state.
            assert [e[0] for e in got[r][0]] == [e[0] for e in alone[r][0]], (key, r)
            assert _same(got[r][1], alone[r][1]), (key, r, got[r][1], alone[r][1])
        for e in range(EPOCHS):
            yielded = sorted({i for r in range(world) for b in got[r][0][e][0] for i in b})
            for r in range(world):
                _, result, indices = got[r][0][e]
                assert indices.tolist() == yielded, (key, e, r)
                assert result["i"].tolist() == yielded, (key, e, r)
                assert torch.equal(result["x"], X[yielded]), (key, e, r)
                assert result["name"] == [f"s{i}" for i in yielded], (key, e, r)
            checked += 1
    assert checked >= len(SETTINGS) * EPOCHS, checked


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)
