"""The Collector over the loops people write: each add belongs to the batch the loop is on.

A matrix of index sources (torch's samplers under ``batch_size=``, batch samplers that yield
lists, tuples, tensors, numpy arrays, ranges, generators, another iterable, or one list refilled
in place, and torch's ``BatchSampler``), each with ``drop_last=True`` wherever it takes one (the
``DataLoader``, the sampler, the ``BatchSampler``: every combination, read from torch's
signatures), collate functions (torch's default, one that drops corrupt samples, one
that sorts the batch by length, each with the rows' ids passed as ``indices=`` or not) and loop
shapes (every batch added, a batch skipped, batches split into adds, a loop left early, outputs
added after the loop, one half of a batch lost to a caught error), with ``partial`` both ways,
in one process (a gloo group of one) and on the shared gloo group of 2 ranks (one check runs
the whole matrix). Every case is exact (each sample the adds hold once, in dataset order, each
row its own sample's, ``col.indices`` those samples) or a typed error that says why, on every
rank; which one is told from what the loop received and added and from what its loader hands
out with nothing dropped (:func:`expected`), not from the Collector: a loader that drops
samples has not seen the dataset, and its error says how many and where. A collate that reorders rows without ids is outside the matrix: nothing in the
outputs tells the Collector, which is why ``observe``'s contract asks for ids then.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import spawned_groups
import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    WeightedRandomSampler,
    default_collate,
)

import treegather as tg
import treegather.distributed as tgd
from treegather._caches import reference_only

N = 13  # samples: batches of 4 leave one of 1 (and uneven shares over 2 ranks)
BATCH = 4
X = torch.randn(N, 3, generator=torch.Generator().manual_seed(0))
LENGTH = [(i * 7) % 5 + 1 for i in range(N)]  # what the sorting collate sorts by
CORRUPT = {3, 8}  # what the dropping collate drops
LAYOUT = tg.by_path({"name": tg.cat_items()})


class Samples(Dataset[dict[str, Any]]):
    """Sample ``i`` says which it is (its index, features and name)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: Any) -> dict[str, Any]:
        i = int(i)  # (an index may come as a numpy int or a 0-dim tensor)
        return {"i": i, "x": X[i], "name": f"s{i}", "length": LENGTH[i]}


# ------------------------------------------------------------------------- index sources


def _chunks(rank: int, world: int) -> list[range]:
    """This rank's share of the dataset in batches, last batch first (not in index order)."""
    mine = range(rank, N, world)
    return [mine[k : k + BATCH] for k in range(0, len(mine), BATCH)][::-1]


class Batches(Sampler[Any]):
    """A batch sampler yielding each batch as ``kind``."""

    def __init__(self, kind: str, rank: int, world: int) -> None:
        self.kind, self.chunks = kind, _chunks(rank, world)

    def __len__(self) -> int:
        return len(self.chunks)

    def __iter__(self) -> Iterator[Any]:
        refilled: list[int] = []
        for chunk in self.chunks:
            if self.kind == "in-place list":  # one list, refilled for every batch
                refilled[:] = chunk
                yield refilled
            else:
                yield MAKE[self.kind](chunk)


MAKE: dict[str, Callable[[range], Any]] = {
    "list": list,
    "tuple": tuple,
    "tensor": lambda c: torch.tensor(list(c)),
    "int32 tensor": lambda c: torch.tensor(list(c), dtype=torch.int32),
    "numpy": lambda c: np.array(list(c)),
    "range": lambda c: c,
    "generator": lambda c: (i for i in c),
    "deque": collections.deque,
}
BATCH_SAMPLERS = [*MAKE, "in-place list"]
SAMPLERS: dict[str, Callable[..., Any]] = {  # (rank, world, **the sampler's drop_last)
    "SequentialSampler": lambda rank, world, **kw: SequentialSampler(Samples(), **kw),
    "RandomSampler": lambda rank, world, **kw: RandomSampler(
        Samples(), generator=torch.Generator().manual_seed(3 + rank), **kw
    ),
    "DistributedSampler": lambda rank, world, **kw: DistributedSampler(
        Samples(), world, rank, shuffle=True, seed=4, **kw
    ),
    # drawn with replacement: samples twice in a batch, samples never
    "WeightedRandomSampler": lambda rank, world, **kw: WeightedRandomSampler(
        torch.ones(N), N, replacement=True, generator=torch.Generator().manual_seed(5 + rank), **kw
    ),
}
TORCH_BATCHES = "batch_sampler=BatchSampler(DistributedSampler)"  # torch's, over this rank's part
BASES = [*SAMPLERS, *(f"batch_sampler={k}" for k in BATCH_SAMPLERS), TORCH_BATCHES]


def _takes_drop_last(kind: type) -> bool:
    return "drop_last" in inspect.signature(kind).parameters


def drop_places(base: str) -> list[str]:
    """Where ``base``'s loader takes ``drop_last`` (torch's signatures say): the ``DataLoader``
    (under ``batch_size=``), the sampler, torch's ``BatchSampler``."""
    if base in SAMPLERS:
        kinds = {"DataLoader": DataLoader, "sampler": type(SAMPLERS[base](0, 1))}
    elif base == TORCH_BATCHES:
        kinds = {"BatchSampler": BatchSampler, "sampler": DistributedSampler}
    else:
        kinds = {"batch_sampler": Batches}  # (ours: it drops nothing)
    return [place for place, kind in kinds.items() if _takes_drop_last(kind)]


def _variants(base: str) -> list[str]:
    """``base`` with ``drop_last=True`` at every combination of the places that take it."""
    places = drop_places(base)
    return [
        base + (f" drop_last={'+'.join(on)}" if on else "")
        for k in range(len(places) + 1)
        for on in itertools.combinations(places, k)
    ]


SOURCES = [variant for base in BASES for variant in _variants(base)]


# ------------------------------------------------------------------------------ collates


@dataclasses.dataclass
class Collate:
    """A collate function that notes the samples it was given (the truth about each batch)."""

    kind: str
    given: list[list[int]] = dataclasses.field(default_factory=list)

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        self.given.append([s["i"] for s in samples])
        if self.kind == "drop":  # corrupt samples left out (a batch keeps one at least)
            samples = [s for s in samples if s["i"] not in CORRUPT] or samples[:1]
        elif self.kind == "sort":  # longest first (pack_padded_sequence)
            samples = sorted(samples, key=lambda s: -s["length"])
        return default_collate(samples)


# (kind, whether the loop passes the rows' ids as indices=); a sort without ids is outside
COLLATES = [("default", False), ("default", True), ("drop", False), ("drop", True), ("sort", True)]
SHAPES = ["each", "skip", "split", "stop", "after", "after_all", "half_lost"]


def loader(source: str, collate: Any, rank: int, world: int) -> DataLoader[Any]:
    base, _, on = source.partition(" drop_last=")
    drops = set(on.split("+")) if on else set()
    kw = {"drop_last": True} if "sampler" in drops else {}
    if base in SAMPLERS:
        sampler = SAMPLERS[base](rank, world, **kw)
        return DataLoader(
            Samples(),
            batch_size=BATCH,
            sampler=sampler,
            collate_fn=collate,
            drop_last="DataLoader" in drops,
        )
    if base == TORCH_BATCHES:
        inner = DistributedSampler(Samples(), world, rank, shuffle=True, seed=6, **kw)
        batches = BatchSampler(inner, BATCH, drop_last="BatchSampler" in drops)
        return DataLoader(Samples(), batch_sampler=batches, collate_fn=collate)
    kind = base.removeprefix("batch_sampler=")
    return DataLoader(Samples(), batch_sampler=Batches(kind, rank, world), collate_fn=collate)


def dropped(source: str, rank: int, world: int) -> tuple[int, list[str]]:
    """How many samples ``source``'s loader drops on this rank: those of the dataset that no
    rank's sampler gives (its ``drop_last``), and those of this rank's sampler that its batches
    leave out; and the places whose ``drop_last`` drops some (read from fresh loaders)."""

    def handed(variant: str, r: int = rank) -> list[int]:
        index_sampler = loader(variant, default_collate, r, world).batch_sampler
        return [int(i) for batch in index_sampler for i in batch]

    base, _, on = source.partition(" drop_last=")
    places = on.split("+") if on else []
    only = f"{base} drop_last=sampler" if "sampler" in places else base
    every = {i for r in range(world) for i in handed(base, r)}
    kept = {i for r in range(world) for i in handed(only, r)}
    lost = {"sampler": len(every - kept), "batches": len(handed(only)) - len(handed(source))}
    named = [p for p in places if lost["sampler" if p == "sampler" else "batches"]]
    return sum(lost.values()), named


@dataclasses.dataclass
class Run:
    """What one rank's loop received and added, and what the Collector gave."""

    received: list[list[int]]  # each batch the loop received: its samples, as handed out
    added: list[tuple[list[int], bool, int | None]]  # per add: rows' samples, named, batch #
    outcome: tuple[Any, ...]  # ("ok", result, indices) or ("raised", class name, message)
    dropped: tuple[int, list[str]] = (0, [])  # what its loader drops, and where (dropped())


def _rows(batch: dict[str, Any], part: slice = slice(None)) -> dict[str, Any]:
    return {"i": batch["i"][part], "x": batch["x"][part], "name": batch["name"][part]}


def run_case(
    source: str, kind: str, ids: bool, shape: str, partial: bool, rank: int, world: int
) -> Run:
    """One loop of the matrix on this rank: observed, added as ``shape`` says, exchanged."""
    collate = Collate(kind)
    col = tgd.Collector()
    added: list[tuple[list[int], bool, int | None]] = []
    kept: list[dict[str, Any]] = []

    def add(rows: dict[str, Any], b: int | None) -> None:
        col.add(rows, indices=rows["i"] if ids else None)
        added.append((rows["i"].tolist(), ids, b))

    received = 0
    for b, batch in enumerate(col.observe(loader(source, collate, rank, world))):
        received += 1
        if shape == "skip" and b == 1:
            continue  # a bad batch
        if shape in ("after", "after_all"):
            kept.append(_rows(batch))
        elif shape == "split":
            add(_rows(batch, slice(0, 2)), b)
            add(_rows(batch, slice(2, None)), b)
        elif shape == "half_lost" and b == 1:
            add(_rows(batch, slice(0, 2)), b)
            try:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            except torch.OutOfMemoryError:
                pass  # the second half is lost
        else:
            add(_rows(batch), b)
        if shape == "stop" and b == 1:
            break
    if shape == "after":
        for rows in kept:
            add(rows, None)
    elif shape == "after_all" and kept:
        add({k: _joined([r[k] for r in kept]) for k in kept[0]}, None)
    try:
        outcome: tuple[Any, ...] = ("ok", col.all_gather(LAYOUT, partial=partial), col.indices)
    except tg.TreegatherError as exc:
        outcome = ("raised", type(exc).__name__, str(exc))
    return Run(collate.given[:received], added, outcome, dropped(source, rank, world))


def _joined(parts: list[Any]) -> Any:
    return torch.cat(parts) if isinstance(parts[0], torch.Tensor) else list(itertools.chain(*parts))


LOOPS = [
    (kind, ids, shape, partial)
    for kind, ids in COLLATES
    for shape in SHAPES
    for partial in (False, True)
]
CASES = [(source, *loop) for source in SOURCES for loop in LOOPS]
# On 2 ranks (where what is new is the exchange: the rows' indices are read as in one
# process): every loop, each with two of the sources in turn.
RANK_CASES = [
    (SOURCES[(2 * t + j) % len(SOURCES)], *loop) for t, loop in enumerate(LOOPS) for j in (0, 1)
]


# --------------------------------------------------------------------------------- oracle


def verdict(run: Run, shape: str) -> str:
    """What a rank's loop calls for, from what it received and added: ``"exact"``,
    ``"ambiguous"`` (rows taken by counting that cannot be matched to the batch's samples) or
    ``"short"`` (it added fewer samples than its loop received, or stopped early)."""
    counted: dict[int | None, int] = collections.defaultdict(int)
    for rows, named, b in run.added:
        if not named:
            counted[b] += len(rows)
    after = counted.pop(None, None)
    if any(n != len(run.received[b]) for b, n in counted.items() if b is not None):
        return "ambiguous"
    if after is not None and after != sum(map(len, run.received)):
        return "ambiguous"  # (no batch added in the loop: the adds after it take them all)
    held = collections.Counter(i for rows, _, _ in run.added for i in rows)
    if shape == "stop" or held != collections.Counter(i for b in run.received for i in b):
        return "short"
    return "short" if run.dropped[0] else "exact"  # (a loader that dropped: not the dataset)


def expected(runs: list[Run], shape: str, partial: bool) -> str:
    """The case's outcome on every rank: ``"exact"``, or the error's kind (a rank that lacks
    samples is reported before another rank's ambiguous rows)."""
    found = {verdict(run, shape) for run in runs}
    if partial:
        found.discard("short")
    if len(runs) > 1 and "short" in found:
        return "short"
    return "ambiguous" if "ambiguous" in found else "short" if "short" in found else "exact"


WHY = {  # what the error says, per kind
    "ambiguous": "indices=ids",
    "short": "partial=True",
}


def check(case: tuple[Any, ...], runs: list[Run]) -> str:
    """The case's outcome (``"exact"``, ``"ambiguous"``, ``"short"``) after checking every
    rank's against it; raises an AssertionError naming the case otherwise."""
    _, _, _, shape, partial = case
    want = expected(runs, shape, partial)
    if want == "exact":
        samples = sorted({i for run in runs for rows, _, _ in run.added for i in rows})
        for r, run in enumerate(runs):
            assert run.outcome[0] == "ok", (case, r, run.outcome)
            _, result, indices = run.outcome
            assert indices.tolist() == samples, (case, r)
            if not samples:
                assert result is None, (case, r)
                continue
            assert result["i"].tolist() == samples, (case, r)  # each row its own sample's
            assert torch.equal(result["x"], X[samples]), (case, r)
            assert result["name"] == [f"s{i}" for i in samples], (case, r)
        return want
    first = runs[0].outcome
    for r, run in enumerate(runs):
        assert run.outcome[0] == "raised", (case, r, want, run.outcome)
        assert run.outcome[1] == "BatchSizeError", (case, r, run.outcome)
        assert WHY[want] in run.outcome[2], (case, r, want, run.outcome)
        assert run.outcome == first, (case, r)  # the same error on every rank
    if want == "short":
        _check_drops(case, runs, first[2])
    return want


def _check_drops(case: tuple[Any, ...], runs: list[Run], text: str) -> None:
    """The incomplete error names, on each rank's line, how many samples its loader drops
    and each place that drops some, and says to evaluate without drop_last; nothing where
    none drops."""
    lines = {}  # rank -> its line
    for line in text.splitlines():
        if line.startswith("  - rank"):
            listed, _, said = line.removeprefix("  - ").partition(": ")
            for r in listed.split(" ", 1)[1].split(", "):
                lines[int(r)] = said
    for r, run in enumerate(runs):
        count, places = run.dropped
        said = lines.get(r, "")
        if not count or verdict(run, case[3]) == "ambiguous":  # (its line: another problem)
            assert "drops" not in said, (case, r, said)
            continue
        assert f"its loader drops {count} sample(s) of the dataset" in said, (case, r, said)
        for place in places:
            named = {"sampler": "DistributedSampler(drop_last=True)"}.get(place, place)
            named = "BatchSampler(drop_last=True)" if place == "BatchSampler" else named
            named = "DataLoader(drop_last=True)" if place == "DataLoader" else named
            assert named in said, (case, r, place, said)
    if any(run.dropped[0] for run in runs):
        assert "evaluate without drop_last" in text, (case, text)
    else:
        assert "drop_last" not in text, (case, text)


def _tally(outcomes: list[str]) -> dict[str, int]:
    return dict(collections.Counter(outcomes))


# --------------------------------------------------------------------------- one process


@pytest.mark.parametrize("source", SOURCES)
def test_every_loop_is_exact_or_a_typed_error(world_of_one: None, source: str) -> None:
    outcomes = []
    for case in CASES:
        if case[0] == source:
            outcomes.append(check(case, [run_case(*case, rank=0, world=1)]))
    tally = _tally(outcomes)
    assert set(tally) == {"exact", "ambiguous", "short"}, tally  # (the matrix reaches each)


def test_the_definition_gives_what_the_fast_layer_gives(world_of_one: None) -> None:
    for case in CASES:
        if case[0] == "batch_sampler=numpy":
            fast = run_case(*case, rank=0, world=1)
            with reference_only():
                slow = run_case(*case, rank=0, world=1)
            assert check(case, [fast]) == check(case, [slow])
            if fast.outcome[0] == "raised":
                assert fast.outcome == slow.outcome, case


def test_without_a_process_group_too() -> None:
    for case in CASES:
        if case[0] == "batch_sampler=range" and case[1:3] == ("drop", False):
            check(case, [run_case(*case, rank=0, world=1)])


def test_a_skipped_batch_is_skipped() -> None:
    """The issue's loop: batch #1 skipped, partial=True: the rows are the other batches'."""
    col = tgd.Collector()
    for b, batch in enumerate(col.observe(DataLoader(Samples(), batch_size=4))):
        if b != 1:
            col.add(_rows(batch))
    out = col.all_gather(LAYOUT, partial=True)
    kept = [i for i in range(N) if not 4 <= i < 8]
    assert out["i"].tolist() == col.indices.tolist() == kept
    assert out["name"] == [f"s{i}" for i in kept]
    with pytest.raises(tg.BatchSizeError, match=r"added 9 of the 13 row\(s\) its loader yielded"):
        _skipping().all_gather(LAYOUT)


def _skipping() -> tgd.Collector:
    col = tgd.Collector()
    for b, batch in enumerate(col.observe(DataLoader(Samples(), batch_size=4))):
        if b != 1:
            col.add(_rows(batch))
    return col


def test_rows_a_collate_dropped_are_an_error_that_says_what_to_do() -> None:
    col = tgd.Collector()
    for batch in col.observe(DataLoader(Samples(), batch_size=4, collate_fn=Collate("drop"))):
        col.add(_rows(batch))
    with pytest.raises(tg.BatchSizeError) as info:
        col.all_gather(LAYOUT, partial=True)
    text = str(info.value)
    assert "batch #0 (add #0 first) hold 3 of its 4 rows" in text
    assert "collate_fn that drops" in text and "indices=ids" in text


def test_ids_are_checked_against_the_batch_the_loop_is_on() -> None:
    col = tgd.Collector()
    for batch in col.observe(DataLoader(Samples(), batch_size=4, collate_fn=Collate("sort"))):
        col.add(_rows(batch), indices=(batch["i"] + 4) % N)  # another batch's ids
    with pytest.raises(tg.BatchSizeError, match=r"add #0: indices= \[.*\] are not the rows of"):
        col.all_gather(LAYOUT)
    col = tgd.Collector()
    for batch in col.observe(DataLoader(Samples(), batch_size=4)):
        col.add(_rows(batch), indices=batch["i"][[0, 0, 1, 2]] if len(batch["i"]) == 4 else None)
    with pytest.raises(tg.BatchSizeError, match=r"or repeat rows an add before it took"):
        col.all_gather(LAYOUT)


def test_adds_after_the_loop_take_whole_batches_in_turn() -> None:
    col, kept = tgd.Collector(), []
    for batch in col.observe(DataLoader(Samples(), batch_size=4)):
        kept.append(_rows(batch))
    col.add({k: _joined([kept[0][k], kept[1][k][:2]]) for k in kept[0]})  # 1.5 batches
    with pytest.raises(tg.BatchSizeError, match=r"hold \[4, 4, 4, 1\] row\(s\): an add made after"):
        col.all_gather(LAYOUT, partial=True)


def test_index_batches_are_copied_when_handed_out() -> None:
    """A batch sampler that refills one list: each batch's indices as they were handed out."""
    col = tgd.Collector()
    data = DataLoader(Samples(), batch_sampler=Batches("in-place list", 0, 1))
    for batch in col.observe(data):
        col.add(_rows(batch))
    out = col.all_gather(LAYOUT)
    assert out["i"].tolist() == col.indices.tolist() == list(range(N))


def test_a_batch_of_what_is_not_indices_is_a_typed_error() -> None:
    class Floats(Sampler[Any]):
        def __len__(self) -> int:
            return 1

        def __iter__(self) -> Iterator[Any]:
            yield np.array([0.0, 1.0])

    col = tgd.Collector()
    for batch in col.observe(DataLoader(Samples(), batch_sampler=Floats())):
        col.add(_rows(batch))
    with pytest.raises(tg.ArgumentTypeError, match=r"batch #0 of indices is not dataset indices"):
        col.all_gather(LAYOUT)


def test_numpy_batches_through_workers() -> None:
    col = tgd.Collector()
    data = DataLoader(Samples(), batch_sampler=Batches("numpy", 0, 1), num_workers=2)
    for batch in col.observe(data):
        col.add(_rows(batch))
    assert col.all_gather(LAYOUT)["i"].tolist() == col.indices.tolist() == list(range(N))


# The Collector-specific rule errors: the typed error tg.gather gives, naming the leaf.
RULES = [
    (tg.cat(1), torch.zeros(3)),
    (tg.cat(2), torch.zeros(3, 2)),
    (tg.cat(3), torch.zeros(3, 2, 2)),
    (tg.pad(2), torch.zeros(3, 2)),
    (tg.pad(0, lengths=True), torch.zeros(3, 2)),
]


def rule_errors() -> list[tuple[str, str]]:
    """Each rule's error in a Collector (its class and text)."""
    out = []
    for rule, leaf in RULES:
        col = tgd.Collector()
        col.add({"ids": torch.arange(3), "a": leaf}, indices=[0, 1, 2])
        try:
            col.all_gather(tg.by_path({"a": rule}))
        except tg.TreegatherError as exc:
            out.append((type(exc).__name__, str(exc)))
        else:
            out.append(("nothing", ""))
    return out


def _check_rule_errors(found: list[tuple[str, str]]) -> None:
    for (rule, leaf), (kind, text) in zip(RULES, found, strict=True):
        assert "outputs['a']" in text, (rule, text)
        if getattr(rule, "lengths", False):  # gather gives each replica's lengths: not per row
            assert kind == "LayoutError" and "pad(lengths=True) in a Collector" in text, text
            continue
        with pytest.raises(tg.TreegatherError) as info:
            tg.gather([{"a": leaf}] * 2, "cpu", {"a": rule})
        assert kind == type(info.value).__name__, (rule, kind)
        said = str(info.value).splitlines()[0]  # "outputs['a']: cat(dim=1) is out of range..."
        assert said in text, (rule, text)


def test_rules_a_collector_cannot_apply_are_gather_s_errors(world_of_one: None) -> None:
    _check_rule_errors(rule_errors())


# ------------------------------------------------------------------------------- 2 ranks


@spawned_groups.register("loops.matrix", budget_s=40)
def _ranks_matrix(rank: int, world: int) -> dict[str, Any]:
    if world != 2:  # (the matrix runs on 2 ranks; the group of 3 skips it)
        return {}
    out: dict[str, Any] = {"rules": rule_errors()}
    for case in RANK_CASES:
        out[repr(case)] = run_case(*case, rank=rank, world=world)
    dist.barrier()
    return out


@pytest.fixture(scope="module", params=[2], ids=lambda w: f"world{w}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return [res["loops.matrix"] for res in spawned_groups.results(request.param, tmp_path_factory)]


@pytest.mark.distributed
def test_every_loop_on_2_ranks_is_exact_or_the_same_typed_error(ranks: Any) -> None:
    outcomes = [check(case, [mine[repr(case)] for mine in ranks]) for case in RANK_CASES]
    assert set(_tally(outcomes)) == {"exact", "ambiguous", "short"}, _tally(outcomes)
    assert {case[0] for case in RANK_CASES} == set(SOURCES)


@pytest.mark.distributed
def test_rule_errors_on_2_ranks(ranks: Any) -> None:
    for mine in ranks:
        _check_rule_errors(mine["rules"])
    assert ranks[0]["rules"] == ranks[1]["rules"]  # the same error on every rank
