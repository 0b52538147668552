"""Evaluation and contrastive losses across ranks: ``Collector`` and ``all_gather(sync_grads=True)``.

Single-process checks run here; the multi-process checks run in the spawned gloo groups of 2 and
3 ranks shared with the other distributed test modules (:mod:`spawned_groups`: each rank writes
its results to a file; the tests compare them with one process holding every rank's data), under
a hard deadline. The group of 2 also runs the evaluation benchmark
(``python -m treegather.benchmarks.evaluation``) on a small dataset.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import gc
import itertools
import random
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import optree
import pytest
import spawned_groups
import torch
import torch.distributed as dist
import torch.nn.functional as F
from corpus import assert_tree_equal
from spawned_groups import WORLD_SIZES
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Subset,
    TensorDataset,
)

import treegather as tg
import treegather.distributed as tgd
from treegather._caches import reference_only
from treegather.benchmarks import evaluation
from treegather.benchmarks.distributed import counting

LOADER_WORKERS = True  # (spawned_groups: the ranks' fork servers import this module)
GROUP_DEADLINE_S = 90.0  # the checks below, in one group
N = 11  # samples: uneven over 2 and 3 ranks, so DistributedSampler pads
LAYOUT = tg.by_path({"names": tg.cat_items(), "loss": tg.mean()})


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.arange(N), torch.randn(N, 4, generator=g))


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _outputs(net: torch.nn.Module, ids: torch.Tensor, x: torch.Tensor) -> dict[str, Any]:
    with torch.no_grad():
        logits = net(x)
    return {
        "logits": logits,
        "ids": ids,
        "names": [f"s{int(i)}" for i in ids],
        "loss": F.cross_entropy(logits, ids % 3),
    }


def _reference(indices: list[int]) -> dict[str, Any]:
    """One process evaluating ``indices`` (in index order) at once."""
    ids, x = _dataset().tensors
    picked = torch.tensor(sorted(set(indices)))
    out = _outputs(_net(), ids[picked], x[picked])
    return {"logits": out["logits"], "ids": out["ids"], "names": out["names"]}


def _dropped(world: int, rank: int, shuffle: bool, sampler_drop: bool, loader_drop: bool) -> int:
    """How many samples the loader of these settings (its DistributedSampler over the dataset,
    batches of 2) drops on ``rank``: the dataset's samples that no rank's sampler gives, and
    the indices its sampler gives this rank that its batches leave out."""

    def sampler(r: int, drop: bool) -> DistributedSampler[Any]:
        return DistributedSampler(_dataset(), world, r, shuffle, 5, drop)

    every = {i for r in range(world) for i in sampler(r, False)}
    kept = {i for r in range(world) for i in sampler(r, sampler_drop)}
    mine = sampler(rank, sampler_drop)
    batches = DataLoader(_dataset(), batch_size=2, sampler=mine, drop_last=loader_drop)
    return len(every - kept) + len(mine) - sum(map(len, batches.batch_sampler))


def _evaluate(loader: Any, col: tgd.Collector) -> tuple[list[int], list[float], list[int]]:
    """Add every batch; return the indices seen, and each batch's loss and rows."""
    net = _net()
    seen, losses, rows = [], [], []
    for ids, x in loader:
        out = _outputs(net, ids, x)
        col.add(out)
        seen += ids.tolist()
        losses.append(float(out["loss"]))
        rows.append(len(ids))
    return seen, losses, rows


# ------------------------------------------------------------------------- one process


def test_indices_put_rows_in_dataset_order_each_once() -> None:
    col = tgd.Collector()
    col.add({"x": torch.tensor([[3.0], [1.0]]), "tag": ["c", "a"]}, indices=[3, 1])
    col.add({"x": torch.tensor([[2.0], [1.0]]), "tag": ["b", "a"]}, indices=torch.tensor([2, 1]))
    out = col.all_gather({"x": tg.cat(), "tag": tg.cat_items()})
    assert out["x"].flatten().tolist() == [1.0, 2.0, 3.0]
    assert out["tag"] == ["a", "b", "c"]
    assert col.indices is not None and col.indices.tolist() == [1, 2, 3]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("sampler_drop_last", [False, True])
@pytest.mark.parametrize("loader_drop_last", [False, True])
def test_one_process_with_a_sampler_equals_the_reference(
    shuffle: bool, sampler_drop_last: bool, loader_drop_last: bool
) -> None:
    ds = _dataset()
    sampler = DistributedSampler(
        ds, num_replicas=2, rank=1, shuffle=shuffle, drop_last=sampler_drop_last, seed=5
    )
    sampler.set_epoch(3)
    loader = DataLoader(ds, batch_size=2, sampler=sampler, drop_last=loader_drop_last)
    col = tgd.Collector(loader)  # (its batch sampler: the loader's drop_last applied)
    seen, losses, rows = _evaluate(loader, col)
    dropped = _dropped(2, 1, shuffle, sampler_drop_last, loader_drop_last)
    if dropped:  # a loader that drops samples has not seen the dataset: told, unless partial
        with pytest.raises(tg.BatchSizeError, match=rf"its loader drops {dropped} sample"):
            col.all_gather(LAYOUT)
        col.reset()
        seen, losses, rows = _evaluate(loader, col)
    out = col.all_gather(LAYOUT, partial=bool(dropped))
    want = _reference(seen)
    assert out["ids"].tolist() == sorted(set(seen))
    assert col.indices is not None and col.indices.tolist() == sorted(set(seen))
    assert torch.allclose(out["logits"], want["logits"])
    assert out["names"] == want["names"]
    # A per-batch value: the mean of every batch's loss, weighted by its rows.
    expected = sum(lo * r for lo, r in zip(losses, rows)) / sum(rows)
    assert out["loss"].item() == pytest.approx(expected, rel=1e-6)


def test_a_dataloader_means_its_sampler_and_pad_is_per_sample() -> None:
    ds = _dataset()
    loader = DataLoader(ds, batch_size=4, shuffle=False)
    col = tgd.Collector(loader)
    for ids, _ in loader:  # variable-length tokens per batch: padded per sample
        tokens = torch.arange(len(ids) * (len(ids) + 1)).view(len(ids), len(ids) + 1)
        col.add({"tokens": tokens, "n": torch.tensor(len(ids))})
    out = col.all_gather({"tokens": tg.pad(0, fill=-1), "n": tg.as_list()})
    assert out["tokens"].shape == (N, 5)
    assert out["tokens"][-1].tolist() == [8, 9, 10, 11, -1]  # the last batch: 3 rows of 4
    assert out["n"] == [torch.tensor(4), torch.tensor(4), torch.tensor(3)]  # one value per add


def test_device_keeps_detached_copies_there() -> None:
    col = tgd.Collector(device="cpu")
    x = torch.ones(2, 2, requires_grad=True)
    col.add({"x": x * 2}, indices=[0, 1])
    out = col.all_gather()
    assert not out["x"].requires_grad and out["x"].device.type == "cpu"


def test_errors_name_the_add_and_the_path() -> None:
    col = tgd.Collector(range(3))
    col.add({"a": torch.zeros(2), "b": torch.zeros(3, 1)})
    with pytest.raises(
        tg.BatchSizeError, match=r"add #0: per-sample leaves disagree.*outputs\['a'\]"
    ):
        col.all_gather()
    col = tgd.Collector(range(3))
    col.add({"a": torch.zeros(2)})
    col.add({"a": torch.zeros(2)})
    with pytest.raises(
        tg.BatchSizeError, match=r"add #1: 2 row\(s\), but the sampler has 1 of its 3"
    ):
        col.all_gather()
    col = tgd.Collector()
    col.add({"a": torch.zeros(2)})
    with pytest.raises(
        tg.BatchSizeError, match="no indices=, and no loader observed or sampler given"
    ):
        col.all_gather()
    col = tgd.Collector()
    col.add({"a": torch.zeros(2)}, indices=[0, 1])
    col.add({"a": torch.zeros(2), "b": 1}, indices=[2, 3])
    with pytest.raises(tg.StructureMismatchError, match="add #1 has another structure"):
        col.all_gather()
    col = tgd.Collector()
    col.add({"a": torch.zeros(2)}, indices=[0])
    with pytest.raises(tg.BatchSizeError, match=r"add #0: indices= has 1 index\(es\) for 2 row"):
        col.all_gather()


def test_exchange_then_add_needs_reset() -> None:
    col = tgd.Collector()
    col.add({"a": torch.zeros(1)}, indices=[0])
    col.all_gather()
    with pytest.raises(tg.StateError, match="call reset"):
        col.add({"a": torch.zeros(1)}, indices=[1])
    with pytest.raises(tg.StateError, match="exchanged twice"):
        col.all_gather()
    col.reset()
    col.add({"a": torch.ones(1)}, indices=[5])
    assert col.gather(dst=0)["a"].tolist() == [1.0]
    assert isinstance(tg.StateError("x"), RuntimeError)


def test_nothing_added_gives_none() -> None:
    col = tgd.Collector()
    assert col.all_gather() is None
    assert col.indices is not None and col.indices.numel() == 0


def test_add_keeps_what_it_was_given_under_no_grad() -> None:
    """No communication, no flatten and no copy in add under no_grad (without device=)."""
    col = tgd.Collector(range(1000))
    outputs = {"x": torch.zeros(4, 3)}
    with torch.no_grad():
        col.add(outputs)
    assert col._adds[0][0] is outputs
    col.add({"x": torch.zeros(2, 3, requires_grad=True) * 2})  # grad mode: detached
    assert not col._adds[1][0]["x"].requires_grad


def test_add_with_device_moves_only_what_needs_it() -> None:
    """device=: outputs already there and needing no grad are kept as given; with a tensor
    that requires grad, that one is detached and the others kept."""
    col = tgd.Collector(device="cpu")
    there = {"x": torch.zeros(2, 3), "names": ["a", "b"]}
    col.add(there, indices=[0, 1])
    assert col._adds[0][0] is there
    x = torch.ones(2, 3, requires_grad=True)
    kept = torch.zeros(2)
    col.add({"x": x * 2, "k": kept}, indices=[2, 3])
    added = col._adds[1][0]
    assert not added["x"].requires_grad and added["k"] is kept


@pytest.mark.parametrize(
    "outputs",
    [
        {"a": {"x": torch.ones(2, requires_grad=True) * 2}},  # nested
        {"l": [torch.ones(1, requires_grad=True) * 2, "s"]},  # inside a list
        {"p": torch.nn.Parameter(torch.ones(2))},  # a tensor subclass
        {"t": (torch.ones(2, requires_grad=True) * 2,), "n": None},
    ],
    ids=["nested", "in_a_list", "parameter", "in_a_tuple"],
)
def test_add_detaches_what_needs_it_wherever_it_is(outputs: dict[str, Any]) -> None:
    """A dict of tensors and plain lists is told settled without flattening; anything else
    (a nested node, a tensor in a list, a Parameter) is flattened and its tensors detached."""
    col = tgd.Collector(device="cpu")
    col.add(outputs, indices=[0, 1])
    added = col._adds[0][0]
    assert added is not outputs
    leaves = [
        x for x in optree.tree_leaves(added, namespace="treegather") if isinstance(x, torch.Tensor)
    ]
    assert leaves and not any(x.requires_grad for x in leaves)


def test_add_keeps_plain_outputs_as_given() -> None:
    col = tgd.Collector(device="cpu")
    plain = {"x": torch.zeros(2), "n": 3, "f": 0.5, "s": "a", "none": None, "l": ["a", 1, None]}
    col.add(plain, indices=[0, 1])
    assert col._adds[0][0] is plain


# ------------------------------------------------------------------ where rows come from


def _observed(loader: Any, col: tgd.Collector | None = None, stop: int = -1) -> tgd.Collector:
    col = col or tgd.Collector()
    for step, (ids, x) in enumerate(col.observe(loader)):
        col.add({"ids": ids, "x": x})
        if step == stop:
            break
    return col


class _OwnIterator(DataLoader):  # type: ignore[type-arg]
    """A DataLoader subclass that makes its batches its own way."""

    def __iter__(self) -> Any:
        return iter([(torch.tensor([0]), torch.zeros(1, 4))])


class _Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        return iter([(0, torch.zeros(4))])


@pytest.mark.parametrize(
    "loader, fragment",
    [
        (DataLoader(_Stream(), batch_size=2), "IterableDataset has no sampler"),
        ([(torch.tensor([0]), torch.zeros(1, 4))], "needs a torch DataLoader"),
        (_OwnIterator(_dataset()), "needs a torch DataLoader"),
        (DataLoader(_dataset(), num_workers=2, in_order=False), "in_order=False"),
    ],
    ids=["iterable_dataset", "plain_iterable", "own_iterator", "in_order_false"],
)
def test_observe_refuses_what_it_cannot_observe(loader: Any, fragment: str) -> None:
    col = tgd.Collector()
    with pytest.raises(tg.ArgumentTypeError, match=fragment) as info:
        col.observe(loader)  # at once: nothing iterated
    assert "indices=" in str(info.value)
    col.add({"ids": torch.tensor([0])}, indices=[0])  # the Collector is still usable
    assert col.all_gather()["ids"].tolist() == [0]


@pytest.mark.parametrize(
    "make",
    [
        lambda ds: DataLoader(ds, shuffle=True, generator=torch.Generator().manual_seed(0)),
        lambda ds: RandomSampler(ds, generator=torch.Generator().manual_seed(0)),
        lambda ds: DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 2, False)),
    ],
    ids=["shuffled_loader", "random_sampler", "batch_sampler_over_random"],
)
def test_a_sampler_that_cannot_be_read_again_is_refused(make: Callable[[Any], Any]) -> None:
    source = make(_dataset())
    state = _generator_state(source)
    with pytest.raises(tg.ArgumentTypeError, match=r"col\.observe\(loader\).*indices=") as info:
        tgd.Collector(source)
    assert "RandomSampler" in str(info.value)
    assert _generator_state(source) == state  # nothing was drawn


def _generator_state(source: Any) -> Any:
    sampler = getattr(source, "batch_sampler", None) or getattr(source, "sampler", source)
    sampler = getattr(sampler, "sampler", sampler)
    g = getattr(sampler, "generator", None)
    return None if g is None else g.get_state().tolist()


@pytest.mark.parametrize("persistent", [False, True])
def test_observed_workers_yield_what_the_loop_alone_yields(persistent: bool) -> None:
    """Two epochs of a seeded shuffle over 2 workers (new ones each epoch, or persistent):
    the batches and the generator's state as without a Collector, every row its own sample."""

    def loader() -> DataLoader:  # type: ignore[type-arg]
        g = torch.Generator().manual_seed(4)
        return DataLoader(
            _dataset(),
            batch_size=3,
            shuffle=True,
            generator=g,
            num_workers=2,
            persistent_workers=persistent,
        )

    alone, observed = loader(), loader()
    for _ in range(2):
        want = [ids.tolist() for ids, _ in alone]
        col, got = tgd.Collector(), []
        for ids, x in col.observe(observed):
            got.append(ids.tolist())
            col.add({"ids": ids, "x": x})
        out = col.all_gather()
        assert got == want
        assert out["ids"].tolist() == col.indices.tolist() == list(range(N))
        assert torch.equal(out["x"], _dataset().tensors[1])
    assert torch.equal(alone.generator.get_state(), observed.generator.get_state())
    if persistent:  # the loader's own iterator holds its own sampler again
        assert observed._iterator._index_sampler is observed.batch_sampler


def test_a_batch_sampler_loader_means_its_batch_sampler() -> None:
    ds = _dataset()
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=2)
    loader = DataLoader(ds, batch_sampler=BatchSampler(sampler, 3, drop_last=False))
    for col in (tgd.Collector(loader), None):  # the plain loop, and observed
        if col is None:
            col = _observed(loader)
        else:
            for ids, x in loader:
                col.add({"ids": ids, "x": x})
        out = col.all_gather()
        assert out["ids"].tolist() == sorted(sampler) == col.indices.tolist()


def test_a_loop_that_stops_early_is_an_error_unless_partial() -> None:
    loader = DataLoader(_dataset(), batch_size=3)
    with pytest.raises(
        tg.BatchSizeError,
        match=r"stopped early \(yielded 2 of its loader's 4 batch\(es\), added 6 of their 6 row",
    ):
        _observed(loader, stop=1).all_gather()
    col = _observed(loader, stop=1)
    out = col.all_gather(partial=True)
    assert out["ids"].tolist() == col.indices.tolist() == list(range(6))
    col = tgd.Collector(loader)  # the plain loop: the sampler's rows
    for ids, x in itertools.islice(loader, 2):
        col.add({"ids": ids, "x": x})
    with pytest.raises(tg.BatchSizeError, match=r"added 6 of the 11 row\(s\) its sampler holds"):
        col.all_gather()


def test_a_loop_that_never_asks_for_the_end_says_so() -> None:
    # zip() with a shorter iterable first (a step count) stops before the loader ends: the
    # loop received every batch len(loader) counts, but the loader never said it had ended
    loader = DataLoader(_dataset(), batch_size=3)
    col = tgd.Collector()
    for _, (ids, x) in zip(range(len(loader)), col.observe(loader)):
        col.add({"ids": ids, "x": x})
    with pytest.raises(tg.BatchSizeError, match=r"4 of its loader's 4 batch.*zip\(\)"):
        col.all_gather()
    col = tgd.Collector()
    for (ids, x), _ in zip(col.observe(loader), range(len(loader))):  # (observed first: ends)
        col.add({"ids": ids, "x": x})
    assert col.all_gather()["ids"].tolist() == col.indices.tolist() == list(range(N))


def test_a_batch_added_twice_or_too_early_is_an_error() -> None:
    loader = DataLoader(_dataset(), batch_size=4)
    col = tgd.Collector()
    for ids, _ in col.observe(loader):
        col.add({"ids": ids})
        col.add({"ids": ids})  # twice: the next batch's rows are not in yet
    with pytest.raises(tg.BatchSizeError, match=r"add #1: 4 row\(s\), but when it was made"):
        col.all_gather()
    col = tgd.Collector()
    batches = iter(col.observe(loader))
    first = next(batches)[0]
    col.add({"ids": first})
    col.add({"ids": first})  # the second batch is not received yet
    with pytest.raises(tg.BatchSizeError, match="the loader has 0 of its 4 indices left"):
        col.all_gather(partial=True)


def test_batches_added_after_the_loop_take_the_loop_s_rows() -> None:
    """Adds made after the loop (outputs kept, then added) take the batches in order."""
    g = torch.Generator().manual_seed(1)
    loader = DataLoader(_dataset(), batch_size=4, shuffle=True, generator=g)
    col, kept = tgd.Collector(), []
    for ids, x in col.observe(loader):
        kept.append({"ids": ids, "x": x})
    for outputs in kept:
        col.add(outputs)
    out = col.all_gather()
    assert out["ids"].tolist() == col.indices.tolist() == list(range(N))
    assert torch.equal(out["x"], _dataset().tensors[1])


@pytest.mark.parametrize(
    "bad, fragment",
    [
        (torch.tensor([True, False]), "got torch.bool"),
        ([0.0, 1.0], "got torch.float32"),
        (torch.tensor([1.5, 2.0]), "got torch.float32"),
        ([3, -1], "got -1"),
        (["a", "b"], "must be dataset indices"),
        ([2**64, 1], "must be dataset indices.*Overflow"),
        (torch.tensor([1, 2], dtype=torch.int32, device="meta"), "readable on the CPU: meta"),
    ],
    ids=["bool_mask", "float_list", "float_tensor", "negative", "strings", "past_int64", "meta"],
)
def test_indices_must_be_dataset_indices(bad: Any, fragment: str) -> None:
    col = tgd.Collector()
    col.add({"x": torch.zeros(2)}, indices=bad)
    with pytest.raises(tg.ArgumentTypeError, match=fragment) as info:
        col.all_gather()
    assert "add #0: indices=" in str(info.value)


def test_indices_of_any_integer_kind_are_taken() -> None:
    col = tgd.Collector()
    col.add({"x": torch.tensor([1.0, 2.0])}, indices=torch.tensor([5, 3], dtype=torch.int32))
    col.add({"x": torch.tensor([3.0])}, indices=(4,))
    col.add({"x": torch.tensor([4.0])}, indices=range(7, 8))
    assert col.all_gather()["x"].tolist() == [2.0, 3.0, 1.0, 4.0]
    assert col.indices.tolist() == [3, 4, 5, 7]


def test_indices_beside_the_loader_s_rows_must_be_the_same_rows() -> None:
    loader = DataLoader(_dataset(), batch_size=4)
    col = tgd.Collector()
    for ids, _ in col.observe(loader):
        col.add({"ids": ids}, indices=ids if int(ids[0]) == 4 else None)  # the same: fine
    assert col.all_gather()["ids"].tolist() == list(range(N))
    col = tgd.Collector()
    for ids, _ in col.observe(loader):
        col.add({"ids": ids}, indices=ids + 1 if int(ids[0]) == 4 else None)  # others: refused
    with pytest.raises(tg.BatchSizeError, match=r"add #1: indices= \[5, 6, 7, 8\] are not"):
        col.all_gather()


def test_observe_is_once_per_evaluation() -> None:
    loader = DataLoader(_dataset(), batch_size=4)
    col = tgd.Collector()
    col.add({"ids": torch.tensor([0])}, indices=[0])
    with pytest.raises(tg.StateError, match="observe one loop per evaluation"):
        col.observe(loader)
    col.reset()
    col = _observed(loader, col)
    with pytest.raises(tg.StateError):
        col.observe(loader)
    col.all_gather()
    with pytest.raises(tg.StateError, match=r"Collector\.observe after all_gather"):
        col.observe(loader)
    col.reset()
    assert _observed(loader, col).all_gather()["ids"].tolist() == list(range(N))


def test_the_batch_dim_however_written_is_per_sample() -> None:
    col = tgd.Collector()
    col.add({"a": torch.tensor([[3.0, 3.0], [1.0, 1.0]]), "b": torch.tensor([[3], [1]])}, [3, 1])
    col.add({"a": torch.tensor([[2.0, 2.0]]), "b": torch.tensor([[2, 2]])}, [2])
    out = col.all_gather({"a": tg.cat(-2), "b": tg.pad(-2, fill=-1)})
    assert out["a"][:, 0].tolist() == [1.0, 2.0, 3.0]
    assert out["b"].tolist() == [[1, -1], [2, 2], [3, -1]]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference_only"])
@pytest.mark.parametrize(
    ("dtype", "fill", "dim"),
    [
        (torch.float16, 70000.0, 0),
        (torch.bfloat16, 1e39, -2),
        (torch.float32, 1e39, 0),
        (torch.uint8, -1, 0),
        (torch.int32, float("nan"), -2),
        (torch.float32, 1j, 0),
    ],
)
def test_a_pad_fill_the_dtype_cannot_hold_names_the_leaf(
    dtype: torch.dtype, fill: Any, dim: int, fast: bool
) -> None:
    col = tgd.Collector()
    col.add({"x": torch.zeros(2, 3, dtype=dtype), "y": torch.zeros(2)}, indices=[0, 1])
    col.add({"x": torch.zeros(1, 2, dtype=dtype), "y": torch.zeros(1)}, indices=[2])
    with contextlib.nullcontext() if fast else reference_only():
        with pytest.raises(tg.LeafTypeError, match=r"outputs\['x'\]: pad\(.*cannot be stored in"):
            col.all_gather(tg.by_path({"x": tg.pad(dim, fill=fill)}))


def test_a_list_with_no_rule_is_an_error_naming_both_rules() -> None:
    col = tgd.Collector()
    col.add({"x": torch.zeros(2), "names": ["a", "b"]}, indices=[0, 1])
    col.add({"x": torch.zeros(2), "names": ["c", "d"]}, indices=[2, 3])
    with pytest.raises(tg.LayoutError, match=r"outputs\['names'\]: a list of 2") as info:
        col.all_gather()
    assert "tg.cat_items()" in str(info.value) and "tg.as_list()" in str(info.value)
    col.reset()
    col.add({"x": torch.zeros(2), "names": ["a", "b"]}, indices=[1, 0])
    assert col.all_gather(tg.by_path({"names": tg.cat_items()}))["names"] == ["b", "a"]


def test_adds_racing_the_exchange_land_in_it_or_raise() -> None:
    for _ in range(20):
        col, landed, started = tgd.Collector(), [], threading.Event()

        def adder(
            col: tgd.Collector = col, landed: list[int] = landed, started: Any = started
        ) -> None:
            for i in range(10_000):
                try:
                    col.add({"x": torch.tensor([float(i)])}, indices=[i])
                except tg.StateError:
                    return
                landed.append(i)
                started.set()

        thread = threading.Thread(target=adder)
        thread.start()
        started.wait()
        out = col.all_gather()
        thread.join()
        assert out["x"].tolist() == [float(i) for i in landed]
        assert col.indices.tolist() == landed


def test_the_exchange_lets_go_of_the_adds() -> None:
    col = tgd.Collector()
    added = [torch.randn(3, 2) for _ in range(4)]
    alive = [weakref.ref(t) for t in added]
    for k, t in enumerate(added):
        col.add({"x": t, "loss": t.sum()}, indices=[3 * k, 3 * k + 1, 3 * k + 2])
    del added, t
    out = col.all_gather()
    assert out["x"].shape == (12, 2)
    del out
    gc.collect()
    assert [r() for r in alive] == [None] * 4


def test_reference_only_joins_the_adds_with_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the one fast-path switch, Collector joins its adds with treegather.gather (the
    definition) instead of its own concatenation; the results are the same."""
    import treegather._gather

    calls: list[int] = []
    real = treegather._gather.gather

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(treegather._gather, "gather", spy)

    def collect() -> Any:
        col = tgd.Collector()
        col.add({"x": torch.arange(4.0).view(2, 2), "tag": ["b", "a"]}, indices=[1, 0])
        col.add({"x": torch.ones(1, 2), "tag": ["c"]}, indices=[2])
        return col.all_gather({"x": tg.cat(), "tag": tg.cat_items()})

    fast = collect()
    assert calls == []  # the Collector's own join
    with reference_only():
        reference = collect()
    assert calls  # the definition
    assert torch.equal(fast["x"], reference["x"])
    assert fast["tag"] == reference["tag"] == ["a", "b", "c"]


def _first_seen(parts: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """The definition of the dataset order: a stable sort, each index's first row kept."""
    idx = torch.cat(parts)
    ordered, perm = torch.sort(idx, stable=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    keep[1:] = ordered[1:] != ordered[:-1]
    return perm[keep].tolist(), ordered[keep].tolist()


def _check_order(parts: list[torch.Tensor]) -> None:
    """dataset_order equals the definition, and placed picks the rows it says."""
    from treegather.distributed.samples import dataset_order, placed

    order = dataset_order(parts)
    perm, kept = _first_seen(parts)
    assert order.kept.tolist() == kept, parts
    at = order.positions()
    assert (at.tolist() if at is not None else list(range(len(kept)))) == perm
    rows = [torch.randn(p.numel(), 2) for p in parts]
    got = placed(rows, order)
    assert torch.equal(got, torch.cat(rows)[perm]) and all(
        got.data_ptr() != t.data_ptr() for t in rows
    )
    items = [[f"{r}:{i}" for i in range(p.numel())] for r, p in enumerate(parts)]
    flat = [x for part in items for x in part]
    assert placed(items, order) == [flat[i] for i in perm]


def test_dataset_order_equals_a_stable_sort() -> None:
    """The order (a scatter for dense indices, a sort otherwise) equals the stable-sort
    definition, and the rows placed by it are the ones it names: on every sampler
    configuration cut at random points, and on random small index lists."""
    rng = random.Random(0)
    sizes = [*range(1, 24), 40, 67, 101]
    for n, world, shuffle, drop in itertools.product(sizes, (1, 2, 3, 4), (0, 1), (0, 1)):
        parts = []
        for r in range(world):
            got = list(DistributedSampler(range(n), world, r, bool(shuffle), 3, bool(drop)))
            cut = rng.randint(0, len(got)) if rng.random() < 0.3 else len(got)
            parts.append(torch.tensor(got[:cut], dtype=torch.int64))
        if sum(p.numel() for p in parts) > 1:
            _check_order(parts)
    for _ in range(3000):
        parts = [
            torch.tensor([rng.randint(0, 7) for _ in range(rng.randint(0, 5))], dtype=torch.int64)
            for _ in range(rng.randint(1, 4))
        ]
        if sum(p.numel() for p in parts):
            _check_order(parts)
    _check_order([torch.tensor([10**12, 5, 10**12 - 1])])  # sparse indices: the sort


# ------------------------------------------------------------------------ across ranks


@spawned_groups.register("eval.collector", budget_s=GROUP_DEADLINE_S / 2)
def _collector_checks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ds = _dataset()
    for shuffle in (False, True):
        for sampler_drop in (False, True):
            for loader_drop in (False, True):
                sampler = DistributedSampler(ds, shuffle=shuffle, drop_last=sampler_drop, seed=7)
                sampler.set_epoch(2)
                loader = DataLoader(ds, batch_size=2, sampler=sampler, drop_last=loader_drop)
                col = tgd.Collector(loader)
                seen, losses, rows = _evaluate(loader, col)
                key = (shuffle, sampler_drop, loader_drop)
                # a loader that drops samples: an error on every rank, unless partial=True
                dropped = _dropped(world, rank, shuffle, sampler_drop, loader_drop)
                told = _capture(lambda c=col: c.all_gather(LAYOUT))
                out[("told", key)] = (told[:3], dropped)
                col.reset()
                _evaluate(loader, col)
                got = col.all_gather(LAYOUT, partial=sampler_drop or loader_drop)
                out[("all", key)] = (got, col.indices, seen, losses, rows)
                col.reset()
                _evaluate(loader, col)
                out[("dst", key)] = col.gather(
                    LAYOUT, dst=world - 1, partial=sampler_drop or loader_drop
                )
    # Errors where one rank differs: raised on every rank, promptly.
    col = tgd.Collector()
    n = 3 if rank == 1 else 2
    col.add({"a": torch.zeros(n), "b": torch.zeros(2)}, indices=list(range(n)))
    out["rows_on_one_rank"] = _capture(lambda: col.all_gather())
    col = tgd.Collector()
    col.add({"a": torch.zeros(2)} if rank else {"a": torch.zeros(2, dtype=torch.int64)}, [0, 1])
    out["dtype_on_one_rank"] = _capture(lambda: col.gather(dst=0))
    col = tgd.Collector()
    if rank != 1:  # rank 1 has nothing: the others' samples come back
        col.add({"a": torch.full((1,), float(rank))}, indices=[rank])
    out["empty_rank"] = (col.all_gather(), col.indices)
    # The final exchange costs what one all_gather of a tree of its size costs.
    col = tgd.Collector()
    for i in range(4):
        col.add({"a": torch.ones(2, 3) * i}, indices=[4 * rank + i, 100 + 4 * rank + i])
    with counting() as calls:
        col.all_gather()
    with counting() as plain:
        tgd.all_gather(((torch.zeros(8), torch.zeros(4), {"a": torch.ones(8, 3)}), 1), tg.as_list())
    out["collectives"] = (list(calls), list(plain))
    return out


class Label(enum.StrEnum):
    """A ``str`` subclass as a per-sample item: it must arrive as itself, on every rank."""

    CAT = "cat"
    DOG = "dog"


def _rows(rank: int, n: int, base: int = 0) -> list[int]:
    return [base + 10 * rank + i for i in range(n)]


# Per case: each rank's adds ((outputs, indices) for a rank and a world size) and the layout.
# Every case runs through the fast layer and the definition (reference_only), whose results
# must be equal; FAST says which cases the fast layer takes whole (the others fall back).
FAST_CASES: dict[str, tuple[Callable[[int, int], list[tuple[Any, list[int]]]], Any]] = {
    "tensors_and_strings": (
        lambda r, w: [
            ({"x": torch.full((2, 3), float(r)), "s": [f"r{r}a", f"r{r}b"]}, _rows(r, 2)),
            ({"x": torch.ones(1, 3), "s": ["é\u2603"]}, _rows(r, 1, 5)),
        ],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "separator_in_a_string": (  # the UTF-8 form cannot hold it: pickled instead
        lambda r, w: [({"x": torch.zeros(2), "s": ["a\x00b", str(r)]}, _rows(r, 2))],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "lone_surrogates": (  # file names os.fsdecode made of undecodable bytes: not UTF-8
        lambda r, w: [({"x": torch.zeros(2), "s": [f"f{r}\udcff", "ok"]}, _rows(r, 2))],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "str_subclass_items": (
        lambda r, w: [({"x": torch.zeros(2), "s": [Label.CAT, Label.DOG]}, _rows(r, 2))],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "other_items": (
        lambda r, w: [({"x": torch.zeros(3), "s": [r, (r, "t"), None]}, _rows(r, 3))],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "tensor_items": (
        lambda r, w: [
            ({"x": torch.zeros(2), "s": [torch.ones(1) * r, torch.zeros(2)]}, _rows(r, 2))
        ],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "dtypes": (
        lambda r, w: [
            (
                {
                    "h": torch.full((2, 2), r + 0.5, dtype=torch.float16),
                    "b": torch.full((2,), r + 0.25, dtype=torch.bfloat16),
                    "m": torch.tensor([True, bool(r)]),
                    "c": torch.full((2, 1), complex(r, 1), dtype=torch.complex64),
                    "i": torch.full((2, 3), r, dtype=torch.int8),
                },
                _rows(r, 2),
            )
        ],
        None,
    ),
    "per_add_values": (  # a batch loss and a stacked per-batch vector, one value per add
        lambda r, w: [
            (
                {
                    "x": torch.ones(n, 2) * r,
                    "loss": torch.tensor(r + n / 2),
                    "v": torch.arange(3.0) * n,
                },
                _rows(r, n, 3 * n),
            )
            for n in (1, 2)
        ],
        tg.by_path({"loss": tg.mean(), "v": tg.stack()}),
    ),
    "empty_add_and_nested": (
        lambda r, w: [
            ({"a": {"x": torch.zeros(0, 2)}, "t": ([], torch.zeros(0))}, []),
            ({"a": {"x": torch.ones(2, 2) * r}, "t": (["p", "q"], torch.arange(2.0))}, _rows(r, 2)),
        ],
        tg.by_path({"t.0": tg.cat_items()}),
    ),
    "pad_uneven_between_ranks": (  # trailing shapes differ per rank: the definition pads
        lambda r, w: [({"x": torch.ones(2, r + 1)}, _rows(r, 2))],
        {"x": tg.pad(0)},
    ),
    "duplicates_across_ranks": (  # every rank sends index 0: rank 0's row is kept
        lambda r, w: [({"x": torch.full((2,), float(r)), "s": [f"{r}", "z"]}, [0, 100 + r])],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "larger_than_the_inline_area": (  # over MAX_INLINE per rank: one more all-gather
        lambda r, w: [
            (
                {"x": torch.full((160, 1024), float(r)), "s": ["q"] * 160},
                [1000 * i + 200 * r + j for j in range(160)],
            )
            for i in range(2)
        ],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "shuffled_indices": (
        lambda r, w: [
            (
                {"x": torch.arange(3.0) + r, "s": list("abc")},
                [(7 * (r + 3 * i)) % 31 for i in range(3)],
            )
        ],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "key_order_differs_between_ranks": (  # equal structures, keys in another order
        lambda r, w: [
            (
                {"x": torch.full((2,), float(r)), "s": [f"{r}a", f"{r}b"]}
                if r % 2
                else {"s": [f"{r}a", f"{r}b"], "x": torch.full((2,), float(r))},
                _rows(r, 2),
            )
        ],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "key_order_alternates_on_one_rank": (  # rank 1's columns stop: its adds are joined by
        # the definition, rank 0's by its columns; the payloads are the same, so the fast layer
        lambda r, w: [
            (
                {"s": [f"{r}{i}"], "x": torch.full((1, 2), float(i))}
                if r == 1 and i % 2
                else {"x": torch.full((1, 2), float(i)), "s": [f"{r}{i}"]},
                [10 * r + i],
            )
            for i in range(4)
        ],
        tg.by_path({"s": tg.cat_items()}),
    ),
    "long_runs_and_padding": (  # each rank's indices a run of 20, then 0
        lambda r, w: [
            (
                {"x": torch.arange(21.0) + 100 * r, "s": [f"{r}:{i}" for i in range(21)]},
                [*range(r, r + 20 * w, w), 0],
            )
        ],
        tg.by_path({"s": tg.cat_items()}),
    ),
}
# The full exchange takes these: the ranks' payloads differ in their trailing shapes.
SLOW = {"pad_uneven_between_ranks"}


def _collected(adds: list[tuple[Any, list[int]]], layout: Any, dst: int | None = None) -> Any:
    col = tgd.Collector()
    for outputs, indices in adds:
        col.add(outputs, indices=indices)
    got = col.all_gather(layout) if dst is None else col.gather(layout, dst=dst)
    return got, col.indices


class _Unlisted(list):  # type: ignore[type-arg]
    """A list that refuses to be iterated."""

    def __iter__(self) -> Any:
        raise RuntimeError("cannot iterate these names")


def _all_gathered(col: tgd.Collector, layout: Any) -> tuple[Any, Any]:
    return col.all_gather(layout), col.indices


@spawned_groups.register("eval.fast", budget_s=GROUP_DEADLINE_S / 2)
def _fast_layer_checks(rank: int, world: int) -> dict[str, Any]:
    """Each case through the fast paths (twice: the second time with the wire plan) and
    through the definition: results and collectives."""
    out: dict[str, Any] = {}
    for name, (adds, layout) in FAST_CASES.items():
        for mode in ("first", "fast", "reference"):
            with reference_only() if mode == "reference" else contextlib.nullcontext():
                with counting() as calls:
                    got = _capture(functools.partial(_collected, adds(rank, world), layout))
            out[(name, mode)] = got
            out[(name, mode, "collectives")] = len(calls)
            # gather: dst gets the result (what the combine raises reaches every rank)
            got = _capture(functools.partial(_collected, adds(rank, world), layout, world - 1))
            out[(name, "dst")] = got
    # What the combine raises (per-batch vectors that cannot stack: one rank's are longer)
    # reaches every rank, whether the payloads came with the rows or went to dst alone.
    for size in ("small", "large"):
        rows = 4 if size == "small" else 320  # 320 rows of 4 KiB: over the inline area
        adds = [
            ({"x": torch.zeros(rows, 1024), "v": torch.zeros(2 + (rank == 1))}, _rows(rank, rows))
        ]
        for how, dst in (("all", None), ("dst", 0)):
            out[("combine_error", size, how)] = _capture(
                functools.partial(_collected, adds, tg.by_path({"v": tg.stack()}), dst)
            )
    # A dst that names no rank, on one rank only: every rank raises.
    col = tgd.Collector()
    col.add({"x": torch.zeros(1)}, indices=[rank])
    out["bad_dst_on_one_rank"] = _capture(lambda: col.gather(dst=world + 5 if rank == 0 else 0))
    # What is not a treegather error, raised on one rank while its adds are joined (a list
    # subclass that cannot be iterated): every rank raises, no hang.
    col = tgd.Collector()
    names = _Unlisted(["a"]) if rank == 0 else ["b"]
    col.add({"x": torch.zeros(1), "s": names}, indices=[rank])
    out["unexpected_on_one_rank"] = _capture(
        functools.partial(col.all_gather, tg.by_path({"s": tg.cat_items()}))
    )
    # One rank exchanges a Collector, the others call all_gather: the same error, no hang.
    col = tgd.Collector()
    col.add({"x": torch.zeros(1)}, indices=[rank])
    out["other_call_on_one_rank"] = _capture(
        lambda: col.all_gather() if rank == 0 else tgd.all_gather({"x": torch.zeros(1)})
    )
    # Under DistributedSampler with at least 16 rows per rank (one run, padding after it).
    for shuffle in (False, True):
        sampler = DistributedSampler(range(53), world, rank, shuffle=shuffle, seed=1)
        order = list(sampler)
        col = tgd.Collector(sampler)
        for start in range(0, len(order), 8):
            idx = order[start : start + 8]
            x = torch.tensor(idx, dtype=torch.float32).unsqueeze(1) * 2
            col.add({"x": x, "s": [f"n{i}" for i in idx]})
        layout = tg.by_path({"s": tg.cat_items()})
        out[("sampler_rows", shuffle)] = _capture(functools.partial(_all_gathered, col, layout))
    # A repeated evaluation that fits the group's inline area: one collective.
    for _ in range(2):
        col = tgd.Collector()
        col.add({"x": torch.ones(4, 3), "s": list("abcd")}, indices=_rows(rank, 4))
        with counting() as calls:
            col.all_gather(tg.by_path({"s": tg.cat_items()}))
    out["repeated_collectives"] = list(calls)
    return out


def _tiny_bert() -> Any:
    """A BERT classifier from a tiny config (no download), eager attention (it returns them)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
        attn_implementation="eager",
    )
    return BertForSequenceClassification(config).eval()


HF_SAMPLES = 13  # uneven on 2 ranks: DistributedSampler pads


def _hf_tokens() -> torch.Tensor:
    return torch.randint(0, 50, (HF_SAMPLES, 7), generator=torch.Generator().manual_seed(1))


@spawned_groups.register("eval.hf", budget_s=30)
def _hf_checks(rank: int, world: int) -> Any:
    """A cold BERT's outputs (hidden states, attentions) under DistributedSampler, collected
    in the group of 2 (transformers is slow to import); the second exchange's collectives."""
    if world != 2:
        return None
    model, tokens = _tiny_bert(), _hf_tokens()
    dataset = TensorDataset(tokens, torch.arange(HF_SAMPLES))
    out: dict[str, Any] = {}
    for shuffle in (False, True):
        sampler = DistributedSampler(dataset, shuffle=shuffle, seed=5)
        col = tgd.Collector(sampler)
        with torch.no_grad():
            for x, _ in DataLoader(dataset, batch_size=3, sampler=sampler):
                col.add(model(input_ids=x, output_hidden_states=True, output_attentions=True))
        with counting() as calls:
            got = col.all_gather()
        out[shuffle] = (type(got).__name__, _fields(got), col.indices, len(calls))
    with torch.no_grad():  # one process, every sample at once
        want = model(input_ids=tokens, output_hidden_states=True, output_attentions=True)
    out["one_process"] = (type(want).__name__, _fields(want))
    return out


def _fields(output: Any) -> dict[str, Any]:
    """A ModelOutput's fields as a plain dict (so that the test process need not import
    transformers to read them)."""
    return {k: output[k] for k in ("logits", "hidden_states", "attentions")}


def _clip_loss(img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    img, txt = F.normalize(img, dim=1), F.normalize(txt, dim=1)
    logits = img @ txt.T * 10
    labels = torch.arange(img.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _clip_batches(world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    rows = [3, 2, 4][:world]  # uneven
    xs = [
        torch.randn(b, 5, generator=torch.Generator().manual_seed(10 + r))
        for r, b in enumerate(rows)
    ]
    ys = [
        torch.randn(b, 5, generator=torch.Generator().manual_seed(20 + r))
        for r, b in enumerate(rows)
    ]
    return xs, ys


@spawned_groups.register("eval.sync", budget_s=GROUP_DEADLINE_S / 2)
def _sync_checks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    xs, ys = _clip_batches(world)
    torch.manual_seed(1)
    lin = torch.nn.Linear(5, 6)
    x = xs[rank].clone().requires_grad_(True)
    with counting() as forward:
        emb = tgd.all_gather(
            {"img": lin(x), "txt": lin(ys[rank]), "tag": f"r{rank}"}, sync_grads=True
        )
    loss = _clip_loss(emb["img"], emb["txt"]) * (rank + 1)  # each rank's own loss
    with counting() as backward:
        loss.backward()
    weight = lin.weight.grad.clone()
    dist.all_reduce(weight)  # what DDP would sum (it then divides by the world size)
    out["clip"] = (x.grad, weight, lin.bias.grad.clone(), emb["tag"], list(forward), list(backward))
    with counting() as plain:  # the same call again, without sync_grads
        tgd.all_gather({"img": lin(x), "txt": lin(ys[rank]), "tag": f"r{rank}"})
    out["plain_forward"] = list(plain)
    # Every rule, and a custom callable.
    v = xs[rank][:2].clone().requires_grad_(True)
    for name, rule in SYNC_RULES.items():
        v.grad = None
        value = v[: rank + 1] if name in ("cat", "pad") else v  # uneven rows where allowed
        got = tgd.all_gather(
            {"v": value * (rank + 1)}, {"v": rule}, sync_grads=True, sizes=rank + 1
        )
        _weighted(got["v"]).backward()
        out[("rule", name)] = (got["v"].detach(), v.grad)
    # Without sync_grads the result is detached (of inputs that require grad, it raises in a
    # backward, saying sync_grads=True: tests/test_distributed_grads.py).
    out["detached"] = tgd.all_gather({"v": (v * 2).detach()})["v"].requires_grad
    # One rank asks for sync_grads, another not: the same error on every rank.
    out["sync_on_one_rank"] = _capture(lambda: tgd.all_gather({"v": v * 1}, sync_grads=rank == 0))
    return out


def _norms(values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.stack([t.pow(2).sum() for t in values])


# Every rule sync_grads supports, and a custom callable (the worker and the check share it).
SYNC_RULES: dict[str, Any] = {
    "cat": tg.cat(),
    "stack": tg.stack(),
    "pad": tg.pad(0),
    "mean": tg.mean(),
    "sum": tg.sum(),
    "custom": _norms,
}


def _weighted(t: torch.Tensor) -> torch.Tensor:
    return (t * (torch.arange(t.numel(), dtype=t.dtype).view_as(t) + 1)).sum()


def _capture(fn: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc), traceback.format_exc())


@spawned_groups.register("eval.bench", budget_s=30)
def _benchmark_smoke_run(rank: int, world: int) -> Any:
    """The evaluation benchmark on a small dataset, in the group of 2 (spawning costs more)."""
    if world != 2:
        return None
    return evaluation.measure(301, batch=64, rounds=2, profile=True)


def _early(rank: int, partial: bool) -> tuple[Any, Any]:
    """An observed DistributedSampler loop that rank 1 leaves after one batch."""
    ds = _dataset()
    loader = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, shuffle=True, seed=3))
    col = tgd.Collector()
    for step, (ids, x) in enumerate(col.observe(loader)):
        col.add({"ids": ids, "x": x})
        if rank == 1 and step == 0:
            break  # (a max_eval_steps that one rank reaches)
    return col.all_gather(partial=partial), col.indices


def _one_add(outputs: Any, call: Callable[[tgd.Collector], Any]) -> Any:
    col = tgd.Collector()
    col.add(outputs, indices=[0, 1])
    return call(col)


SUBSET = Subset(_dataset(), [10, 3, 7, 1, 0, 5])  # (the same on every rank)


def _plain(loader: Any) -> Any:
    """The plain loop over ``Collector(loader)`` (a sampler that may be read again)."""
    col = tgd.Collector(loader)
    for ids, x in loader:
        col.add({"ids": ids, "x": x})
    return col.all_gather()


ANSWERS: dict[str, Callable[[int, int], Any]] = {
    "stopped_early": lambda rank, world: _early(rank, False),
    "stopped_early_partial": lambda rank, world: _early(rank, True),
    "layouts_differ": lambda rank, world: _one_add(
        {"x": torch.zeros(2), "s": ["a", "b"]},
        lambda c: c.all_gather({"x": tg.cat(), "s": tg.as_list() if rank else tg.cat_items()}),
    ),
    "partial_differs": lambda rank, world: _one_add(
        {"x": torch.zeros(2)}, lambda c: c.all_gather(partial=rank == 0)
    ),
    "structure_differs": lambda rank, world: _one_add(
        {"x": torch.zeros(2), ("c" if rank else "b"): torch.ones(2)}, lambda c: c.all_gather()
    ),
    "kinds_differ": lambda rank, world: _one_add(
        {"x": torch.zeros(2), "b": torch.ones(2, 1) if rank == 0 else torch.tensor(1.0)},
        lambda c: c.all_gather(),
    ),
    "unpicklable": lambda rank, world: _one_add(
        {"x": torch.zeros(2), "meta": (lambda: 0) if rank == 1 else 0},
        lambda c: c.all_gather(tg.by_path({"meta": tg.as_list()})),
    ),
    "sparse_leaf": lambda rank, world: _one_add(
        {"x": torch.eye(2).to_sparse() if rank == 1 else torch.eye(2)}, lambda c: c.all_gather()
    ),
    # Each rank's own part of the dataset (uneven, and at 3 ranks two of one length), and
    # even shards: indices that restart at 0 on every rank would be taken for padding.
    "datasets_differ": lambda rank, world: _observed(
        DataLoader(Subset(_dataset(), range(rank, N, world)), batch_size=2)
    ).all_gather(),
    "datasets_differ_plain": lambda rank, world: _plain(
        DataLoader(Subset(_dataset(), range(rank, N, world)), batch_size=2)
    ),
    "shards_even": lambda rank, world: _observed(
        DataLoader(Subset(_dataset(), range(rank * 3, rank * 3 + 3)), batch_size=2)
    ).all_gather(),
    "one_subset": lambda rank, world: _observed(
        DataLoader(SUBSET, batch_size=2, sampler=DistributedSampler(SUBSET, shuffle=False))
    ).all_gather(),
    "dst_differs": lambda rank, world: _one_add(
        {"x": torch.zeros(2)}, lambda c: c.gather(dst=0 if rank == 0 else 1)
    ),
    "calls_differ": lambda rank, world: _one_add(
        {"x": torch.zeros(2)}, lambda c: c.all_gather() if rank == 0 else c.gather(dst=0)
    ),
}


@spawned_groups.register("eval.answers", budget_s=20)
def _answer_checks(rank: int, world: int) -> dict[Any, Any]:
    """One answer on every rank: each case as the fast layer and as the definition takes it."""
    out: dict[Any, Any] = {}
    for name, case in ANSWERS.items():
        for mode in ("fast", "reference"):
            with reference_only() if mode == "reference" else contextlib.nullcontext():
                out[(name, mode)] = _capture(functools.partial(case, rank, world))
    return out


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    """Each world size's results of the checks above, from the session's shared group."""
    world = request.param
    results = spawned_groups.results(world, tmp_path_factory)
    return world, [
        {
            "collector": res["eval.collector"],
            "fast": res["eval.fast"],
            "hf": res["eval.hf"],
            "sync": res["eval.sync"],
            "benchmark": res["eval.bench"],
            "answers": res["eval.answers"],
        }
        for res in results
    ]


pytestmark = pytest.mark.distributed


def test_every_sample_once_in_dataset_order(ranks: Any) -> None:
    world, results = ranks
    for key in [(s, d, ld) for s in (False, True) for d in (False, True) for ld in (False, True)]:
        seen = [i for res in results for i in res["collector"][("all", key)][2]]
        losses = [x for res in results for x in res["collector"][("all", key)][3]]
        rows = [x for res in results for x in res["collector"][("all", key)][4]]
        want = _reference(seen)
        for rank, res in enumerate(results):
            got, indices, *_ = res["collector"][("all", key)]
            assert got["ids"].tolist() == sorted(set(seen)), (key, rank)
            assert indices.tolist() == sorted(set(seen))
            assert torch.allclose(got["logits"], want["logits"])
            assert got["names"] == want["names"]
            expected = sum(lo * r for lo, r in zip(losses, rows)) / sum(rows)
            assert got["loss"].item() == pytest.approx(expected, rel=1e-6)
            dst = res["collector"][("dst", key)]
            if rank == world - 1:
                assert dst["ids"].tolist() == sorted(set(seen))
            else:
                assert dst is None
        if not key[1] and not key[2]:  # nothing dropped: the whole dataset
            assert sorted(set(seen)) == list(range(N))
            assert len(seen) > N  # DistributedSampler padded (11 samples do not split evenly)
        # without partial=True: complete, or the same error on every rank, when a loader drops
        told = [res["collector"][("told", key)] for res in results]
        drops = [d for _, d in told]
        if not any(drops):
            assert all(outcome[0] == "ok" for outcome, _ in told), (key, told)
            assert sorted(set(seen)) == list(range(N))  # (its drop_last dropped nothing)
            continue
        assert sorted(set(seen)) != list(range(N))
        for outcome, d in told:
            assert outcome == told[0][0], key  # the same error on every rank
            assert outcome[1] == "BatchSizeError" and "evaluate without drop_last" in outcome[2]
            assert f"its loader drops {d} sample(s) of the dataset" in outcome[2], outcome
            where = "DistributedSampler(drop_last=True)" if key[1] else "DataLoader(drop_last"
            assert where in outcome[2], outcome


def test_a_problem_on_one_rank_raises_on_every_rank(ranks: Any) -> None:
    _, results = ranks
    for res in results:
        status, name, message, _ = res["collector"]["rows_on_one_rank"]
        assert (status, name) == ("raised", "BatchSizeError"), message
        assert message.startswith(
            "Collector.all_gather: on rank 1: add #0: per-sample leaves disagree"
        )
        status, name, message, _ = res["collector"]["dtype_on_one_rank"]
        assert (status, name) == ("raised", "ShapeMismatchError"), message
        assert "dtype" in message


def test_a_rank_with_nothing_added(ranks: Any) -> None:
    world, results = ranks
    for res in results:
        got, indices = res["collector"]["empty_rank"]
        others = [r for r in range(world) if r != 1]
        assert indices.tolist() == others
        assert got["a"].tolist() == [float(r) for r in others]


def test_the_final_exchange_is_one_all_gather(ranks: Any) -> None:
    _, results = ranks
    for res in results:
        calls, plain = res["collector"]["collectives"]
        assert calls == plain and calls, (calls, plain)


def test_sync_grads_clip_loss_equals_one_process(ranks: Any) -> None:
    world, results = ranks
    xs, ys = _clip_batches(world)
    torch.manual_seed(1)
    lin = torch.nn.Linear(5, 6)
    x_all = [x.clone().requires_grad_(True) for x in xs]
    img = torch.cat([lin(x) for x in x_all])
    txt = torch.cat([lin(y) for y in ys])
    total = sum(_clip_loss(img, txt) * (r + 1) for r in range(world))
    total.backward()
    for rank, res in enumerate(results):
        x_grad, weight, _, tags, forward, backward = res["sync"]["clip"]
        assert torch.allclose(x_grad, x_all[rank].grad, atol=1e-6), rank
        assert torch.allclose(weight, lin.weight.grad, atol=1e-5), rank
        assert tags == [f"r{r}" for r in range(world)]  # non-tensor leaves pass through
        assert backward == ["all_to_all_single"], backward  # one collective for the whole tree
        assert forward and forward == res["sync"]["plain_forward"], forward  # none added


def test_sync_grads_every_rule(ranks: Any) -> None:
    world, results = ranks
    xs, _ = _clip_batches(world)
    for name, rule in SYNC_RULES.items():
        vs = [xs[r][:2].clone().requires_grad_(True) for r in range(world)]
        values = [v[: r + 1] if name in ("cat", "pad") else v for r, v in enumerate(vs)]
        want = tg.gather(
            [{"v": value * (r + 1)} for r, value in enumerate(values)],
            "cpu",
            {"v": rule},
            sizes=list(range(1, world + 1)),
        )
        (world * _weighted(want["v"])).backward()  # every rank's loss is the same function
        for rank, res in enumerate(results):
            got, grad = res["sync"][("rule", name)]
            assert torch.allclose(got, want["v"].detach()), name
            assert torch.allclose(grad, vs[rank].grad, atol=1e-6), (name, rank)


def test_sync_grads_off_stays_detached_and_must_agree(ranks: Any) -> None:
    _, results = ranks
    for res in results:
        assert res["sync"]["detached"] is False
        status, name, message, _ = res["sync"]["sync_on_one_rank"]
        assert (status, name) == ("raised", "LayoutError"), message
        assert "sync_grads=True on rank 0" in message


def test_the_evaluation_benchmark_runs(ranks: Any) -> None:
    # Its figures are not checked (no timing asserts), only that every part ran and what it counts.
    world, results = ranks
    if world != 2:
        pytest.skip("the benchmark's smoke run shares the group of 2 ranks")
    for rank, res in enumerate(results):
        bench = res["benchmark"]
        assert (bench["samples"], bench["batch"], bench["world"], bench["rounds"]) == (
            301,
            64,
            2,
            2,
        )
        ev, add, sync = bench["evaluation"], bench["add"], bench["sync_grads"]
        # Every implementation installed here ran (each was checked against the dataset
        # before timing); treegather and the floors always do.
        names = ev["implementations"]
        assert {"treegather", "floor", "floor_joined"} <= set(names)
        assert sorted(names + ev["missing"]) == sorted(evaluation.LABELS)
        for name in names:
            assert ev[f"{name}_ms"] > 0 and ev[f"{name}_cpu_ms"] >= 0, name
            assert ev[f"treegather_vs_{name}"] > 0, name
            assert ev["collectives"][name] >= 1, name
        assert ev["collectives"]["treegather"] == 1 and ev["collectives"]["floor"] == 1
        assert ev["collectives"]["floor_joined"] == 1
        if rank == 0:
            assert "calls on rank 0" in ev["profile"] and "all_gather" in ev["profile"]
        else:
            assert ev["profile"] is None
        assert add["adds"] == 3  # 150 samples per rank, batches of 64
        assert all(add[k] > 0 for k in ("add_us", "add_cpu_us", "copy_us", "first_add_us"))
        # sync_grads adds no collective to the forward and makes one in the backward.
        assert sync["forward_sync_collectives"] == sync["forward_plain_collectives"]
        assert sync["forward_sync_collectives"] and len(sync["backward_collectives"]) == 1
        table = evaluation.format_table(bench)
        assert table.count("\n|---") == 3 and "evaluation (adds + exchange)" in table
        assert all(evaluation.LABELS[name] in table for name in names)


def _one_process(name: str, world: int) -> tuple[Any, Any]:
    """The case in one process (no group): every rank's adds into one Collector."""
    adds, layout = FAST_CASES[name]
    col = tgd.Collector()
    for r in range(world):
        for outputs, indices in adds(r, world):
            col.add(outputs, indices=indices)
    return col.all_gather(layout), col.indices


def test_an_unexpected_error_on_one_rank_reaches_every_rank(ranks: Any) -> None:
    _, results = ranks
    for rank, res in enumerate(results):
        status, name, message, trace = res["fast"]["unexpected_on_one_rank"]
        assert (status, name) == ("raised", "TreegatherError"), message
        assert "on rank 0: RuntimeError: cannot iterate these names" in message
        if rank == 0:  # its own error, as the cause
            assert "RuntimeError: cannot iterate these names" in trace.split("direct cause")[0]


def test_a_padded_sampler_run_gives_each_sample_once(ranks: Any) -> None:
    """DistributedSampler over 53 samples (a run of 18-27 indices per rank, padding after it),
    shuffled or not: every rank gets each sample once, in order."""
    _, results = ranks
    for res in results:
        for shuffle in (False, True):
            got = res["fast"][("sampler_rows", shuffle)]
            assert got[0] == "ok", got[-1]
            result, indices = got[1]
            assert torch.equal(indices, torch.arange(53))
            assert torch.equal(result["x"], torch.arange(53.0).unsqueeze(1) * 2)
            assert result["s"] == [f"n{i}" for i in range(53)]


@pytest.mark.parametrize("name", sorted(FAST_CASES))
def test_the_fast_layer_equals_the_definition(ranks: Any, name: str) -> None:
    """Every case gives the same result through the fast paths (the wire plan, the joins) as
    through the definition (reference_only), on every rank, and the same as one process with
    every rank's adds; a repeated exchange whose payloads agree is one collective."""
    world, results = ranks
    want = _one_process(name, world)
    for rank, res in enumerate(results):
        first, fast, ref = (res["fast"][(name, mode)] for mode in ("first", "fast", "reference"))
        for got in (first, fast, ref):
            assert got[0] == "ok", got[-1]
            assert_tree_equal(got[1], want)
        calls = [
            res["fast"][(name, mode, "collectives")] for mode in ("first", "fast", "reference")
        ]
        print(name, calls)
        if name == "larger_than_the_inline_area":  # the row, then every rank's payload
            assert calls[1] == 2
        dst = res["fast"][(name, "dst")]
        assert dst[0] == "ok", dst[-1]
        if rank == world - 1:
            assert_tree_equal(dst[1], want)
        else:
            assert dst[1] == (None, None)


def test_the_fast_layer_keeps_types_and_first_rows(ranks: Any) -> None:
    world, results = ranks
    for res in results:
        _, (got, indices) = res["fast"][("str_subclass_items", "fast")]
        assert [type(s) for s in got["s"]] == [Label] * (2 * world)
        _, (got, indices) = res["fast"][("duplicates_across_ranks", "fast")]
        assert indices.tolist() == [0, *(100 + r for r in range(world))]
        assert got["x"].tolist() == [0.0, *(float(r) for r in range(world))]
        assert got["s"] == ["0", *("z" for _ in range(world))]


def test_fast_layer_errors_reach_every_rank(ranks: Any) -> None:
    world, results = ranks
    for res in results:
        status, name, message, _ = res["fast"]["bad_dst_on_one_rank"]
        assert (status, name) == ("raised", "ValueError"), message
        assert f"dst={world + 5}" in message or str(world + 5) in message
        status, name, message, _ = res["fast"]["other_call_on_one_rank"]
        assert (status, name) == ("raised", "StructureMismatchError"), message
        assert "Collector" in message and "all_gather" in message


def test_fast_layer_combine_errors_reach_every_rank(ranks: Any) -> None:
    _, results = ranks
    for res in results:
        for size in ("small", "large"):
            for how in ("all", "dst"):
                status, name, message, _ = res["fast"][("combine_error", size, how)]
                assert (status, name) == ("raised", "ShapeMismatchError"), (size, how, message)
                assert "outputs['v']" in message and "stack" in message, message
                assert "add #0 of rank 1" in message, message


def test_a_repeated_evaluation_is_one_collective(ranks: Any) -> None:
    _, results = ranks
    for res in results:
        assert len(res["fast"]["repeated_collectives"]) == 1, res["fast"]["repeated_collectives"]


@pytest.mark.transformers
def test_a_cold_transformers_evaluation_equals_one_process(ranks: Any) -> None:
    """BERT outputs with hidden states and attentions, evaluated cold on 2 ranks under
    DistributedSampler (padded, shuffled or not), come back whole through the one-collective
    exchange: a SequenceClassifierOutput equal to one process running every sample."""
    world, results = ranks
    if world != 2:
        pytest.skip("the transformers check runs in the group of 2 ranks")
    for res in results:
        kind, want = res["hf"]["one_process"]
        for shuffle in (False, True):
            name, got, indices, calls = res["hf"][shuffle]
            assert calls == 1 or not shuffle, calls  # (the second: the wire plan's one)
            assert indices.tolist() == list(range(HF_SAMPLES))
            assert name == kind == "SequenceClassifierOutput"
            assert torch.allclose(got["logits"], want["logits"], atol=1e-5)
            for field, count in (("hidden_states", 3), ("attentions", 2)):  # 2 layers
                assert len(got[field]) == len(want[field]) == count, field
                for a, b in zip(got[field], want[field]):
                    assert torch.allclose(a, b, atol=1e-5), field


# What each case raises (class, fragments of the message), or None: it returns a result.
EXPECTED: dict[str, tuple[str, tuple[str, ...]] | None] = {
    "stopped_early": (
        "BatchSizeError",
        (
            "incomplete",
            "rank 1: its loop stopped early (yielded 1 of its loader's",
            "batch(es), added 2 of their 2 row(s))",
            "partial=True",
        ),
    ),
    "stopped_early_partial": None,
    "layouts_differ": ("LayoutError", ("cat_items()} on rank 0", "as_list()} on rank")),
    "partial_differs": ("LayoutError", ("partial=True on rank 0", "layout None on rank")),
    "structure_differs": (
        "StructureMismatchError",
        ("outputs['b']: a leaf on rank 0; missing on rank", "outputs['c']: missing on rank 0"),
    ),
    "kinds_differ": (
        "StructureMismatchError",
        ("outputs['b']: a leaf, per sample on rank 0; a leaf, one value per add on rank",),
    ),
    "unpicklable": ("LeafTypeError", ("on rank 1: outputs['meta'] (add #0): function",)),
    "sparse_leaf": (  # (it travels: then the rule says torch cannot join the two kinds)
        "LeafTypeError",
        (
            "outputs['x']: cat() needs one kind of tensor in every replica",
            "replica 1: sparse_coo float32",
            "replica 1 is rank 1",
        ),
    ),
    "datasets_differ": (
        "BatchSizeError",
        (
            "the ranks' loaders index different datasets (a Subset of ",
            ") of a TensorDataset of 11 samples on rank 0;",
        ),
    ),
    "datasets_differ_plain": (
        "BatchSizeError",
        ("the ranks' loaders index different datasets (a Subset of ", "on rank 0;"),
    ),
    "shards_even": (
        "BatchSizeError",
        (
            "index different datasets (a Subset of 3 samples (0, 1, 2) of a TensorDataset",
            "of 11 samples on rank 0; a Subset of 3 samples (3, 4, 5) of",
        ),
    ),
    "one_subset": None,
    "dst_differs": ("StructureMismatchError", ("rank 0: Collector.gather(..., dst=0)", "dst=1")),
    "calls_differ": ("StructureMismatchError", ("rank 0: Collector.all_gather\n",)),
}
INTERNALS = ("values[", "Opaque", "Payload", "treegather.distributed.gather", "as_list()} on")


@pytest.mark.parametrize("name", list(ANSWERS))
def test_one_answer_on_every_rank(ranks: Any, name: str) -> None:
    """Every rank gets the same result, or the same error, from the fast layer and from the
    definition; errors name the user's leaf and call, never the payload's internals."""
    _, results = ranks
    outcomes = {
        (r, mode): res["answers"][(name, mode)]
        for r, res in enumerate(results)
        for mode in ("fast", "reference")
    }
    first = outcomes[(0, "fast")]
    expected = EXPECTED[name]
    if expected is None:
        assert first[0] == "ok", first
        for got in outcomes.values():
            assert_tree_equal(got[1], first[1])
        if name == "one_subset":  # every sample of the subset once, in the subset's order
            assert first[1]["ids"].tolist() == [10, 3, 7, 1, 0, 5]
        if name == "stopped_early_partial":  # rank 1's first batch, every other rank's all
            result, indices = first[1]
            assert result["ids"].tolist() == indices.tolist()
            assert len(indices) < N
        return
    cls, fragments = expected
    for key, got in outcomes.items():
        assert got[:3] == first[:3], (key, got[:3], first[:3])
    status, error, message, _ = first
    assert (status, error) == ("raised", cls), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert "Collector.all_gather" in message or "Collector.gather" in message, message
    hidden = [s for s in INTERNALS if s in message and not (name == "layouts_differ")]
    assert not hidden, (hidden, message)
