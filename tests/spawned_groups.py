"""Spawned gloo process groups, shared by the test modules that need real ranks.

Spawning a group of ranks costs more than most of the checks it runs, so there is one group
per world size for the whole test session: each test module registers its checks here at import
(:func:`register`), and the first test that asks for a world size's results (:func:`results`)
spawns one group of that size, whose ranks run every registered check in registration order, in
the same processes, each writing its results to a file. The results are kept for the session,
so the next module's tests read them instead of spawning again.

Every group runs under a hard deadline (the sum of its checks' budgets); its processes are
joined, then terminated or killed, before :func:`run_group` returns. A check that raises ends
its rank's run (the group is out of step after it): the tests of that check, and of the checks
after it, then fail with the traceback.
"""

from __future__ import annotations

import importlib
import multiprocessing
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import pytest
import torch
import torch.distributed as dist

import treegather  # noqa: F401  (a worker checks that this did not load the collectives)

WORLD_SIZES = (2, 3)
COLLECTIVE_TIMEOUT = timedelta(seconds=30)  # a rank out of step raises instead of hanging

Check = Callable[[int, int], Any]
F = TypeVar("F", bound=Check)


class _Registered(NamedTuple):
    fn: Check
    budget_s: float


_CHECKS: dict[str, _Registered] = {}
_RESULTS: dict[int, list[dict[str, Any]] | Exception] = {}


def register(name: str, *, budget_s: float) -> Callable[[F], F]:
    """Run ``fn(rank, world)`` on every rank of each shared group, after the checks registered
    before it; its return value becomes ``results(world, ...)[rank][name]``. ``budget_s`` is
    added to the group's deadline."""

    def decorate(fn: F) -> F:
        known = _CHECKS.get(name)
        if known is not None and known.fn.__qualname__ != fn.__qualname__:
            raise ValueError(f"a check named {name!r} is registered already: {known.fn}")
        _CHECKS[name] = _Registered(fn, budget_s)
        return fn

    return decorate


def _loaded_collectives() -> list[str]:
    return [
        m
        for m in sys.modules
        if m == "treegather.distributed" or m.startswith("treegather.distributed.")
    ]


def _worker(
    rank: int, world: int, port: int, outdir: str, modules: Sequence[str], names: Sequence[str]
) -> None:
    torch.set_num_threads(1)
    # As a process torchrun starts: its own processes (a DataLoader's workers) fork, where the
    # spawn that started this one would make every worker import torch again (seconds each).
    multiprocessing.set_start_method("fork", force=True)
    # A fresh process that imported treegather (with this module) but not the collectives yet.
    results: dict[str, Any] = {"lazy": not _loaded_collectives()}
    current = "importing the test modules"
    try:
        for module in modules:  # registers their checks in this process, in the same order
            importlib.import_module(module)
        if list(_CHECKS) != list(names):
            raise RuntimeError(
                f"checks registered here {list(_CHECKS)} != the session's {list(names)}"
            )
        current = "init_process_group"
        from treegather.benchmarks.distributed import torchrun_environment

        torchrun_environment(rank, world, port)  # (accelerate finds the group by them)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=COLLECTIVE_TIMEOUT,
        )
        seconds = results["seconds"] = {}  # each check's wall time (where a group's time goes)
        for name in names:
            current = f"check {name!r}"
            start = time.perf_counter()
            results[name] = _CHECKS[name].fn(rank, world)
            seconds[name] = time.perf_counter() - start
    except Exception:
        results["fatal"] = f"{current}:\n{traceback.format_exc()}"
    finally:
        torch.save(results, Path(outdir) / f"rank{rank}.pt")
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_group(
    world: int,
    outdir: Path,
    target: Callable[..., None],
    args: tuple[Any, ...] = (),
    *,
    deadline_s: float,
) -> list[dict[str, Any]]:
    """Spawn ``world`` ranks running ``target(rank, world, port, outdir, *args)``; return each
    rank's results (``outdir/rank<r>.pt``). No process survives: ranks still running after
    ``deadline_s`` are terminated, then killed."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    # Not daemonic: a rank may start processes of its own (a DataLoader's workers); none
    # outlives this function, which terminates, then kills, whatever is still running.
    procs = [
        ctx.Process(target=target, args=(r, world, port, str(outdir), *args), daemon=False)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stragglers = [p for p in procs if p.is_alive()]
    for p in stragglers:
        p.terminate()
    for p in stragglers:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not any(p.is_alive() for p in procs)
    assert not stragglers, f"{len(stragglers)} rank(s) still running after {deadline_s}s: killed"
    assert [p.exitcode for p in procs] == [0] * world, [p.exitcode for p in procs]
    results = [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        assert "fatal" not in res, f"rank {r}, {res['fatal']}"
    return results


def results(world: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of the session's group of ``world`` ranks (spawned on first use,
    running every check registered so far; a failure is kept too and raised again)."""
    if world not in _RESULTS:
        names = list(_CHECKS)
        modules = list(dict.fromkeys(c.fn.__module__ for c in _CHECKS.values()))
        deadline = sum(c.budget_s for c in _CHECKS.values())
        outdir = tmp_path_factory.mktemp(f"group{world}")
        try:
            _RESULTS[world] = run_group(
                world, outdir, _worker, (modules, names), deadline_s=deadline
            )
        except Exception as exc:
            _RESULTS[world] = exc
            raise
    found = _RESULTS[world]
    if isinstance(found, BaseException):
        raise found
    late = [name for name in _CHECKS if name not in found[0]]
    if late:
        raise RuntimeError(f"checks registered after the group of {world} ran: {late}")
    return found
