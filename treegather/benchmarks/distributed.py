"""Benchmark :func:`treegather.distributed.all_gather` against the floor and what users write.

Run ``python -m treegather.benchmarks.distributed`` (options: ``--leaves 10 100 1000``,
``--large 10``, ``--world 2``, ``--repeats 45``, ``--json PATH``). It spawns ``world`` gloo ranks on localhost.
Small trees hold ``n`` float32 leaves with ragged rows (leaf ``i`` on rank ``r`` is
``[8 - (r + i) % 2, 4]``); the large tree holds ``--large`` leaves of ``[4096 - r, 256]`` float32
(4 MiB each). For each tree the ranks time, each call after a barrier, the median of
``repeats`` calls (fewer for slow columns) of the following, in interleaved rounds of one call
per column so that drifting load on a shared machine hits every column alike:

- ``floor``: one ``all_gather_into_tensor`` of a flat buffer that already holds the payload (the
  largest rank's byte count, so no size exchange): what the transport costs, no pytree work;
- ``floor + layout``: the same collective, then every leaf laid out from the received bytes
  (the ranks' pieces of each leaf concatenated, one ``torch.cat`` per leaf, as in the result):
  the floor as issue 21 defines it, one collective of the payload plus one copy laying it out
  leaf by leaf;
- ``treegather``: ``treegather.distributed.all_gather(tree)`` (a repeated structure: the cached
  wire plan; one collective while the payload fits the group's inline capacity, else two; the
  ``collectives`` entry counts them in one more call);
- ``all_gather_object``: ``torch.distributed.all_gather_object`` of the tree, then a merge that
  concatenates every leaf (pickles every tensor);
- ``per-leaf``: for every leaf, all-gather its size, pad it to the largest rank's, all-gather it,
  trim and concatenate (accelerate's ``pad_across_processes`` + ``gather`` approach and most
  hand-written evaluation loops): two collectives per leaf;
- ``accelerate``: ``accelerate.utils.pad_across_processes`` then ``gather``, when installed.

A second table times a forward and backward through ``all_gather(sync_grads=True)`` (options
``--sync-rows 64 1024``, ``--no-lightning``): every rank holds two ``[rows, 512]`` float32 leaves
that require grad, gathers them, takes ``loss = sum(dot(leaf, w))`` of the gathered leaves and
runs the backward, against the same with ``torch.distributed.nn.functional.all_gather`` per leaf,
with Lightning's ``all_gather(sync_grads=True)`` (``lightning.fabric``'s
``_all_gather_ddp_if_available``, what ``LightningModule.all_gather`` and ``Fabric.all_gather``
call) per leaf where installed, and against the **floor**: one all-gather and one
reduce-scatter of the same bytes, no autograd. Every peer's gradients are checked equal to
treegather's first; the columns are timed in rounds, one call each in an order that rotates
from round to round, and each row reports, against each peer and the floor, the median over
rounds of treegather's time over the other's in the same round (the slowest rank's), and
against the best peer, the largest of the peers' (:func:`format_sync_table`).

Every column's result is checked equal to treegather's before timing. Each row reports the
slowest rank's median, ``treegather`` as a multiple of the floor (the median over rounds of the
two calls' ratio in the same round, as in :mod:`treegather.benchmarks.scatter_gather`), the
others as multiples of ``treegather``, and the peak memory of one call on rank 0, measured in a separate untimed call
as the rise of the process's resident-set high-water mark (Linux; buffers of a few hundred KiB
and more are mapped fresh by each call and counted in full, smaller ones reuse freed memory).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import multiprocessing
import os
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "run",
    "format_table",
    "format_sync_table",
    "main",
    "counting",
    "flat_all_gather",
    "spawn",
    "torchrun_environment",
]

_LARGE_ROWS, _LARGE_COLS = 4096, 256


def _small_tree(rank: int, leaves: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {f"leaf{i}": torch.randn(8 - (rank + i) % 2, 4, generator=g) for i in range(leaves)}


_tree = _small_tree  # the name notebooks/benchmark.ipynb imports


def _large_tree(rank: int, leaves: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    shape = (_LARGE_ROWS - rank, _LARGE_COLS)
    return {f"leaf{i}": torch.randn(*shape, generator=g) for i in range(leaves)}


def _per_leaf_all_gather(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """accelerate-style: per leaf, all-gather the size, pad, all-gather, trim, concatenate."""
    world = dist.get_world_size()
    out = {}
    for key, t in tree.items():
        size = torch.tensor([t.shape[0]], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(world)]
        dist.all_gather(sizes, size)
        rows = [int(s) for s in sizes]
        padded = t.new_zeros((max(rows), *t.shape[1:]))
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        out[key] = torch.cat([p[:n] for p, n in zip(parts, rows)])
    return out


def _object_all_gather(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``all_gather_object`` (pickles every tensor) and a merge that concatenates each leaf."""
    trees: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(trees, tree)
    return {key: torch.cat([t[key] for t in trees]) for key in tree}


def _floor(tree: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
    """One all-gather of a flat buffer already holding this rank's payload (padded to the max)."""
    world = dist.get_world_size()
    mine = torch.tensor([sum(t.numel() * t.element_size() for t in tree.values())])
    sizes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(sizes, mine)
    buf = torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8)
    flat = torch.cat([t.reshape(-1) for t in tree.values()]).view(torch.uint8)
    buf[: flat.numel()] = flat
    return flat_all_gather(buf)


def _laid_out(tree: dict[str, torch.Tensor]) -> Callable[[], dict[str, torch.Tensor]]:
    """:func:`_floor`'s collective, then one copy laying the received bytes out leaf by leaf,
    the cheaper way for the tree (every rank's shapes exchanged once, beforehand): for leaves
    of 64 KiB and more, one ``torch.cat`` of the ranks' pieces per leaf; for small ones, one
    ``index_select`` making each leaf's pieces adjacent, then the leaves cut from it in one
    call. The benchmark's trees have one dtype and one trailing shape."""
    world = dist.get_world_size()
    dtype = next(iter(tree.values())).dtype
    tail = next(iter(tree.values())).shape[1:]
    every: list[Any] = [None] * world
    dist.all_gather_object(every, [tuple(t.shape) for t in tree.values()])
    count = max(sum(math.prod(s) for s in shapes) for shapes in every)  # elements per rank
    collective = _floor(tree)  # (each rank's bytes padded to the largest: count elements)
    starts = [r * count for r in range(world)]
    pieces: list[list[tuple[int, int, tuple[int, ...]]]] = []  # per leaf: each rank's piece
    for k in range(len(tree)):
        pieces.append([])
        for r in range(world):
            n = math.prod(every[r][k])
            pieces[-1].append((starts[r], n, every[r][k]))
            starts[r] += n
    keys = list(tree)
    if count * dtype.itemsize >= 64 * 1024 * len(tree):  # large leaves: a torch.cat per leaf

        def call_large() -> dict[str, torch.Tensor]:
            got = collective().view(dtype)
            return {
                key: torch.cat([got[at : at + n].view(shape) for at, n, shape in leaf])
                for key, leaf in zip(keys, pieces)
            }

        return call_large
    perm = torch.cat([torch.arange(at, at + n) for leaf in pieces for at, n, _ in leaf])
    rows = [sum(shape[0] for _, _, shape in leaf) for leaf in pieces]

    def call() -> dict[str, torch.Tensor]:
        laid = collective().view(dtype).index_select(0, perm)  # the one copy
        return dict(zip(keys, laid.view(-1, *tail).unsafe_split_with_sizes(rows)))

    return call


def flat_all_gather(buf: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One ``all_gather_into_tensor`` of ``buf`` (uint8, as long on every rank): the floor of
    the benchmarks that compare against one collective of the payload's bytes."""
    world = dist.get_world_size()
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"

    def call() -> torch.Tensor:
        out = torch.empty(buf.numel() * world, dtype=torch.uint8)
        getattr(dist, name)(out, buf)  # (looked up at the call: counting() sees it)
        return out

    return call


def _accelerate_gather() -> Callable[[Any], Any] | None:
    try:
        from accelerate import PartialState
        from accelerate.utils import gather, pad_across_processes
    except ImportError:
        return None
    try:
        PartialState(cpu=True)  # attaches to the gloo group already initialised
    except Exception:
        return None

    def run(tree: Any) -> Any:
        return gather(pad_across_processes(tree, dim=0))

    return run


def _interleaved_ms(
    columns: dict[str, tuple[Callable[[], Any], int]],
) -> tuple[dict[str, float], dict[str, float]]:
    """Median milliseconds per column, timed in rounds of one call per column, and for each
    floor (``floor``, ``laid_out``) the median over rounds of treegather's time / the floor's
    time in the same round.

    Interleaving keeps the columns' ratios meaningful on a machine whose load drifts: every
    column sees the same conditions, and a per-round ratio cancels a slow phase (as in
    :mod:`treegather.benchmarks.scatter_gather`). A column with fewer repeats sits out the later
    rounds. Every rank waits for the slowest, so each column (and the ratio) reports the slowest
    rank's median.
    """
    times: dict[str, list[float]] = {name: [] for name in columns}
    for i in range(max(n for _, n in columns.values())):
        for name, (fn, n) in columns.items():
            if i >= n:
                continue
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    bases = [b for b in ("floor", "laid_out") if b in times]
    ratios = [
        statistics.median(t / f for t, f in zip(times["treegather"], times[b])) for b in bases
    ]
    mine = torch.tensor([statistics.median(times[name]) * 1e3 for name in columns] + ratios)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    slowest = torch.stack(every).amax(0).tolist()
    return dict(zip(columns, slowest[: len(columns)])), dict(zip(bases, slowest[len(columns) :]))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def _peak_mib(fn: Callable[[], Any]) -> float | None:
    """How far one call raises this process's resident memory (Linux; ``None`` elsewhere).

    Resets the RSS high-water mark (``/proc/self/clear_refs``), calls ``fn`` and reads how far
    the mark rose above the RSS at the start. Large buffers are mapped fresh on every call and
    counted in full; small ones reuse memory freed by earlier calls and barely show.
    """
    dist.barrier()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = _status_kib("VmRSS")
    except OSError:
        return None
    result = fn()
    del result
    return max(0, _status_kib("VmHWM") - start) / 1024


def _check_equal(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], name: str
) -> None:
    if list(got) != list(expected) or not all(torch.equal(got[k], expected[k]) for k in got):
        raise AssertionError(f"{name} and treegather.distributed.all_gather results differ")


def _row(
    tree: dict[str, torch.Tensor], label: str, repeats: int, slow_repeats: int
) -> dict[str, Any]:
    import treegather.distributed as tgd

    accelerate = _accelerate_gather()
    expected = tgd.all_gather(tree)
    _check_equal(_per_leaf_all_gather(tree), expected, "per-leaf")
    _check_equal(_object_all_gather(tree), expected, "all_gather_object")
    floor, laid_out = _floor(tree), _laid_out(tree)
    _check_equal(laid_out(), expected, "floor + layout")
    columns: dict[str, tuple[Callable[[], Any], int]] = {
        "floor": (floor, repeats),
        "laid_out": (laid_out, repeats),
        "treegather": (lambda: tgd.all_gather(tree), repeats),
        "object": (lambda: _object_all_gather(tree), slow_repeats),
        "per_leaf": (lambda: _per_leaf_all_gather(tree), slow_repeats),
    }
    if accelerate is not None:
        columns["accelerate"] = (lambda: accelerate(tree), slow_repeats)
    row: dict[str, Any] = {"tree": label, "leaves": len(tree), "world": dist.get_world_size()}
    row["payload_mib"] = sum(t.numel() * t.element_size() for t in tree.values()) / 2**20
    for fn, _ in columns.values():
        for _ in range(2):
            fn()  # warm-up: the wire plan, allocator state
    medians, ratios = _interleaved_ms(columns)
    for name, ms in medians.items():
        row[f"{name}_ms"] = ms
    for name, (fn, _) in columns.items():
        row[f"{name}_peak_mib"] = _peak_mib(fn)
    row.setdefault("accelerate_ms", None)
    row["treegather_vs_floor"] = ratios["floor"]  # the median of per-round ratios
    row["treegather_vs_laid_out"] = ratios["laid_out"]
    row["object_vs_treegather"] = row["object_ms"] / row["treegather_ms"]
    row["per_leaf_vs_treegather"] = row["per_leaf_ms"] / row["treegather_ms"]
    row["collectives"] = {
        "floor": 1,
        "laid_out": 1,
        "treegather": _collectives(tgd, tree),
        "object": 2,
        "per_leaf": 2 * len(tree),
    }
    return row


_SYNC_COLS = 512


def _sync_peers(lightning: bool) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Per-leaf differentiable all-gathers users write: torch's, and Lightning's where installed."""
    from torch.distributed.nn.functional import all_gather

    def by_torch(t: torch.Tensor) -> torch.Tensor:
        return torch.cat(all_gather(t))

    peers: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"torch": by_torch}
    if lightning:
        try:
            from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available
        except ImportError:
            return peers

        def by_lightning(t: torch.Tensor) -> torch.Tensor:
            return _all_gather_ddp_if_available(t, sync_grads=True).flatten(0, 1)

        peers["lightning"] = by_lightning
    return peers


def _sync_row(rows: int, repeats: int, lightning: bool = True) -> dict[str, Any]:
    """One forward and backward through the gathered leaves, per column (see the module docs)."""
    import treegather.distributed as tgd

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    leaves = [torch.randn(rows, _SYNC_COLS, generator=g).requires_grad_() for _ in range(2)]
    w = torch.randn(world * rows * _SYNC_COLS, generator=torch.Generator().manual_seed(99))

    def step(gathered: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        for leaf in leaves:
            leaf.grad = None
        sum(torch.dot(t.reshape(-1), w) for t in gathered).backward()  # type: ignore[union-attr]
        return [leaf.grad for leaf in leaves]  # type: ignore[misc]

    def treegather() -> list[torch.Tensor]:
        out = tgd.all_gather({"a": leaves[0], "b": leaves[1]}, sync_grads=True)
        return step([out["a"], out["b"]])

    peers = _sync_peers(lightning)
    columns: dict[str, Callable[[], Any]] = {"treegather": treegather}
    for name, gather in peers.items():
        columns[name] = functools.partial(lambda f: step([f(t) for t in leaves]), gather)
    flat = torch.cat([t.detach().reshape(-1) for t in leaves])
    gathered = torch.empty(world * flat.numel())
    mine = torch.empty(flat.numel())
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def floor() -> None:
        out = torch.empty_like(gathered)
        all_gather(out, flat)
        reduce_scatter(mine, out)

    columns["floor"] = floor
    with warnings.catch_warnings():  # torch 2.13 deprecates its functional all_gather
        warnings.simplefilter("ignore", FutureWarning)
        expected = treegather()
        for name in peers:
            got = columns[name]()
            if not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(got, expected)):
                raise AssertionError(f"{name} and treegather gradients differ")
        for fn in columns.values():
            fn()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in columns}
        order = list(columns.items())
        for i in range(repeats):  # the order rotates: none is always first after the barrier
            for name, fn in order[i % len(order) :] + order[: i % len(order)]:
                dist.barrier()
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    tg = times["treegather"]
    mine_ms = [statistics.median(times[name]) * 1e3 for name in columns]
    against = [*peers, "floor"]
    ratios = [statistics.median(a / b for a, b in zip(tg, times[name])) for name in against]
    every = [torch.empty(len(mine_ms) + len(ratios), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, torch.tensor(mine_ms + ratios, dtype=torch.float64))
    slowest = torch.stack(every).amax(0).tolist()
    row: dict[str, Any] = {"sync_grads": True, "tree": f"2 x [{rows}, {_SYNC_COLS}]"}
    row |= {"world": world, "peers": list(peers)}
    row |= {f"{name}_ms": ms for name, ms in zip(columns, slowest)}
    row |= {f"treegather_vs_{name}": r for name, r in zip(against, slowest[len(columns) :])}
    # the best peer is the one treegather is slowest against
    row["treegather_vs_best_peer"] = max(row[f"treegather_vs_{p}"] for p in peers)
    return row


def _collectives(tgd: Any, tree: Any) -> int:
    """How many collectives one more (repeated) call makes, as :func:`counting` sees them."""
    with counting() as calls:
        tgd.all_gather(tree)
    return len(calls)


COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "all_gather_object",
    "gather",
    "broadcast",
    "all_reduce",
    "all_to_all_single",
)


@contextlib.contextmanager
def counting() -> Iterator[list[str]]:
    """The names of the ``torch.distributed`` collectives called while the block runs.

    Wraps the module's functions (:data:`COLLECTIVES`), so it counts each call made through
    ``torch.distributed`` (a collective that another calls inside torch counts once) and none
    of treegather's internals needs to be known.
    """
    calls: list[str] = []
    saved = []
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(*args: Any, __fn: Any = fn, __name: str = name, **kwargs: Any) -> Any:
            calls.append(__name)
            return __fn(*args, **kwargs)

        saved.append((name, fn))
        setattr(dist, name, counted)
    try:
        yield calls
    finally:
        for name, fn in saved:
            setattr(dist, name, fn)


def torchrun_environment(rank: int, world: int, port: int) -> None:
    """Set the variables torchrun sets for a rank on localhost (accelerate reads them)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def init_rank(rank: int, world: int, port: int) -> None:
    """Join the gloo group of ``world`` ranks on localhost ``port``, one intra-op thread."""
    torch.set_num_threads(1)
    torchrun_environment(rank, world, port)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )


def _worker(
    rank: int,
    world: int,
    port: int,
    leaves: Sequence[int],
    large: int,
    repeats: int,
    sync_rows: Sequence[int],
    lightning: bool,
    out: str,
) -> None:
    init_rank(rank, world, port)
    try:
        rows = [_sync_row(n, repeats, lightning) for n in sync_rows]
        for n in leaves:
            slow = max(3, repeats // 3) if n >= 1000 else repeats
            rows.append(_row(_small_tree(rank, n), f"{n} x [8, 4]", repeats, slow))
        if large:
            label = f"{large} x [{_LARGE_ROWS}, {_LARGE_COLS}]"
            few = max(3, repeats // 3)
            rows.append(_row(_large_tree(rank, large), label, few, few))
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(
    leaves: Sequence[int] = (10, 100, 1000),
    *,
    large: int = 10,
    world: int = 2,
    repeats: int = 45,
    sync_rows: Sequence[int] = (64, 1024),
    lightning: bool = True,
    timeout_s: float = 900.0,
) -> list[dict[str, Any]]:
    """Spawn ``world`` gloo ranks on localhost and time every column for each tree.

    Args:
        leaves: The small trees' sizes (number of ragged ``[8 - (r + i) % 2, 4]`` leaves).
        large: How many ``[4096 - r, 256]`` float32 leaves the large tree holds (0: none).
        world: How many ranks to spawn.
        repeats: Timed calls per measurement (a third of that, at least 3, for the slow
            columns at 1000 leaves and for the large tree). The default is 45: on a shared
            2-core machine five runs' medians of per-round ratios at 100 leaves spread over
            0.7x (2.3-3.0x), against 1.4x (2.2-3.6x) with 15 rounds.
        sync_rows: The ``sync_grads`` table's rows per leaf (two ``[rows, 512]`` leaves).
        lightning: Time Lightning's ``all_gather(sync_grads=True)`` where installed (its
            import takes seconds).
        timeout_s: Kill the ranks if they have not finished by then.

    Returns:
        One dict per tree: ``tree``, ``leaves``, ``world``, ``payload_mib``, ``<column>_ms`` and
        ``<column>_peak_mib`` for ``floor``, ``laid_out`` (floor + layout), ``treegather``,
        ``object``, ``per_leaf`` (and ``accelerate_ms``, ``None`` without accelerate), the
        ratios ``treegather_vs_floor``, ``treegather_vs_laid_out``, ``object_vs_treegather``,
        ``per_leaf_vs_treegather``, and ``collectives`` per call; first, one dict per
        ``sync_rows`` entry (``"sync_grads": True``): ``tree``, ``world``, ``peers``,
        ``<column>_ms`` for ``treegather``, each peer and ``floor``, the per-round ratios
        ``treegather_vs_<peer>`` and ``treegather_vs_floor``, and ``treegather_vs_best_peer``
        (the largest of the peers').

    Example:
        >>> rows = run(leaves=(10,), large=0, repeats=2, sync_rows=(8,), lightning=False)
        >>> rows[0]["tree"], rows[0]["peers"], rows[0]["treegather_vs_floor"] > 0
        ('2 x [8, 512]', ['torch'], True)
        >>> rows[1]["tree"], rows[1]["collectives"]["treegather"], rows[1]["collectives"]["per_leaf"]
        ('10 x [8, 4]', 1, 20)
    """
    args = (tuple(leaves), large, repeats, tuple(sync_rows), lightning)
    rows: list[dict[str, Any]] = spawn(_worker, world, args, timeout_s)
    return rows


def spawn(target: Callable[..., None], world: int, args: tuple[Any, ...], timeout_s: float) -> Any:
    """Run ``target(rank, world, port, *args, out)`` in ``world`` spawned processes and return
    what rank 0 wrote to the file ``out`` (JSON). Ranks still running after ``timeout_s`` are
    killed; a rank that fails or times out is a ``RuntimeError``."""
    import tempfile

    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        full = (world, port, *args, out)
        procs = [
            ctx.Process(target=_rank, args=(target, r, *full), daemon=True) for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
        codes = [p.exitcode for p in procs]
        if codes != [0] * world or not os.path.exists(out):
            raise RuntimeError(f"benchmark ranks failed or timed out (exit codes {codes})")
        return json.loads(Path(out).read_text())


def _rank(target: Callable[..., None], *args: Any) -> None:
    """Run one rank's ``target``, then leave without Python's teardown: a process that used
    ``torch.distributed.nn``'s autograd collectives on gloo can abort there ("terminate called
    without an active exception", exit code -6) after its work is done and written."""
    target(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Render :func:`run`'s rows as a Markdown table (time, then peak memory per call).

    Example:
        >>> row = {"tree": "10 x [8, 4]", "world": 2, "payload_mib": 0.001, "floor_ms": 0.5,
        ...     "laid_out_ms": 0.8, "treegather_ms": 1.0, "object_ms": 3.0, "per_leaf_ms": 10.0,
        ...     "accelerate_ms": None, "floor_peak_mib": 1.0, "treegather_peak_mib": 1.5,
        ...     "object_peak_mib": 4.0, "per_leaf_peak_mib": 2.0, "treegather_vs_floor": 2.0,
        ...     "treegather_vs_laid_out": 1.25, "object_vs_treegather": 3.0,
        ...     "per_leaf_vs_treegather": 10.0}
        >>> print(format_table([row]))  # doctest: +NORMALIZE_WHITESPACE
        | tree (ranks) | floor | floor + layout | treegather | x floor | x floor + layout | all_gather_object + merge | per-leaf | peak MiB (floor / treegather / object / per-leaf) |
        |---|---:|---:|---:|---:|---:|---:|---:|---:|
        | 10 x [8, 4] (2) | 0.50 ms | 0.80 ms | 1.00 ms | 2.0x | 1.2x | 3.00 ms (3.0x) | 10.00 ms (10.0x) | 1.0 / 1.5 / 4.0 / 2.0 |
    """
    with_acc = any(r.get("accelerate_ms") is not None for r in rows)
    head = (
        "| tree (ranks) | floor | floor + layout | treegather | x floor | x floor + layout "
        "| all_gather_object + merge | per-leaf "
        + ("| accelerate " if with_acc else "")
        + "| peak MiB (floor / treegather / object / per-leaf) |"
    )
    lines = [head, "|---|" + "---:|" * (8 + with_acc)]
    for r in rows:
        acc = ""
        if with_acc:
            acc = "| n/a " if r.get("accelerate_ms") is None else f"| {r['accelerate_ms']:.2f} ms "
        peaks = " / ".join(
            "n/a" if r[f"{c}_peak_mib"] is None else f"{r[f'{c}_peak_mib']:.1f}"
            for c in ("floor", "treegather", "object", "per_leaf")
        )
        lines.append(
            f"| {r['tree']} ({r['world']}) | {r['floor_ms']:.2f} ms | {r['laid_out_ms']:.2f} ms "
            f"| {r['treegather_ms']:.2f} ms | {r['treegather_vs_floor']:.1f}x "
            f"| {r['treegather_vs_laid_out']:.1f}x | {r['object_ms']:.2f} ms "
            f"({r['object_vs_treegather']:.1f}x) | {r['per_leaf_ms']:.2f} ms "
            f"({r['per_leaf_vs_treegather']:.1f}x) {acc}| {peaks} |"
        )
    return "\n".join(lines)


def format_sync_table(rows: Sequence[dict[str, Any]]) -> str:
    """Render :func:`run`'s ``sync_grads`` rows as a Markdown table.

    Example:
        >>> row = {"sync_grads": True, "tree": "2 x [64, 512]", "world": 2, "treegather_ms": 2.0,
        ...     "torch_ms": 2.5, "lightning_ms": 3.0, "floor_ms": 1.6, "peers": ["torch", "lightning"],
        ...     "treegather_vs_best_peer": 0.8, "treegather_vs_floor": 1.25}
        >>> print(format_sync_table([row]))  # doctest: +NORMALIZE_WHITESPACE
        | sync_grads: forward + backward (ranks) | treegather | torch | lightning | floor | x best peer | x floor |
        |---|---:|---:|---:|---:|---:|---:|
        | 2 x [64, 512] (2) | 2.00 ms | 2.50 ms | 3.00 ms | 1.60 ms | 0.80x | 1.25x |
    """
    peers = ["torch", "lightning"]
    head = "| sync_grads: forward + backward (ranks) | treegather | torch | lightning | floor "
    lines = [head + "| x best peer | x floor |", "|---|" + "---:|" * 6]
    for r in rows:
        times = " | ".join(
            "n/a" if r.get(f"{c}_ms") is None else f"{r[f'{c}_ms']:.2f} ms"
            for c in ["treegather", *peers, "floor"]
        )
        lines.append(
            f"| {r['tree']} ({r['world']}) | {times} | {r['treegather_vs_best_peer']:.2f}x "
            f"| {r['treegather_vs_floor']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: run the benchmark and print the table.

    Example:
        >>> main(["--leaves", "10", "--large", "0", "--repeats", "2", "--sync-rows"])  # doctest: +ELLIPSIS
        | tree (ranks) | floor | floor + layout | treegather | x floor | x floor + layout | ...
        ...
        0
    """
    parser = argparse.ArgumentParser(
        prog="python -m treegather.benchmarks.distributed", description=__doc__
    )
    parser.add_argument("--leaves", type=int, nargs="*", default=[10, 100, 1000])
    parser.add_argument("--large", type=int, default=10, help="large leaves (0: no large tree)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=45)
    parser.add_argument("--sync-rows", type=int, nargs="*", default=[64, 1024])
    parser.add_argument("--no-lightning", action="store_true", help="no Lightning column")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = run(
        args.leaves,
        large=args.large,
        world=args.world,
        repeats=args.repeats,
        sync_rows=args.sync_rows,
        lightning=not args.no_lightning,
    )
    tables = (
        [format_table([r for r in rows if not r.get("sync_grads")])]
        if args.leaves or args.large
        else []
    )
    synced = [r for r in rows if r.get("sync_grads")]
    print("\n\n".join(tables + ([format_sync_table(synced)] if synced else [])))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
