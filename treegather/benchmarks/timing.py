"""The benchmark's timing primitives: thread CPU time with the garbage collector off.

``_time`` times repeated calls (and counts their minor page faults); ``_compare`` interleaves
implementations round by round, rotating their order, and takes each one's median ratio to a
baseline; ``prepare_allocator`` puts the allocator in a training process's state first (see
:mod:`treegather.benchmarks.scatter_gather`).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

_ALLOCATOR_READY = False


def prepare_allocator() -> None:
    """Free one 16 MiB tensor, once per process: the allocator state of any training process.

    (glibc's dynamic trim threshold rises past what one call of the benchmark frees; see
    :mod:`treegather.benchmarks.scatter_gather`.)
    """
    global _ALLOCATOR_READY
    if not _ALLOCATOR_READY:
        block = torch.empty(16 << 20, dtype=torch.uint8)
        del block
        _ALLOCATOR_READY = True


def _minor_faults() -> int:
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def _time(
    fn: Callable[[], Any], reps: int, clock: Callable[[], float] = time.thread_time
) -> tuple[float, int]:
    """Seconds per call, and minor page faults over the ``reps`` calls."""
    # CPU time of this thread by default: on a shared machine, time spent descheduled (other
    # tenants, steal) would otherwise land on whichever implementation happened to be running.
    # The garbage collector is off while timing, as timeit does: a collection triggered by one
    # implementation's allocations would otherwise be paid by whichever runs next.
    gc.collect()
    gc.disable()
    try:
        faults = _minor_faults()
        t0 = clock()
        for _ in range(reps):
            fn()
        elapsed = clock() - t0
        return elapsed / reps, _minor_faults() - faults
    finally:
        gc.enable()


_FROZEN = [0]  # how deep frozen_heap() calls are nested


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Everything alive now moves to the garbage collector's permanent generation for the
    block: each timing sample's collection (see :func:`_time`) then visits what the timed
    code made since, not the process' whole heap (a full collection with torch imported takes
    ~0.1 s, more in a test session; it was 97% of a quick run). Nested blocks freeze once."""
    if _FROZEN[0] == 0:
        gc.collect()
        gc.freeze()
    _FROZEN[0] += 1
    try:
        yield
    finally:
        _FROZEN[0] -= 1
        if _FROZEN[0] == 0:
            gc.unfreeze()


def _compare(
    fns: dict[str, Callable[[], Any]],
    baseline: str,
    rounds: int,
    target_s: float,
    clock: Callable[[], float] = time.thread_time,
) -> dict[str, tuple[float, float, float]]:
    """Interleaved timing: per implementation (median seconds per call, median ratio to the
    baseline over rounds, page faults per call)."""
    for fn in fns.values():  # warm up (caches, treegather's compiled guards and builders)
        for _ in range(3):
            fn()
    with frozen_heap():
        reps = max(1, int(target_s / max(_time(fns[baseline], 3, clock)[0], 1e-7)))
        samples: dict[str, list[float]] = {name: [] for name in fns}
        faults = dict.fromkeys(fns, 0)
        names = list(fns)
        for r in range(rounds):
            # Rotate the order each round so no implementation always runs first (or last).
            for name in names[r % len(names) :] + names[: r % len(names)]:
                seconds, new_faults = _time(fns[name], reps, clock)
                samples[name].append(seconds)
                faults[name] += new_faults
    # The ratio is the median of per-round ratios: each round times every implementation back
    # to back, so slow phases of a shared machine cancel out.
    return {
        name: (
            statistics.median(ts),
            statistics.median(t / b for t, b in zip(ts, samples[baseline])),
            faults[name] / (reps * rounds),
        )
        for name, ts in samples.items()
    }
