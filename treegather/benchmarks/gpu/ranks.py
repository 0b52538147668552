"""The GPU check's distributed stage: two gloo ranks sharing the plan's device.

Each rank (spawned by :func:`~treegather.benchmarks.distributed.spawn`) holds its tensors on
the device (``cuda:0`` for both ranks on the chip: gloo lets ranks share a GPU, NCCL needs one
per rank) and runs, each result checked first:

- ``tgd.all_gather`` of trees of 10, 100 and 1000 ragged ``[8 - (r + i) % 2, 4]`` leaves
  against one collective of the payload's bytes (:mod:`treegather.benchmarks.distributed`'s
  floor), the collectives of a repeated call counted;
- ``all_gather(sync_grads=True)``: each rank's gradient checked (``world`` times the local
  loss's), then the forward with and without ``sync_grads`` and a step
  (:mod:`treegather.benchmarks.evaluation`'s ``sync_grads`` row);
- a ``Collector`` evaluation of a ``DistributedSampler``'s shares (the evaluation benchmark's
  dataset and batches, on the device), checked against the dataset.

A rank that fails writes its traceback to ``ranks/rank<r>.txt`` in the output folder.
"""

from __future__ import annotations

import json
import statistics
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import evaluation
from ..distributed import _floor, _interleaved_ms, _small_tree, counting, init_rank, spawn
from .plan import Found, Plan, Row, StageFailed

__all__ = ["distributed"]

WORLD = 2
NCCL_NOTE = (
    "gloo ranks sharing one device: NCCL needs a chip per rank, so this one-GPU check runs "
    "gloo (treegather moves the payload through the host), and NCCL is not measured"
)


def distributed(plan: Plan, out: Path) -> Found:
    """Spawn the two ranks and collect rank 0's rows (the slowest rank's times)."""
    errors = out / "ranks"
    errors.mkdir(exist_ok=True)
    for old in errors.glob("rank*.txt"):
        old.unlink()
    args = (
        plan.device,
        plan.dist_leaves,
        plan.dist_repeats,
        plan.eval_samples,
        plan.eval_batch,
        plan.rounds,
        str(errors),
    )
    try:
        rows: list[Row] = spawn(_worker, WORLD, args, plan.ranks_timeout_s)
    except RuntimeError as e:
        told = [p.read_text()[-1500:] for p in sorted(errors.glob("rank*.txt"))]
        raise StageFailed("\n".join([str(e), *told])) from e
    where = f"{WORLD} gloo ranks on {plan.device}"
    notes = [
        f"{where}, every result checked first; times are the slowest rank's medians "
        f"({plan.dist_repeats} calls for all_gather, {plan.rounds} for the rest)",
        NCCL_NOTE,
    ]
    worst = max(r["x floor"] for r in rows if r.get("x floor") is not None)
    summary = f"{where}: all_gather up to {worst:.1f}x the floor; sync_grads and Collector checked"
    return Found(rows, summary, notes)


def _worker(
    rank: int,
    world: int,
    port: int,
    device: str,
    leaves: tuple[int, ...],
    repeats: int,
    samples: int,
    batch: int,
    rounds: int,
    errors: str,
    out: str,
) -> None:
    init_rank(rank, world, port)
    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        rows = [_all_gather_row(n, dev, repeats) for n in leaves]
        rows += _sync_grads_rows(dev, batch, rounds)
        rows.append(_collector_row(dev, samples, batch, rounds))
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _waiting(fn: Callable[[], Any], dev: torch.device) -> Callable[[], Any]:
    """``fn``, then wait for ``dev`` when it is a CUDA device."""
    if dev.type != "cuda":
        return fn

    def run() -> Any:
        got = fn()
        torch.cuda.synchronize(dev)
        return got

    return run


def _on(tree: dict[str, Any], dev: torch.device) -> dict[str, Any]:
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in tree.items()}


def _check(got: dict[str, Any], want: dict[str, Any], dev: torch.device, what: str) -> None:
    if list(got) != list(want):
        raise AssertionError(f"{what}: keys {list(got)[:5]}... differ from {list(want)[:5]}...")
    for key, value in want.items():
        g = got[key]
        if isinstance(value, torch.Tensor):
            if g.device.type != dev.type or not torch.equal(g.cpu(), value.cpu()):
                raise AssertionError(f"{what}: {key!r} differs (on {g.device}, expected {dev})")
        elif g != value:
            raise AssertionError(f"{what}: {key!r} differs")


def _all_gather_row(n: int, dev: torch.device, repeats: int) -> Row:
    import treegather as tg
    import treegather.distributed as tgd

    world = dist.get_world_size()
    tree = _on(_small_tree(dist.get_rank(), n), dev)
    want = tg.gather([_on(_small_tree(r, n), dev) for r in range(world)], dev)
    _check(tgd.all_gather(tree), want, dev, f"all_gather of {n} leaves")
    with counting() as calls:
        tgd.all_gather(tree)
    columns: dict[str, tuple[Callable[[], Any], int]] = {
        "floor": (_floor(tree), repeats),
        "treegather": (_waiting(lambda: tgd.all_gather(tree), dev), repeats),
    }
    for fn, _ in columns.values():
        for _ in range(2):
            fn()  # warm-up: the wire plan, allocator state
    medians, ratios = _interleaved_ms(columns)
    return {
        "call": f"all_gather, {n} leaves",
        "ms": medians["treegather"],
        "floor ms": medians["floor"],
        "x floor": ratios["floor"],
        "collectives": len(calls),
    }


def _sync_grads_rows(dev: torch.device, batch: int, rounds: int) -> list[Row]:
    import treegather.distributed as tgd

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank)).to(dev)
    x.requires_grad_()
    tgd.all_gather({"x": x}, sync_grads=True)["x"].pow(2).sum().backward()
    if x.grad is None or not torch.allclose(x.grad, 2 * world * x.detach()):
        raise AssertionError(
            "all_gather(sync_grads=True): the gradient is not world x the local one"
        )
    got = evaluation._sync_grads_row(batch, rounds, str(dev))
    return [
        {
            "call": "all_gather(sync_grads=True), forward",
            "ms": got["forward_sync_ms"],
            "collectives": len(got["forward_sync_collectives"]),
        },
        {
            "call": "all_gather (same tree, no sync_grads), forward",
            "ms": got["forward_plain_ms"],
            "collectives": len(got["forward_plain_collectives"]),
        },
        {
            "call": "all_gather(sync_grads=True), forward + backward",
            "ms": got["step_sync_ms"],
            "collectives": len(got["forward_sync_collectives"]) + len(got["backward_collectives"]),
        },
    ]


def _collector_row(dev: torch.device, samples: int, batch: int, rounds: int) -> Row:
    from torch.utils.data import DistributedSampler, TensorDataset

    data = evaluation._dataset(samples)
    sampler: DistributedSampler[Any] = DistributedSampler(
        TensorDataset(data["index"]), shuffle=False
    )
    batches = [_on(b, dev) for b in evaluation._batches(list(sampler), batch, data)]
    call = _waiting(evaluation._collector(sampler, batches), dev)
    _check(call(), data, dev, "the Collector's evaluation")
    with counting() as calls:
        call()
    times = [evaluation._timed(call) for _ in range(rounds)]
    return {
        "call": f"Collector evaluation, {samples} samples in batches of {batch}",
        "ms": evaluation._slowest([statistics.median(times) * 1e3])[0],
        "collectives": len(calls),
    }
