"""``Collector.chunks``: an evaluation's result handed out in bounded pieces (issue 46).

Each chunk is the samples of a range of dataset indices, in order; put one after the other, the
chunks are what ``Collector.all_gather`` gives, on one process, on a group of one and on 2 and
3 spawned ranks (a shuffled, padded ``DistributedSampler``); per-add leaves come with every
chunk; the errors are ``all_gather``'s, raised at the first chunk on every rank.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import spawned_groups
import torch
import torch.distributed as dist
from spawned_groups import WORLD_SIZES
from torch.utils.data import DistributedSampler

import treegather as tg
import treegather.distributed as tgd

N = 23  # samples: uneven over 2 and 3 ranks (padding), and over chunks of 4
LAYOUT = tg.by_path({"names": tg.cat_items(), "loss": tg.mean()})


def _fill(col: tgd.Collector, indices: list[int], batch: int = 3) -> None:
    """Adds of ``batch`` samples: per-sample logits, ids and names, and a per-add loss."""
    for at in range(0, len(indices), batch):
        rows = indices[at : at + batch]
        x = torch.tensor(rows, dtype=torch.float32)
        col.add(
            {
                "logits": torch.stack([x, -x], 1),
                "ids": torch.tensor(rows),
                "names": [f"s{i}" for i in rows],
                "loss": x.mean(),
            },
            indices=rows,
        )


def _joined(chunks: Iterator[tuple[torch.Tensor, Any]]) -> tuple[list[Any], dict[str, Any]]:
    """The chunks as they came, and put one after the other."""
    got = list(chunks)
    joined = {
        "logits": torch.cat([out["logits"] for _, out in got]),
        "ids": torch.cat([out["ids"] for _, out in got]),
        "names": [n for _, out in got for n in out["names"]],
    }
    return got, joined


def _same_as_all_gather(got: list[Any], joined: dict[str, Any], whole: dict[str, Any]) -> None:
    for key in ("logits", "ids", "names"):
        assert torch.equal(joined[key], whole[key]) if key != "names" else joined[key] == whole[key]
    for indices, out in got:  # (each chunk: one range of indices, in order, with every loss)
        assert indices.tolist() == out["ids"].tolist() == sorted(indices.tolist())
        assert indices.max() // 4 == indices.min() // 4
        assert torch.equal(out["loss"], whole["loss"])


def test_chunks_are_the_result_in_pieces(world_of_one_or_none: None) -> None:
    order = list(range(N))
    random.Random(0).shuffle(order)
    chunked, whole = tgd.Collector(), tgd.Collector()
    _fill(chunked, order)
    _fill(whole, order)
    got, joined = _joined(chunked.chunks(LAYOUT, rows=4))
    expected = whole.all_gather(LAYOUT)
    assert [len(i) for i, _ in got] == [4, 4, 4, 4, 4, 3]
    _same_as_all_gather(got, joined, expected)
    assert chunked.indices is not None and chunked.indices.tolist() == list(range(N))


@pytest.fixture(params=[False, True], ids=["no group", "group of one"])
def world_of_one_or_none(request: pytest.FixtureRequest) -> Iterator[None]:
    if not request.param:
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_missing_indices_leave_their_chunks_out() -> None:
    col = tgd.Collector()
    _fill(col, [0, 1, 9, 10, 11])
    got = [(i.tolist(), out["names"]) for i, out in col.chunks(LAYOUT, rows=4)]
    assert got == [([0, 1], ["s0", "s1"]), ([9, 10, 11], ["s9", "s10", "s11"])]


@pytest.mark.parametrize("rows", [0, -1, True, 2.5, "4"])
def test_rows_is_a_positive_int(rows: Any) -> None:
    col = tgd.Collector()
    _fill(col, [0, 1])
    with pytest.raises(tg.ArgumentTypeError, match="rows must be a positive int"):
        next(col.chunks(rows=rows))


def test_errors_are_all_gather_s_at_the_first_chunk() -> None:
    short = tgd.Collector(list(range(6)))  # (a sampler of 6, and 3 rows added)
    _fill(short, [0, 1, 2])
    chunks = short.chunks(LAYOUT, rows=2)
    with pytest.raises(tg.BatchSizeError, match=r"Collector.chunks: .*incomplete"):
        next(chunks)
    packed = tgd.Collector()
    seqs = [torch.ones(2, 1), torch.ones(1, 1)]
    packed.add({"p": torch.nn.utils.rnn.pack_sequence(seqs), "i": torch.arange(2)}, indices=[0, 1])
    with pytest.raises(
        tg.LayoutError,
        match=r"chunks: on rank 0: outputs\['p'\].*PackedSequence holds its rows its own way",
    ):
        next(packed.chunks(rows=1))
    twice = tgd.Collector()
    _fill(twice, [0])
    list(twice.chunks(LAYOUT, rows=1))
    with pytest.raises(tg.StateError):
        next(twice.chunks(LAYOUT, rows=1))


# ------------------------------------------------------------------------- spawned ranks


@spawned_groups.register("chunks", budget_s=20)
def _chunk_checks(rank: int, world: int) -> dict[str, Any]:
    """A shuffled, padded DistributedSampler's share on each rank: the chunks and all_gather."""
    sampler = DistributedSampler(range(N), num_replicas=world, rank=rank, shuffle=True, seed=3)
    mine = list(sampler)
    chunked, whole = tgd.Collector(), tgd.Collector()
    _fill(chunked, mine)
    _fill(whole, mine)
    got, joined = _joined(chunked.chunks(LAYOUT, rows=4))
    expected = whole.all_gather(LAYOUT)
    _same_as_all_gather(got, joined, expected)
    short = tgd.Collector(sampler)
    _fill(short, mine[:-1] if rank == 0 else mine)
    try:
        next(short.chunks(LAYOUT, rows=4))
        told = "no error"
    except tg.TreegatherError as exc:
        told = f"{type(exc).__name__}: {exc}"
    return {
        "sizes": [len(i) for i, _ in got],
        "ids": joined["ids"].tolist(),
        "indices": chunked.indices.tolist() if chunked.indices is not None else None,
        "told": told,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_chunks_on_ranks(world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    results = [res["chunks"] for res in spawned_groups.results(world, tmp_path_factory)]
    for res in results:
        assert res == results[0]  # (the same chunks on every rank)
        assert res["sizes"] == [4, 4, 4, 4, 4, 3]
        assert res["ids"] == res["indices"] == list(range(N))
        assert (
            res["told"].startswith("BatchSizeError: Collector.chunks: ")
            and "rank 0" in (res["told"])
        )
