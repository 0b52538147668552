"""Benchmark a :class:`treegather.distributed.Collector` evaluation on gloo ranks.

Run ``python -m treegather.benchmarks.evaluation`` (options: ``--samples 10000``, ``--batch 64``,
``--world 2``, ``--rounds 25``, ``--profile``, ``--json PATH``). It spawns ``world`` gloo ranks on
localhost, as :mod:`treegather.benchmarks.distributed` does. Each rank evaluates its share of a
dataset of ``samples`` samples under ``DistributedSampler(shuffle=False)``, in batches of
``batch``, each batch's outputs ``{"logits": [B, 10] float32, "ids": [B] int64, "names": B
strs}``, made before any timing (no model runs). It measures:

- **the final exchange**: ``col.all_gather(tg.by_path({"names": tg.cat_items()}))`` after every
  batch was added (the adds untimed), against one ``all_gather_into_tensor`` of a flat buffer
  of the same tensor bytes (the logits and ids of the largest rank; ``floor``), of the same
  bytes plus the pickled names (``floor_names``), and of this rank's tensor bytes plus its
  names' UTF-8 bytes joined by ``"\\x00"`` followed by decoding every other rank's names from
  the bytes it sent into one list of all ranks' names (``floor_decoded``: the least an exchange
  that returns Python strings must do; each rank's byte counts are exchanged once, untimed).
  Each round times the four, in rotating order, each call after a barrier with the garbage
  collector off; the ratios are the medians of the per-round ratios, and every figure is the
  slowest rank's; the calling thread's CPU time of the exchange and of the floor tells the
  call's own work from the wait for the transfer. Before timing, the result is checked against
  the dataset (every sample once, in index order), and the decoded floor's against every
  rank's bytes and names (in rank order). ``--profile`` adds a cProfile of rank 0's exchanges.
- **the final exchange of tensors only**: the same batches without ``"names"``,
  ``col.all_gather()`` with no layout, against ``floor`` in the same way, and against
  ``floor_placed``: the floor's collective, then each leaf's rows of every rank concatenated
  and picked into index order, each index once (``torch.cat`` and ``index_select``, the order
  worked out beforehand, untimed; no checks): the least a tensors-only exchange that returns
  the dataset in index order must do.
- **one add** (``col.add(outputs)`` under ``torch.no_grad()``; and with ``Collector(sampler,
  device="cpu")``), in µs of this thread's CPU time per add, the garbage collector off, next to
  the cost of copying the batch (``clone()`` of its tensors), and the first add of an epoch
  (which reads the sampler's indices) on its own.
- **sync_grads**: the collectives that ``tgd.all_gather(tree, sync_grads=True)`` of one batch
  (the logits made by a linear layer, so they require grad) makes in the forward, against the
  same call without ``sync_grads``, and in the backward of a loss over the result, counted by
  wrapping ``torch.distributed``'s functions (:func:`~treegather.benchmarks.distributed.counting`);
  with each one's median wall time.

The targets (issue 21): the exchange at most 1.5x ``floor`` (the tensor bytes alone; the other
floors show how much of the distance the names account for), an add at most 20 µs plus its
copy, ``sync_grads`` adding no collective to the forward and one to the backward.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pickle
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .distributed import counting, flat_all_gather, init_rank, spawn

__all__ = ["run", "measure", "format_table", "main"]

Outputs = dict[str, Any]


def _dataset(samples: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(samples, 10, generator=g),
        torch.arange(samples),
        [f"sample-{i:06d}" for i in range(samples)],
    )


def _batches(order: list[int], batch: int, data: tuple[Any, ...]) -> list[Outputs]:
    logits, ids, names = data
    out = []
    for start in range(0, len(order), batch):
        chunk = order[start : start + batch]
        idx = torch.tensor(chunk)
        out.append({"logits": logits[idx], "ids": ids[idx], "names": [names[i] for i in chunk]})
    return out


def _per_rank(values: list[float]) -> torch.Tensor:
    """Every rank's ``values`` (one ``all_gather``): a ``[world, len(values)]`` float64 tensor."""
    mine = torch.tensor(values, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return torch.stack(every)


def _slowest(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks."""
    result: list[float] = _per_rank(values).amax(0).tolist()
    return result


def _flat_all_gather(nbytes: int) -> Callable[[], torch.Tensor]:
    """One ``all_gather_into_tensor`` of ``nbytes`` per rank (the largest rank's count)."""
    nbytes = int(_slowest([float(nbytes)])[0])
    return flat_all_gather(torch.zeros(nbytes, dtype=torch.uint8))


def _timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call after a barrier, garbage collector off."""
    return _timed_cpu(fn)[0]


def _timed_cpu(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall seconds and this thread's CPU seconds of one call after a barrier, garbage
    collector off (the collective's own transfer runs on gloo's threads: the CPU time is the
    call's work in this thread, the wall time includes waiting for the transfer and the other
    ranks)."""
    dist.barrier()
    gc.disable()
    try:
        start, cpu = time.perf_counter(), time.thread_time()
        fn()
        return time.perf_counter() - start, time.thread_time() - cpu
    finally:
        gc.enable()


def _decoded_floor(tensors: torch.Tensor, names: list[str]) -> Callable[[], Any]:
    """The least an exchange that returns Python strings must do: one ``all_gather_into_tensor``
    of this rank's ``tensors`` (uint8) and its ``names`` (UTF-8, joined by ``"\\x00"``), padded
    to the largest rank's size, then every other rank's names decoded from the bytes it sent
    and one list of all ranks' names made (in rank order; this rank's own list reused).

    Each rank's byte counts are exchanged once here, untimed, and the call's result (the
    received bytes and the list) is checked against every rank's before it is returned.
    """
    encoded = "\x00".join(names).encode()
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [
        [int(v) for v in row]
        for row in _per_rank([tensors.numel(), len(encoded), len(names)]).tolist()
    ]
    width = max(t + n for t, n, _ in sizes)
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[: tensors.numel()] = tensors
    if encoded:
        buf[tensors.numel() : tensors.numel() + len(encoded)] = torch.frombuffer(
            bytearray(encoded), dtype=torch.uint8
        )
    gather = flat_all_gather(buf)

    def call() -> tuple[torch.Tensor, list[str]]:
        out = gather()
        raw = out.numpy()
        every: list[str] = []
        for r, (t, n, count) in enumerate(sizes):
            if r == rank:
                every += names
            elif count:
                start = r * width + t
                every += raw[start : start + n].tobytes().decode().split("\x00")
        return out, every

    sent: list[Any] = [None] * world
    dist.all_gather_object(sent, (tensors.numpy().tobytes(), names))
    out, every = call()
    raw = out.numpy()
    if every != [n for _, theirs in sent for n in theirs] or any(
        raw[r * width : r * width + len(t)].tobytes() != t for r, (t, _) in enumerate(sent)
    ):
        raise AssertionError("the decoded floor did not receive every rank's bytes and names")
    return call


def _placed_floor(
    plain: list[Outputs], indices: list[int], data: tuple[Any, ...]
) -> Callable[[], Any]:
    """The least a tensors-only exchange in dataset order must do: the floor's collective of
    this rank's logits and ids (padded to the largest rank's bytes), then each leaf's rows of
    every rank in one piece and picked into index order, each index once (``cat`` and
    ``index_select``, with the order worked out once here, untimed, from every rank's indices).
    No checks, no row, nothing learned from the bytes. The result is checked against the
    dataset before it is returned."""
    logits = torch.cat([b["logits"] for b in plain])
    ids = torch.cat([b["ids"] for b in plain])
    world = dist.get_world_size()
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (indices, logits.shape[0]))
    width = max(n for _, n in every) * (logits.shape[1] * 4 + 8)
    buf = torch.zeros(width, dtype=torch.uint8)
    split = logits.numel() * 4
    buf[:split] = logits.reshape(-1).view(torch.uint8)
    buf[split : split + ids.numel() * 8] = ids.view(torch.uint8)
    idx = torch.tensor([i for part, _ in every for i in part], dtype=torch.int64)
    ordered, perm = torch.sort(idx, stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    pick = perm[first]
    gather = flat_all_gather(buf)
    tail = logits.shape[1]

    def call() -> dict[str, torch.Tensor]:
        raw = gather().view(world, width)
        parts_l, parts_i = [], []
        for r, (_, n) in enumerate(every):
            parts_l.append(raw[r, : n * tail * 4].view(torch.float32).view(n, tail))
            parts_i.append(raw[r, n * tail * 4 : n * (tail * 4 + 8)].view(torch.int64))
        return {
            "logits": torch.cat(parts_l).index_select(0, pick),
            "ids": torch.cat(parts_i).index_select(0, pick),
        }

    _check(call(), data, ("logits", "ids"))
    return call


def _filler(col: Any, batches: list[Outputs]) -> Callable[[], Any]:
    """A call that resets ``col`` and adds every batch (under ``no_grad``), ready to exchange."""

    def filled() -> Any:
        col.reset()
        with torch.no_grad():
            for out in batches:
                col.add(out)
        return col

    return filled


def _check(result: Any, data: tuple[Any, ...], keys: tuple[str, ...]) -> None:
    """``result`` is ``data`` (its ``keys``): every sample once, in index order."""
    logits, ids, names = data
    if not (
        set(result) == set(keys)
        and torch.equal(result["logits"], logits)
        and torch.equal(result["ids"], ids)
        and ("names" not in keys or result["names"] == names)
    ):
        raise AssertionError("the Collector's result is not the dataset in index order")


def _versus(
    filled: Callable[[], Any], columns: dict[str, Callable[[], Any]], rounds: int
) -> dict[str, Any]:
    """The exchange (``columns["exchange"]``, each call after ``filled()``) against its floors
    (the other columns, ``"floor"`` among them); every figure the slowest rank's.

    Two warm-up passes (plans, the group's buffers, the allocator), then ``rounds`` rounds of
    every column once, in an order rotated from round to round, each call after a barrier with
    the garbage collector off. Returns ``{column}_ms`` (the medians), ``exchange_vs_{floor}``
    for every floor (the medians of the per-round ratios), and ``exchange_cpu_ms`` and
    ``floor_cpu_ms`` (the calling thread's CPU time, medians).
    """
    names = list(columns)
    for _ in range(2):
        for name in names:
            if name == "exchange":
                filled()
            columns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        filled()
        gc.collect()
        k = r % len(names)
        for name in names[k:] + names[:k]:
            wall, spent = _timed_cpu(columns[name])
            times[name].append(wall)
            cpu[name].append(spent)
    figures = {f"{name}_ms": statistics.median(times[name]) * 1e3 for name in names}
    for floor in names[1:]:
        ratios = (e / f for e, f in zip(times["exchange"], times[floor]))
        figures[f"exchange_vs_{floor}"] = statistics.median(ratios)
    for name in ("exchange", "floor"):
        figures[f"{name}_cpu_ms"] = statistics.median(cpu[name]) * 1e3
    return dict(zip(figures, _slowest(list(figures.values()))))


def _tensor_bytes(batches: list[Outputs]) -> torch.Tensor:
    """This rank's logits and ids as one flat uint8 tensor."""
    return torch.cat(
        [b[key].reshape(-1).view(torch.uint8) for key in ("logits", "ids") for b in batches]
    )


def _exchange_row(
    sampler: Any, batches: list[Outputs], data: tuple[Any, ...], rounds: int, profile: bool
) -> dict[str, Any]:
    import treegather as tg
    import treegather.distributed as tgd

    layout = tg.by_path({"names": tg.cat_items()})
    col = tgd.Collector(sampler)
    filled = _filler(col, batches)
    # Checked against the dataset before timing: every sample once, in index order.
    _check(filled().all_gather(layout), data, ("logits", "ids", "names"))
    with counting() as calls:
        filled().all_gather(layout)
    tensors = _tensor_bytes(batches)
    names = [n for b in batches for n in b["names"]]
    names_bytes = len(pickle.dumps(names))
    columns: dict[str, Callable[[], Any]] = {
        "exchange": lambda: col.all_gather(layout),
        "floor": _flat_all_gather(tensors.numel()),
        "floor_names": _flat_all_gather(tensors.numel() + names_bytes),
        "floor_decoded": _decoded_floor(tensors, names),
    }
    row = _versus(filled, columns, rounds)
    row["tensor_mib_per_rank"] = tensors.numel() / 2**20
    row["names_mib_per_rank"] = names_bytes / 2**20
    row["collectives"] = len(calls)
    if profile:
        row["profile"] = _profiled(filled, lambda: col.all_gather(layout), max(3, rounds // 3))
    return row


def _tensors_row(
    sampler: Any, batches: list[Outputs], data: tuple[Any, ...], rounds: int
) -> dict[str, Any]:
    """The same batches without their names, ``col.all_gather()`` with no layout."""
    import treegather.distributed as tgd

    plain = [{"logits": b["logits"], "ids": b["ids"]} for b in batches]
    col = tgd.Collector(sampler)
    filled = _filler(col, plain)
    _check(filled().all_gather(), data, ("logits", "ids"))
    with counting() as calls:
        filled().all_gather()
    floor = _flat_all_gather(sum(b["logits"].nbytes + b["ids"].nbytes for b in plain))
    placed = _placed_floor(plain, [int(i) for i in sampler], data)
    columns = {"exchange": col.all_gather, "floor": floor, "floor_placed": placed}
    row = _versus(filled, columns, rounds)
    row["collectives"] = len(calls)
    return row


def _profiled(fill: Callable[[], Any], call: Callable[[], Any], n: int) -> str | None:
    """cProfile of ``n`` calls on rank 0 (every rank makes them): the top functions, as text."""
    profiler = cProfile.Profile() if dist.get_rank() == 0 else None
    for _ in range(n):
        fill()
        dist.barrier()
        if profiler is not None:
            profiler.enable()
        call()
        if profiler is not None:
            profiler.disable()
    if profiler is None:
        return None
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(20)
    stats.sort_stats("cumulative").print_stats(25)
    return f"{n} calls on rank 0\n" + text.getvalue()


def _add_row(sampler: Any, batches: list[Outputs], rounds: int) -> dict[str, Any]:
    """µs per add (thread CPU time, garbage collector off), the first add of an epoch apart."""
    import treegather.distributed as tgd

    cols = {"add": tgd.Collector(sampler), "add_cpu": tgd.Collector(sampler, device="cpu")}

    def adds(col: Any) -> tuple[float, float]:
        col.reset()
        t0 = time.thread_time()
        col.add(batches[0])  # reads the sampler's order
        t1 = time.thread_time()
        for out in batches[1:]:
            col.add(out)
        return t1 - t0, (time.thread_time() - t1) / max(1, len(batches) - 1)

    def copies() -> tuple[float, float]:
        t0 = time.thread_time()
        for out in batches:
            out["logits"].clone()
            out["ids"].clone()
        return 0.0, (time.thread_time() - t0) / len(batches)

    fns: dict[str, Callable[[], tuple[float, float]]] = {
        "add": lambda: adds(cols["add"]),
        "add_cpu": lambda: adds(cols["add_cpu"]),
        "copy": copies,
    }
    first: dict[str, list[float]] = {name: [] for name in fns}
    each: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    with torch.no_grad():
        for fn in fns.values():
            fn()
        for r in range(rounds):
            gc.collect()
            gc.disable()
            try:
                for name in names[r % 3 :] + names[: r % 3]:
                    f, e = fns[name]()
                    first[name].append(f)
                    each[name].append(e)
            finally:
                gc.enable()
    slowest = _slowest(
        [statistics.median(each[n]) * 1e6 for n in names]
        + [statistics.median(first[n]) * 1e6 for n in ("add", "add_cpu")]
    )
    row = {f"{name}_us": us for name, us in zip(names, slowest)}
    row["first_add_us"], row["first_add_cpu_us"] = slowest[3:]
    row["adds"] = len(batches)
    return row


def _sync_grads_row(batch: int, rounds: int) -> dict[str, Any]:
    import treegather as tg
    import treegather.distributed as tgd

    rank = dist.get_rank()
    layout = tg.by_path({"names": tg.cat_items()})
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 10)
    x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(rank))
    ids = torch.arange(batch) + rank * batch
    names = [f"sample-{int(i):06d}" for i in ids]

    def tree() -> Outputs:
        return {"logits": lin(x), "ids": ids, "names": names}

    def forward(sync: bool) -> Any:
        return tgd.all_gather(tree(), layout, sync_grads=sync)

    def backward() -> None:
        lin.zero_grad()
        forward(True)["logits"].pow(2).sum().backward()

    for _ in range(2):
        forward(True)
        forward(False)
        backward()
    with counting() as fwd_sync:
        out = forward(True)
    loss = out["logits"].pow(2).sum()
    with counting() as bwd:
        loss.backward()
    with counting() as fwd_plain:
        forward(False)
    times: dict[str, list[float]] = {"forward_sync": [], "forward_plain": [], "step_sync": []}
    for _ in range(rounds):
        gc.collect()
        times["forward_sync"].append(_timed(lambda: forward(True)))
        times["forward_plain"].append(_timed(lambda: forward(False)))
        times["step_sync"].append(_timed(backward))
    slowest = _slowest([statistics.median(t) * 1e3 for t in times.values()])
    row: dict[str, Any] = {f"{name}_ms": ms for name, ms in zip(times, slowest)}
    row["forward_sync_collectives"] = fwd_sync
    row["forward_plain_collectives"] = fwd_plain
    row["backward_collectives"] = bwd
    return row


def measure(
    samples: int = 10_000, *, batch: int = 64, rounds: int = 25, profile: bool = False
) -> dict[str, Any]:
    """Measure the four parts in the process group this process is in (every rank calls it).

    What :func:`run` does on each spawned rank; the figures are the slowest rank's, the same on
    every rank (the profile is rank 0's: ``None`` elsewhere). Arguments as for :func:`run`.
    """
    from torch.utils.data import DistributedSampler, TensorDataset

    data = _dataset(samples)
    sampler: DistributedSampler[Any] = DistributedSampler(TensorDataset(data[1]), shuffle=False)
    batches = _batches(list(sampler), batch, data)
    world = dist.get_world_size()
    result: dict[str, Any] = {"samples": samples, "batch": batch, "world": world}
    result["rounds"] = rounds
    # Every object made so far (imports, the dataset) out of the collections' scans: each round
    # collects garbage before its timed calls, which then scans only what the rounds made.
    gc.collect()
    gc.freeze()
    try:
        result["exchange"] = _exchange_row(sampler, batches, data, rounds, profile)
        result["exchange_tensors"] = _tensors_row(sampler, batches, data, rounds)
        result["add"] = _add_row(sampler, batches, rounds)
        result["sync_grads"] = _sync_grads_row(batch, rounds)
    finally:
        gc.unfreeze()
    return result


def _worker(
    rank: int,
    world: int,
    port: int,
    samples: int,
    batch: int,
    rounds: int,
    profile: bool,
    out: str,
) -> None:
    init_rank(rank, world, port)
    try:
        result = measure(samples, batch=batch, rounds=rounds, profile=profile)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run(
    samples: int = 10_000,
    *,
    batch: int = 64,
    world: int = 2,
    rounds: int = 25,
    profile: bool = False,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Spawn ``world`` gloo ranks on localhost and measure the four parts.

    Args:
        samples: The dataset's size (each rank evaluates its ``DistributedSampler`` share).
        batch: Samples per batch (per add).
        world: How many ranks to spawn.
        rounds: Interleaved rounds per measurement.
        profile: Also profile rank 0's final exchanges (``result["exchange"]["profile"]``).
        timeout_s: Kill the ranks if they have not finished by then.

    Returns:
        ``samples``, ``batch``, ``world``, ``rounds`` and four dicts: ``exchange``
        (``exchange_ms``, ``floor_ms``, ``floor_names_ms``, ``floor_decoded_ms``,
        ``exchange_vs_floor``, ``exchange_vs_floor_names``, ``exchange_vs_floor_decoded``,
        ``exchange_cpu_ms`` and ``floor_cpu_ms`` (the calling thread's CPU time),
        ``tensor_mib_per_rank``, ``names_mib_per_rank``, ``collectives``, and with ``profile``
        ``profile``), ``exchange_tensors`` (the outputs without names: ``exchange_ms``,
        ``floor_ms``, ``exchange_vs_floor``, ``floor_placed_ms``, ``exchange_vs_floor_placed``,
        ``exchange_cpu_ms``, ``floor_cpu_ms``, ``collectives``), ``add`` (``add_us``, ``add_cpu_us``, ``copy_us`` per batch,
        ``first_add_us``, ``first_add_cpu_us``, ``adds``) and ``sync_grads``
        (``forward_sync_ms``, ``forward_plain_ms``, ``step_sync_ms``, and the collectives' names
        in ``forward_sync_collectives``, ``forward_plain_collectives``,
        ``backward_collectives``). Times are the slowest rank's.
    """
    result: dict[str, Any] = spawn(_worker, world, (samples, batch, rounds, profile), timeout_s)
    return result


def format_table(result: dict[str, Any]) -> str:
    """Render :func:`run`'s result as three Markdown tables (the final exchanges, one add,
    ``sync_grads``).

    Example:
        >>> result = {"samples": 10000, "batch": 64, "world": 2, "rounds": 25,
        ...     "exchange": {"exchange_ms": 2.0, "floor_ms": 1.0, "floor_names_ms": 1.5,
        ...         "floor_decoded_ms": 1.6, "exchange_vs_floor": 2.0,
        ...         "exchange_vs_floor_names": 1.3, "exchange_vs_floor_decoded": 1.25,
        ...         "tensor_mib_per_rank": 0.23, "names_mib_per_rank": 0.07, "collectives": 2,
        ...         "exchange_cpu_ms": 1.2, "floor_cpu_ms": 0.1},
        ...     "exchange_tensors": {"exchange_ms": 1.4, "floor_ms": 1.0, "exchange_vs_floor": 1.4,
        ...         "floor_placed_ms": 1.2, "exchange_vs_floor_placed": 1.17,
        ...         "exchange_cpu_ms": 0.5, "floor_cpu_ms": 0.1, "collectives": 1},
        ...     "add": {"add_us": 3.0, "add_cpu_us": 9.0, "copy_us": 4.0, "first_add_us": 90.0,
        ...         "first_add_cpu_us": 95.0, "adds": 79},
        ...     "sync_grads": {"forward_sync_ms": 1.1, "forward_plain_ms": 1.0,
        ...         "step_sync_ms": 2.5, "forward_sync_collectives": ["all_gather_into_tensor"],
        ...         "forward_plain_collectives": ["all_gather_into_tensor"],
        ...         "backward_collectives": ["all_reduce"]}}
        >>> print(format_table(result))  # doctest: +NORMALIZE_WHITESPACE
        Collector evaluation: 10000 samples, batches of 64, 2 gloo ranks, 25 rounds
        | final exchange | time | floor (tensor bytes) | x floor | floor + pickled names | x floor + names | floor + decoded names | x floor + decoded | floor + dataset order | x floor + order | collectives | CPU ms in the calling thread (exchange / floor) |
        |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|
        | logits, ids, names | 2.00 ms | 1.00 ms | 2.00x | 1.50 ms | 1.30x | 1.60 ms | 1.25x | - | - | 2 | 1.20 / 0.10 |
        | logits, ids (no layout) | 1.40 ms | 1.00 ms | 1.40x | - | - | - | - | 1.20 ms | 1.17x | 1 | 0.50 / 0.10 |
        <BLANKLINE>
        | add (no_grad) | add (device="cpu") | copy of the batch | first add (reads the sampler) | adds per rank |
        |---:|---:|---:|---:|---:|
        | 3.0 µs | 9.0 µs | 4.0 µs | 90 µs / 95 µs | 79 |
        <BLANKLINE>
        | all_gather(sync_grads=True) | forward collectives | without sync_grads | backward collectives | forward | without | forward + backward |
        |---|---:|---:|---:|---:|---:|---:|
        | one batch | 1 | 1 | 1 (all_reduce) | 1.10 ms | 1.00 ms | 2.50 ms |
    """
    ex, tensors = result["exchange"], result["exchange_tensors"]
    add, sg = result["add"], result["sync_grads"]

    def exchange(what: str, row: dict[str, Any], names: str) -> str:
        return (
            f"| {what} | {row['exchange_ms']:.2f} ms | {row['floor_ms']:.2f} ms "
            f"| {row['exchange_vs_floor']:.2f}x | {names} | {row['collectives']} "
            f"| {row['exchange_cpu_ms']:.2f} / {row['floor_cpu_ms']:.2f} |"
        )

    lines = [
        f"Collector evaluation: {result['samples']} samples, batches of {result['batch']}, "
        f"{result['world']} gloo ranks, {result['rounds']} rounds",
        "| final exchange | time | floor (tensor bytes) | x floor | floor + pickled names "
        "| x floor + names | floor + decoded names | x floor + decoded | floor + dataset order "
        "| x floor + order | collectives | CPU ms in the calling thread (exchange / floor) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        exchange(
            "logits, ids, names",
            ex,
            f"{ex['floor_names_ms']:.2f} ms | {ex['exchange_vs_floor_names']:.2f}x "
            f"| {ex['floor_decoded_ms']:.2f} ms | {ex['exchange_vs_floor_decoded']:.2f}x | - | -",
        ),
        exchange(
            "logits, ids (no layout)",
            tensors,
            " | ".join(["-"] * 4)
            + f" | {tensors['floor_placed_ms']:.2f} ms | {tensors['exchange_vs_floor_placed']:.2f}x",
        ),
        "",
        '| add (no_grad) | add (device="cpu") | copy of the batch '
        "| first add (reads the sampler) | adds per rank |",
        "|---:|---:|---:|---:|---:|",
        f"| {add['add_us']:.1f} µs | {add['add_cpu_us']:.1f} µs | {add['copy_us']:.1f} µs "
        f"| {add['first_add_us']:.0f} µs / {add['first_add_cpu_us']:.0f} µs | {add['adds']} |",
        "",
        "| all_gather(sync_grads=True) | forward collectives | without sync_grads "
        "| backward collectives | forward | without | forward + backward |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| one batch | {len(sg['forward_sync_collectives'])} "
        f"| {len(sg['forward_plain_collectives'])} | {len(sg['backward_collectives'])} "
        f"({', '.join(sg['backward_collectives']) or 'none'}) | {sg['forward_sync_ms']:.2f} ms "
        f"| {sg['forward_plain_ms']:.2f} ms | {sg['step_sync_ms']:.2f} ms |",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: run the benchmark and print the tables."""
    parser = argparse.ArgumentParser(
        prog="python -m treegather.benchmarks.evaluation",
        description="Benchmark a treegather.distributed.Collector evaluation on gloo ranks: the "
        "final exchange against one all-gather of the same bytes, one add, and the collectives "
        "of all_gather(sync_grads=True).",
    )
    parser.add_argument("--samples", type=int, default=10_000, help="dataset size (10000)")
    parser.add_argument("--batch", type=int, default=64, help="samples per batch (64)")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks to spawn (2)")
    parser.add_argument("--rounds", type=int, default=25, help="interleaved rounds (25)")
    parser.add_argument(
        "--profile", action="store_true", help="print a cProfile of rank 0's final exchanges"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    result = run(
        args.samples,
        batch=args.batch,
        world=args.world,
        rounds=args.rounds,
        profile=args.profile,
    )
    print(format_table(result))
    if result["exchange"].get("profile"):
        print("\nprofile of the final exchange:\n" + result["exchange"]["profile"])
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
