"""Benchmark a :class:`treegather.distributed.Collector` evaluation on gloo ranks.

Run ``python -m treegather.benchmarks.evaluation`` (options: ``--samples 10001``, ``--batch 64``,
``--world 2``, ``--rounds 25``, ``--profile``, ``--json PATH``). It spawns ``world`` gloo ranks on
localhost, as :mod:`treegather.benchmarks.distributed` does. Each rank evaluates its share of a
dataset of ``samples`` samples under ``DistributedSampler(shuffle=False)`` (padded: 10,001 do not
split evenly), in batches of ``batch``, each batch's outputs ``{"logits": [B, 10] float32,
"labels": [B] int64, "index": [B] int64, "ids": B strs}``, made before any timing (no model
runs). It measures:

- **an evaluation's gathering**, from the first batch's outputs to every sample once, in
  dataset order, on every rank, side by side in one run:

  - ``treegather``: a ``Collector()``, one ``add(outputs, indices=outputs["index"])`` per
    batch (the batch's own indices, as the peers take them), ``all_gather`` (the adds and the
    exchange timed together);
  - ``torchmetrics``: the way torchmetrics' ``Metric`` syncs its states (where torchmetrics is
    installed): each tensor concatenated locally, ``gather_all_tensors`` each, the ids by
    ``all_gather_object``, then the rows put in dataset order by the gathered indices, padding
    duplicates dropped (a stable sort);
  - ``accelerate``: ``Accelerator.gather_for_metrics`` of every batch as it comes (tensors, then
    the ids, where accelerate is installed), then the same dataset order;
  - ``floor``: the least any such exchange does: one ``all_gather_into_tensor`` of this rank's
    tensor bytes and its ids' UTF-8 bytes (padded to the largest rank's size), every other
    rank's ids decoded, the rows picked into dataset order (the order, the sizes and the rows'
    places worked out once beforehand, untimed; no checks; this rank's batches joined into the
    bytes it sends beforehand, untimed, too);
  - ``floor_joined``: the floor, with this rank's batches joined into the bytes it sends in
    the call (each tensor's batches concatenated, the ids encoded), as every other
    implementation, which starts from the batches in hand, must.

  Every result is checked against the dataset before timing. Each round times every
  implementation once, in an order rotated from round to round, each call after a barrier with
  the garbage collector off; the ratios are the medians of the per-round ratios, every figure
  the slowest rank's; the calling thread's CPU time tells the call's own work from the wait.
  ``--profile`` adds a cProfile of rank 0's Collector evaluations.
- **one add** (``col.add(outputs)`` under ``torch.no_grad()``; and with ``Collector(sampler,
  device="cpu")``), in µs of this thread's CPU time per add, the garbage collector off, next to
  the cost of copying the batch (``clone()`` of its tensors), and the first add of an epoch
  (which reads the sampler's indices) on its own.
- **sync_grads**: the collectives that ``tgd.all_gather(tree, sync_grads=True)`` of one batch
  (the logits made by a linear layer, so they require grad) makes in the forward, against the
  same call without ``sync_grads``, and in the backward of a loss over the result, counted by
  wrapping ``torch.distributed``'s functions (:func:`~treegather.benchmarks.distributed.counting`);
  with each one's median wall time.

The targets (issue 28): treegather at most 0.5x the best peer and 2.0x the floor.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from itertools import chain
from operator import itemgetter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .distributed import counting, flat_all_gather, init_rank, spawn

__all__ = ["run", "measure", "format_table", "main"]

Outputs = dict[str, Any]


def _dataset(samples: int) -> Outputs:
    g = torch.Generator().manual_seed(0)
    return {
        "logits": torch.randn(samples, 10, generator=g),
        "labels": torch.randint(0, 10, (samples,), generator=g),
        "index": torch.arange(samples),
        "ids": [f"sample-{i:06d}" for i in range(samples)],
    }


def _batches(order: list[int], batch: int, data: Outputs) -> list[Outputs]:
    out = []
    for start in range(0, len(order), batch):
        chunk = order[start : start + batch]
        idx = torch.tensor(chunk)
        rows = {key: data[key][idx] for key in TENSORS}
        out.append({**rows, "ids": [data["ids"][i] for i in chunk]})
    return out


TENSORS = ("logits", "labels", "index")


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


def _in_order(parts: dict[str, Any], index: torch.Tensor) -> Outputs:
    """Every rank's rows (one after the other) in dataset order, each index once: what the
    peers do after gathering (a stable sort of the gathered indices, the first of each kept)."""
    ordered, perm = torch.sort(index, stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    pick = perm[first]
    out: Outputs = {key: parts[key].index_select(0, pick) for key in TENSORS}
    out["ids"] = list(itemgetter(*pick.tolist())(parts["ids"]))
    return out


def _collector(sampler: Any, batches: list[Outputs]) -> Callable[[], Any]:
    import treegather as tg
    import treegather.distributed as tgd

    layout = tg.by_path({"ids": tg.cat_items()})

    def call() -> Any:
        col = tgd.Collector()
        with torch.no_grad():
            for out in batches:  # (each batch's own indices, as the peers take them)
                col.add(out, indices=out["index"])
        return col.all_gather(layout)

    return call


def _torchmetrics(batches: list[Outputs]) -> Callable[[], Any] | None:
    """torchmetrics' way (``Metric`` states of tensors and of lists): local cat, then
    ``gather_all_tensors`` per tensor (sizes first, then padded) and ``all_gather_object``."""
    try:
        from torchmetrics.utilities.distributed import gather_all_tensors
    except ImportError:
        return None
    world = dist.get_world_size()

    def call() -> Outputs:
        parts: dict[str, Any] = {}
        for key in TENSORS:
            local = torch.cat([b[key] for b in batches])
            parts[key] = torch.cat(gather_all_tensors(local))
        every: list[Any] = [None] * world
        dist.all_gather_object(every, [i for b in batches for i in b["ids"]])
        parts["ids"] = list(chain.from_iterable(every))
        return _in_order(parts, parts["index"])

    return call


def _accelerate(batches: list[Outputs]) -> Callable[[], Any] | None:
    """accelerate's way: ``gather_for_metrics`` of every batch as it comes."""
    try:
        from accelerate import Accelerator
    except ImportError:
        return None
    accelerator = Accelerator(cpu=True)  # (the gloo group already initialised)

    def call() -> Outputs:
        got: dict[str, list[Any]] = {key: [] for key in (*TENSORS, "ids")}
        for b in batches:
            tensors = accelerator.gather_for_metrics(tuple(b[key] for key in TENSORS))
            for key, t in zip(TENSORS, tensors):
                got[key].append(t)
            got["ids"] += accelerator.gather_for_metrics(b["ids"], use_gather_object=True)
        parts: dict[str, Any] = {key: torch.cat(got[key]) for key in TENSORS}
        parts["ids"] = got["ids"]
        return _in_order(parts, parts["index"])

    return call


def _floor(batches: list[Outputs], joined: bool = False) -> Callable[[], Any]:
    """One ``all_gather_into_tensor`` of this rank's tensor bytes and ids (UTF-8, joined by
    ``"\x00"``), padded to the largest rank's; every other rank's ids decoded; the rows picked
    into dataset order. Sizes, places and the order are worked out here, untimed; so are this
    rank's batches joined into the bytes sent, unless ``joined`` (then each call joins them)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = [i for b in batches for i in b["ids"]]

    def fill(buf: torch.Tensor) -> list[str]:  # this rank's batches, joined into its bytes
        local = [torch.cat([b[key] for b in batches]) for key in TENSORS]
        tensors = torch.cat([t.reshape(-1).view(torch.uint8) for t in local])
        own = [i for b in batches for i in b["ids"]]
        encoded = "\x00".join(own).encode()
        buf[: tensors.numel()] = tensors
        if encoded:
            buf[tensors.numel() : tensors.numel() + len(encoded)] = torch.frombuffer(
                bytearray(encoded), dtype=torch.uint8
            )
        return own

    encoded_size = len("\x00".join(ids).encode())
    sizes = [[int(v) for v in row] for row in _per_rank([len(ids), encoded_size]).tolist()]
    width = -(-max(n * 56 + m for n, m in sizes) // 8) * 8  # 10 float32, 2 int64, the ids
    buf = torch.zeros(width, dtype=torch.uint8)
    fill(buf)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, torch.cat([b["index"] for b in batches]))
    index = torch.cat(every)
    ordered, perm = torch.sort(index, stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    pick, picked = perm[first], perm[first].tolist()
    gather = flat_all_gather(buf)

    def call() -> Outputs:
        own = fill(buf) if joined else ids
        raw = gather().view(world, width)
        parts: dict[str, list[torch.Tensor]] = {key: [] for key in TENSORS}
        names: list[str] = []
        for r, (n, m) in enumerate(sizes):
            row = raw[r]
            parts["logits"].append(row[: n * 40].view(torch.float32).view(n, 10))
            parts["labels"].append(row[n * 40 : n * 48].view(torch.int64))
            parts["index"].append(row[n * 48 : n * 56].view(torch.int64))
            if r == rank:
                names += own
            elif n:
                names += row[n * 56 : n * 56 + m].numpy().tobytes().decode().split("\x00")
        out: Outputs = {key: torch.cat(parts[key]).index_select(0, pick) for key in TENSORS}
        out["ids"] = list(itemgetter(*picked)(names))
        return out

    return call


def _check(result: Any, data: Outputs) -> None:
    """``result`` is ``data``: every sample once, in index order."""
    same = set(result) == set(data) and result["ids"] == data["ids"]
    if not (same and all(torch.equal(result[key], data[key]) for key in TENSORS)):
        raise AssertionError("an evaluation's result is not the dataset in index order")


def _peers_row(
    sampler: Any, batches: list[Outputs], data: Outputs, rounds: int, profile: bool
) -> dict[str, Any]:
    """Every implementation's evaluation, side by side; each checked against the dataset."""
    found = {
        "treegather": _collector(sampler, batches),
        "torchmetrics": _torchmetrics(batches),
        "accelerate": _accelerate(batches),
        "floor": _floor(batches),
        "floor_joined": _floor(batches, joined=True),
    }
    calls = {name: fn for name, fn in found.items() if fn is not None}
    counted: dict[str, int] = {}
    for name, fn in calls.items():
        _check(fn(), data)
        with counting() as made:
            fn()
        counted[name] = len(made)
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        gc.collect()
        k = r % len(names)
        for name in names[k:] + names[:k]:
            wall, spent = _timed_cpu(calls[name])
            times[name].append(wall)
            cpu[name].append(spent)
    figures: dict[str, float] = {}
    for name in names:
        figures[f"{name}_ms"] = statistics.median(times[name]) * 1e3
        figures[f"{name}_cpu_ms"] = statistics.median(cpu[name]) * 1e3
        per_round = (t / f for t, f in zip(times["treegather"], times[name]))
        figures[f"treegather_vs_{name}"] = statistics.median(per_round)
    row: dict[str, Any] = dict(zip(figures, _slowest(list(figures.values()))))
    row["implementations"] = names
    row["collectives"] = counted
    row["missing"] = [name for name, fn in found.items() if fn is None]
    if profile:
        row["profile"] = _profiled(calls["treegather"], max(3, rounds // 3))
    return row


def _profiled(call: Callable[[], Any], n: int) -> str | None:
    """cProfile of ``n`` calls on rank 0 (every rank makes them): the top functions, as text."""
    profiler = cProfile.Profile() if dist.get_rank() == 0 else None
    for _ in range(n):
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
            for key in TENSORS:
                out[key].clone()
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


def _sync_grads_row(batch: int, rounds: int, device: str = "cpu") -> dict[str, Any]:
    """The ``sync_grads`` row: the logits of a linear layer on ``device`` (each timed call
    waits for a CUDA device), their ids and names, gathered with and without ``sync_grads``."""
    import treegather as tg
    import treegather.distributed as tgd

    rank = dist.get_rank()
    layout = tg.by_path({"names": tg.cat_items()})
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 10).to(device)
    x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(rank)).to(device)
    ids = torch.arange(batch) + rank * batch
    names = [f"sample-{int(i):06d}" for i in ids]
    ids = ids.to(device)
    wait = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None

    def tree() -> Outputs:
        return {"logits": lin(x), "ids": ids, "names": names}

    def forward(sync: bool) -> Any:
        out = tgd.all_gather(tree(), layout, sync_grads=sync)
        wait()
        return out

    def backward() -> None:
        lin.zero_grad()
        forward(True)["logits"].pow(2).sum().backward()
        wait()

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
    samples: int = 10_001, *, batch: int = 64, rounds: int = 25, profile: bool = False
) -> dict[str, Any]:
    """Measure the four parts in the process group this process is in (every rank calls it).

    What :func:`run` does on each spawned rank; the figures are the slowest rank's, the same on
    every rank (the profile is rank 0's: ``None`` elsewhere). Arguments as for :func:`run`.
    """
    from torch.utils.data import DistributedSampler, TensorDataset

    data = _dataset(samples)
    index = TensorDataset(data["index"])
    sampler: DistributedSampler[Any] = DistributedSampler(index, shuffle=False)
    batches = _batches(list(sampler), batch, data)
    world = dist.get_world_size()
    result: dict[str, Any] = {"samples": samples, "batch": batch, "world": world}
    result["rounds"] = rounds
    # Every object made so far (imports, the dataset) out of the collections' scans: each round
    # collects garbage before its timed calls, which then scans only what the rounds made.
    gc.collect()
    gc.freeze()
    try:
        result["evaluation"] = _peers_row(sampler, batches, data, rounds, profile)
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
    samples: int = 10_001,
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
        profile: Also profile rank 0's Collector evaluations (``["evaluation"]["profile"]``).
        timeout_s: Kill the ranks if they have not finished by then.

    Returns:
        ``samples``, ``batch``, ``world``, ``rounds`` and three dicts: ``evaluation``
        (per implementation ``{name}_ms``, ``{name}_cpu_ms`` (the calling thread's CPU time)
        and ``treegather_vs_{name}``; ``implementations`` (those measured), ``missing`` (peers
        not installed), ``collectives`` (per implementation), and with ``profile`` ``profile``),
        ``add`` (``add_us``, ``add_cpu_us``, ``copy_us`` per batch, ``first_add_us``,
        ``first_add_cpu_us``, ``adds``) and ``sync_grads`` (``forward_sync_ms``,
        ``forward_plain_ms``, ``step_sync_ms``, and the collectives' names in
        ``forward_sync_collectives``, ``forward_plain_collectives``, ``backward_collectives``).
        Times are the slowest rank's.
    """
    result: dict[str, Any] = spawn(_worker, world, (samples, batch, rounds, profile), timeout_s)
    return result


LABELS = {
    "treegather": "treegather Collector",
    "torchmetrics": "torchmetrics-style (gather_all_tensors, all_gather_object)",
    "accelerate": "accelerate gather_for_metrics per batch",
    "floor": "floor (one collective, ids decoded, rows picked)",
    "floor_joined": "floor, this rank's batches joined in the call",
}


def format_table(result: dict[str, Any]) -> str:
    """Render :func:`run`'s result as three Markdown tables (the evaluations, one add,
    ``sync_grads``).

    Example:
        >>> result = {"samples": 10001, "batch": 64, "world": 2, "rounds": 25,
        ...     "evaluation": {"implementations": ["treegather", "floor"],
        ...         "missing": ["torchmetrics", "accelerate"],
        ...         "collectives": {"treegather": 1, "floor": 1},
        ...         "treegather_ms": 3.0, "treegather_cpu_ms": 2.0, "treegather_vs_treegather": 1.0,
        ...         "floor_ms": 2.0, "floor_cpu_ms": 1.0, "treegather_vs_floor": 1.5},
        ...     "add": {"add_us": 3.0, "add_cpu_us": 9.0, "copy_us": 4.0, "first_add_us": 90.0,
        ...         "first_add_cpu_us": 95.0, "adds": 79},
        ...     "sync_grads": {"forward_sync_ms": 1.1, "forward_plain_ms": 1.0,
        ...         "step_sync_ms": 2.5, "forward_sync_collectives": ["all_gather_into_tensor"],
        ...         "forward_plain_collectives": ["all_gather_into_tensor"],
        ...         "backward_collectives": ["all_reduce"]}}
        >>> print(format_table(result))  # doctest: +NORMALIZE_WHITESPACE
        Collector evaluation: 10001 samples, batches of 64, 2 gloo ranks, 25 rounds
        | evaluation (adds + exchange) | time | treegather / it | collectives | CPU ms in the calling thread |
        |---|---:|---:|---:|---:|
        | treegather Collector | 3.00 ms | 1.00x | 1 | 2.00 |
        | floor (one collective, ids decoded, rows picked) | 2.00 ms | 1.50x | 1 | 1.00 |
        not installed: torchmetrics, accelerate
        <BLANKLINE>
        | add (no_grad) | add (device="cpu") | copy of the batch | first add (reads the sampler) | adds per rank |
        |---:|---:|---:|---:|---:|
        | 3.0 µs | 9.0 µs | 4.0 µs | 90 µs / 95 µs | 79 |
        <BLANKLINE>
        | all_gather(sync_grads=True) | forward collectives | without sync_grads | backward collectives | forward | without | forward + backward |
        |---|---:|---:|---:|---:|---:|---:|
        | one batch | 1 | 1 | 1 (all_reduce) | 1.10 ms | 1.00 ms | 2.50 ms |
    """
    ev, add, sg = result["evaluation"], result["add"], result["sync_grads"]
    lines = [
        f"Collector evaluation: {result['samples']} samples, batches of {result['batch']}, "
        f"{result['world']} gloo ranks, {result['rounds']} rounds",
        "| evaluation (adds + exchange) | time | treegather / it | collectives "
        "| CPU ms in the calling thread |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ev["implementations"]:
        lines.append(
            f"| {LABELS[name]} | {ev[f'{name}_ms']:.2f} ms | {ev[f'treegather_vs_{name}']:.2f}x "
            f"| {ev['collectives'][name]} | {ev[f'{name}_cpu_ms']:.2f} |"
        )
    if ev["missing"]:
        lines.append(f"not installed: {', '.join(ev['missing'])}")
    lines += [
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
        description="Benchmark a treegather.distributed.Collector evaluation on gloo ranks "
        "against torchmetrics' and accelerate's ways and the floor, one add, and the "
        "collectives of all_gather(sync_grads=True).",
    )
    parser.add_argument("--samples", type=int, default=10_001, help="dataset size (10001)")
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
    if result["evaluation"].get("profile"):
        print("\nprofile of the Collector's evaluation:\n" + result["evaluation"]["profile"])
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
