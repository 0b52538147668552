"""Spawned gloo process groups, shared by the test modules that need real ranks.

Spawning a group of ranks costs more than most of the checks it runs, so there is one group
per world size for the whole test session: each test module registers its checks here at import
(:func:`register`), and the first test that asks for a world size's results (:func:`results`)
spawns one group of that size, whose ranks run every registered check in registration order, in
the same processes, each writing its results to a file. The results are kept for the session,
so the next module's tests read them instead of spawning again.

A session that will ask for groups starts them in the background as soon as its tests are
collected (:func:`start` of a :func:`group_job`, from ``conftest.py``): one group after another, in a thread of
the test process, while the single-process tests run on the other core; :func:`results` then
waits for the group it needs. Each rank's output goes to a log file of its own, whose end a
failure shows.

Every group runs under a hard deadline (the sum of its checks' budgets); its processes are
joined, then terminated or killed, before :func:`run_group` returns (at once when the session
ends first: :func:`stop`). A check that raises ends
its rank's run (the group is out of step after it): the tests of that check, and of the checks
after it, then fail with the traceback.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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
_STARTED: dict[Any, Future[Any]] = {}  # background jobs (groups, launches), by key
_RUNNER: list[ThreadPoolExecutor] = []  # one thread: one job at a time, in submission order
STOP = threading.Event()  # the session ended: what still runs is stopped
_BASE: list[Path] = []  # where the background groups write
_LIVE: set[Any] = set()  # the processes of the groups running now


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
    log = open(Path(outdir) / f"rank{rank}.log", "wb", buffering=0)
    os.dup2(log.fileno(), 1)  # (not the terminal, nor whichever test captures output then)
    os.dup2(log.fileno(), 2)
    # A rank terminated at the deadline writes where each of its threads was, into its log.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    torch.set_num_threads(1)
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
        _start_fork_server(modules)
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
    # Left without Python's teardown, once the results are saved: a process that ran
    # torch.distributed.nn's autograd collectives on gloo (the grads checks compare with them)
    # can abort there ("terminate called without an active exception", exit code -6).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start_fork_server(modules: Sequence[str]) -> None:
    """Start this rank's DataLoader workers from a fork server, which imports torch, treegather
    and the test modules that set ``LOADER_WORKERS = True`` (their datasets' classes) once.

    Forked from the rank itself (torchrun's default), a worker can hang before it runs a line
    (2 groups in about 15 test runs did): CPython 3.11's child clears the other threads' states
    under the interpreter's thread-list lock before it re-initialises that lock, so it waits
    forever where another thread (gloo's, a queue's feeder) held it at the fork. The server is
    a process of one thread (started by fork and exec, safe from a threaded rank). Spawned, every
    worker would import torch again (seconds each)."""
    preload = [m for m in modules if getattr(sys.modules[m], "LOADER_WORKERS", False)]
    multiprocessing.set_start_method("forkserver", force=True)
    # (3.11's fork server ignores the sys.path it is given, and imports nothing it cannot find)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    multiprocessing.set_forkserver_preload(["torch", "treegather", *preload])
    multiprocessing.forkserver.ensure_running()


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
    _LIVE.update(procs)
    for p in procs:
        p.start()
    deadline = time.monotonic() + deadline_s
    for p in procs:
        while p.is_alive() and time.monotonic() < deadline and not STOP.is_set():
            p.join(min(0.2, max(0.0, deadline - time.monotonic())))
    stragglers = [p for p in procs if p.is_alive()]
    for p in stragglers:
        p.terminate()
    for p in stragglers:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not any(p.is_alive() for p in procs)
    _LIVE.difference_update(procs)
    assert not STOP.is_set(), "the session ended before the group did: stopped"
    logs = _logs(outdir, world)
    assert not stragglers, (
        f"{len(stragglers)} rank(s) still running after {deadline_s}s: killed{logs}"
    )
    assert [p.exitcode for p in procs] == [0] * world, f"{[p.exitcode for p in procs]}{logs}"
    results = [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        assert "fatal" not in res, f"rank {r}, {res['fatal']}{logs}"
    return results


def _logs(outdir: Path, world: int, tail: int = 2000) -> str:
    """The end of each rank's log (its stdout and stderr), for a failure's message."""
    parts = []
    for r in range(world):
        path = outdir / f"rank{r}.log"
        text = path.read_text(errors="replace")[-tail:] if path.exists() else ""
        if text.strip():
            parts.append(f"\n--- rank {r}'s output (end):\n{text}")
    return "".join(parts)


def _group(world: int, outdir: Path) -> list[dict[str, Any]]:
    """A group of ``world`` ranks running every check registered so far."""
    names = list(_CHECKS)
    modules = list(dict.fromkeys(c.fn.__module__ for c in _CHECKS.values()))
    deadline = sum(c.budget_s for c in _CHECKS.values())
    outdir.mkdir(parents=True, exist_ok=True)
    return run_group(world, outdir, _worker, (modules, names), deadline_s=deadline)


def start(key: Any, job: Callable[[], Any]) -> None:
    """Run ``job()`` in the background, after the jobs started before it; :func:`started`
    gives its future."""
    if key in _STARTED:
        return
    if not _RUNNER:
        _RUNNER.append(ThreadPoolExecutor(1, thread_name_prefix="spawned-groups"))
    _STARTED[key] = _RUNNER[0].submit(job)


def started(key: Any) -> Future[Any] | None:
    return _STARTED.get(key)


def running() -> set[Any]:
    """The processes of the groups that run now (in the background, or for a test)."""
    return set(_LIVE)


def world_of(item: Any) -> int | None:
    """The group a collected test asks for: the world size its ``group_results`` or
    ``ranks`` fixture is parametrized with (the modules of this package name them so)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name in ("group_results", "ranks"):
        value = params.get(name)
        if isinstance(value, tuple):
            value = value[0]
        if isinstance(value, int) and value in WORLD_SIZES:
            return value
    return None


def scratch(name: str) -> Path:
    """A fresh folder for a background job's files (all removed by :func:`stop`)."""
    if not _BASE:
        _BASE.append(Path(tempfile.mkdtemp(prefix="treegather-groups-")))
    path = _BASE[0] / name
    path.mkdir()
    return path


def group_job(world: int) -> Callable[[], list[dict[str, Any]]]:
    """The group of ``world`` ranks, as a job for :func:`start` (every check is registered by
    the time the tests are collected: their modules were imported to collect them)."""
    return functools.partial(_group, world, scratch(f"group{world}"))


def stop() -> None:
    """The session ends: groups still running are stopped, those not started never start."""
    STOP.set()
    if _RUNNER:
        _RUNNER[0].shutdown(wait=True, cancel_futures=True)
    for base in _BASE:
        shutil.rmtree(base, ignore_errors=True)


def results(world: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of the session's group of ``world`` ranks (spawned on first use,
    running every check registered so far; a failure is kept too and raised again)."""
    if world not in _RESULTS:
        job = started(("group", world))
        try:
            if job is not None:
                _RESULTS[world] = job.result()
            else:
                _RESULTS[world] = _group(world, tmp_path_factory.mktemp(f"group{world}"))
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
