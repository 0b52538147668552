"""parallel_apply: call one function per replica, serially, on threads, or with torch.jit.fork.

Backends:

- ``"serial"``: a plain loop in the calling thread; exact under every transform and mode. Like
  a loop, it stops at a ``KeyboardInterrupt`` or ``SystemExit``: no later replica runs.
- ``"threads"``: a persistent worker pool. Each call enters the caller's grad mode, inference
  mode and autocast state (enabled flag and dtype, per device type), then the replica's
  device and that device's current stream (captured in the caller). Under an active
  ``torch.func`` transform, a torch function/dispatch mode, or ``torch.compile`` tracing
  (all thread-local, so a worker thread would silently drop them) it runs serially instead.
- ``"fork"``: ``torch.jit.fork``/``wait``. When every function is a TorchScript module, one
  small scripted fan-out module forks them inside TorchScript, so they run in torch's
  inter-op pool without the GIL (needs ``torch.get_num_interop_threads() >= 2``). Eager
  Python functions are called inline (``torch.jit.fork`` runs them inline from Python
  anyway, and could not return pytrees such as dicts of mixed values). Caveats, handled here:
  fork, wait and script emit ``DeprecationWarning`` in torch 2.13 (silenced around
  treegather's own calls); a scripted replica's error comes back as ``RuntimeError`` (mapped
  to the replica and, for builtin exceptions, to the original type); a failed fork never
  waited on is dropped (every replica is always waited for); a script that exits right after
  its forked work finished could abort ("terminate called without an active exception"),
  so the latest fork batch stays referenced until the next one. Also: a TorchScript model
  run under ``torch.no_grad()`` after warm-up calls with grad can return outputs that
  require grad (torch's profiling executor; seen on torch 2.13 CPU, any backend).
- ``"auto"``: threads when the replicas sit on distinct CUDA devices, serial otherwise. On
  the CPU threads only pay off when each shard is dominated by large matmuls/convolutions
  that release the GIL; ask for ``backend="threads"`` (or a scripted model with ``"fork"``)
  explicitly there.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import Any, Literal

import torch

from .._devices import DeviceLike, as_device
from .._tree import flatten
from .failures import combine_failures
from .fork import Call, is_script_module, scripted_fanout

__all__ = ["parallel_apply", "parallel_apply_async", "apply_calls", "Backend"]

Backend = Literal["auto", "serial", "threads", "fork"]
_BACKENDS = ("auto", "serial", "threads", "fork")
_AUTOCAST_TYPES = ("cpu", "cuda", "xpu", "mps")

# One replica's outcome: (True, value) or (False, exception).
_Outcome = tuple[bool, Any]
_Call = Call


def parallel_apply(
    fns: Callable[..., Any] | Sequence[Callable[..., Any]],
    args: Sequence[Any],
    kwargs: Sequence[Mapping[str, Any]] | None = None,
    devices: Sequence[DeviceLike | None] | None = None,
    *,
    backend: Backend = "auto",
) -> list[Any]:
    """Call ``fns[i](*args[i], **kwargs[i])`` for every replica ``i`` and return the results.

    >>> import torch, treegather as tg
    >>> reps = tg.replicate(torch.nn.Linear(3, 2), ["cpu", "cpu"])
    >>> outs = tg.parallel_apply(reps, [torch.ones(4, 3), torch.ones(1, 3)], backend="threads")
    >>> [tuple(o.shape) for o in outs]
    [(4, 2), (1, 2)]
    >>> tg.parallel_apply(len, [("ab",), ("abc",)])
    [2, 3]

    Args:
        fns: one callable per replica, or one callable used for all replicas.
        args: one entry per replica: a tuple (not a namedtuple) is the positional arguments,
            anything else is the single argument.
        kwargs: one keyword dict per replica (default: none).
        devices: the device of each replica (default: the device of its first tensor
            argument, else none). Used for the device/stream context and in error messages.
        backend: ``"auto"``, ``"serial"``, ``"threads"`` or ``"fork"`` (see the module docs).

    Returns:
        The results, in replica order.

    Raises:
        ValueError: lengths of ``fns``/``args``/``kwargs``/``devices`` disagree, or an
            unknown backend.
        DeviceError: a device names nothing usable (e.g. an int id without CUDA).
        Exception: a failing replica re-raises its exception type with the same ``args``
            and attributes (``KeyError('x').args == ('x',)``), located by a note
            (``in replica 1 on device cpu``) or, where the one argument is the message, in the
            message (``in replica 1 on device cpu: bad value``); the original is the
            ``__cause__`` (``RuntimeError`` if the type can be neither rebuilt nor copied).
            Replicas failing with the same type and message are reported once
            (``in replicas 0, 1, 2 (devices cpu, cpu, cpu): ...``); distinct failures raise an
            ``ExceptionGroup`` with one entry each (``BaseExceptionGroup`` when a
            ``SystemExit`` or ``KeyboardInterrupt`` is among them; alone, those are re-raised
            as themselves, and serially run replicas after them are not run, as a note says).
    """
    return _apply(_prepare(fns, args, kwargs, devices), backend)


def apply_calls(
    fns: Callable[..., Any] | list[Callable[..., Any]],
    calls: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    devices: Sequence[torch.device],
    backend: Backend,
) -> list[Any]:
    """:func:`parallel_apply` of calls already made as it makes them (each replica's positional
    arguments a tuple, its keyword arguments a dict: :func:`treegather._parallel.step.calls_of`)
    on devices already normalised, one of each per replica: what ``data_parallel`` runs, its
    arguments neither checked nor copied again."""
    fn_list = fns if isinstance(fns, list) else [fns] * len(calls)
    return _apply(
        [(fn, a, kw, d) for fn, (a, kw), d in zip(fn_list, calls, devices, strict=True)], backend
    )


def _apply(calls: list[_Call], backend: str) -> list[Any]:
    chosen = _resolve(backend, calls)
    if chosen == "threads":
        n = len(calls)
        futures = [_submit(n, _in_worker, state, call) for state, call in _stated(calls)]
        wait_all(futures)
        outcomes = [f.result() for f in futures]
    elif chosen == "fork":
        outcomes = [_outcome_of(f) for f in _fork(calls)]
    else:
        outcomes = _serial(calls)
    return _finish(outcomes, calls)


def parallel_apply_async(
    fns: Callable[..., Any] | Sequence[Callable[..., Any]],
    args: Sequence[Any],
    kwargs: Sequence[Mapping[str, Any]] | None = None,
    devices: Sequence[DeviceLike | None] | None = None,
    *,
    backend: Backend = "auto",
) -> torch.futures.Future[list[Any]]:
    """Start :func:`parallel_apply` and return a ``torch.futures.Future`` of the result list.

    >>> import torch, treegather as tg
    >>> fut = tg.parallel_apply_async(torch.neg, [torch.ones(2), torch.zeros(1)], backend="threads")
    >>> [o.tolist() for o in fut.wait()]
    [[-1.0, -1.0], [-0.0]]

    ``.wait()`` (or ``.value()``) returns what :func:`parallel_apply` returns and raises the
    same exception types. With ``"serial"`` (and ``"auto"`` where it means serial) the work
    runs before this function returns; ``"threads"`` runs on the persistent pool and
    ``"fork"`` with TorchScript modules in torch's inter-op pool, so the caller can overlap
    other work. The future is completed (and its callbacks run) on treegather's worker
    threads, which the interpreter joins at exit, so exiting without waiting is safe. A
    :func:`parallel_apply` called from such a callback (or from a replica) runs serially on
    that thread, so chains of futures never wait on the pool they occupy.

    Args:
        fns: as in :func:`parallel_apply`.
        args: as in :func:`parallel_apply`.
        kwargs: as in :func:`parallel_apply`.
        devices: as in :func:`parallel_apply`.
        backend: as in :func:`parallel_apply`.

    Returns:
        A future whose value is the list of results.
    """
    calls = _prepare(fns, args, kwargs, devices)
    chosen = _resolve(backend, calls)
    result: torch.futures.Future[list[Any]] = torch.futures.Future()
    if chosen == "threads":
        outcomes: list[_Outcome | None] = [None] * len(calls)
        remaining = [len(calls)]
        lock = threading.Lock()

        def task(i: int, state: tuple[_CallerState, Any], call: _Call) -> None:
            # The last replica to finish completes the future, on its own pool thread.
            outcomes[i] = _in_worker(state, call)
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                _complete(result, [o for o in outcomes if o is not None], calls)

        for i, (state, call) in enumerate(_stated(calls)):
            _submit(len(calls), task, i, state, call)
    elif chosen == "fork":
        # Completed from a pool thread, never from torch's inter-op threads: callbacks on the
        # result then run in a Python thread that the interpreter joins at exit, so a script
        # that exits without waiting cannot abort ("terminate called without an active
        # exception") while forked work or a callback is still running.
        futs = _fork(calls)
        _submit(1, lambda: _complete(result, [_outcome_of(f) for f in futs], calls))
    else:
        _complete(result, _serial(calls), calls)
    return result


# -- preparing calls ---------------------------------------------------------------------------


def _prepare(
    fns: Callable[..., Any] | Sequence[Callable[..., Any]],
    args: Sequence[Any],
    kwargs: Sequence[Mapping[str, Any]] | None,
    devices: Sequence[DeviceLike | None] | None,
) -> list[_Call]:
    n = len(args)
    fn_list: list[Callable[..., Any]] = (
        list(fns) if isinstance(fns, (Sequence, torch.nn.ModuleList)) else [fns] * n
    )
    kw_list = [dict(k) for k in kwargs] if kwargs is not None else [{} for _ in range(n)]
    dev_list = list(devices) if devices is not None else [None] * n
    lengths = {"fns": len(fn_list), "args": n, "kwargs": len(kw_list), "devices": len(dev_list)}
    if len(set(lengths.values())) != 1:
        given = ", ".join(f"{k}={v}" for k, v in lengths.items())
        raise ValueError(f"parallel_apply needs one entry per replica everywhere, got {given}")
    calls: list[_Call] = []
    for fn, a, kw, d in zip(fn_list, args, kw_list, dev_list):
        positional = a if isinstance(a, tuple) and not hasattr(a, "_fields") else (a,)
        device = as_device(d) if d is not None else _first_tensor_device((positional, kw))
        calls.append((fn, positional, kw, device))
    return calls


def _first_tensor_device(tree: Any) -> torch.device | None:
    for leaf in flatten(tree, None)[0]:  # (an (args, kwargs) pair)
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return None


def _resolve(backend: str, calls: list[_Call]) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(_BACKENDS)}")
    if len(calls) <= 1 or _thread_local_context_active() or getattr(_LOCAL, "worker", False):
        return "serial"
    if backend == "auto":
        devs = [c[3] for c in calls]
        distinct_cuda = all(d is not None and d.type == "cuda" for d in devs) and len(
            set(devs)
        ) == len(devs)
        return "threads" if distinct_cuda else "serial"
    return backend


def _thread_local_context_active() -> bool:
    """A torch.func transform, a function/dispatch mode, or compile tracing is active."""
    functorch = getattr(torch._C, "_functorch", None)
    if functorch is not None and functorch.maybe_current_level() is not None:
        return True
    if torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack():
        return True
    return bool(torch.compiler.is_compiling())


# -- serial and threads --------------------------------------------------------------------------


def _serial(calls: list[_Call]) -> list[_Outcome]:
    """Run the replicas in order; stop after a ``KeyboardInterrupt``/``SystemExit`` as a loop would.

    The outcomes of the replicas that ran (fewer than ``calls`` after such a stop).
    """
    outcomes: list[_Outcome] = []
    for call in calls:
        ok, value = _run(call)
        outcomes.append((ok, value))
        if not ok and not isinstance(value, Exception):
            break
    return outcomes


def _run(call: _Call) -> _Outcome:
    fn, a, kw, device = call
    try:
        if device is None or device.type != "cuda":  # (no device context to enter)
            return True, fn(*a, **kw)
        with _device_context(device, None):
            return True, fn(*a, **kw)
    except BaseException as exc:
        return False, exc


def _device_context(
    device: torch.device | None, stream: Any
) -> contextlib.AbstractContextManager[Any]:
    if device is None or device.type != "cuda":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    if stream is not None:
        stack.enter_context(torch.cuda.stream(stream))
    return stack


class _CallerState:
    """The thread-local autograd/autocast state of the calling thread, to re-enter in workers."""

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = [
            (t, torch.get_autocast_dtype(t)) for t in _AUTOCAST_TYPES if _autocast_on(t)
        ]
        self.cache = torch.is_autocast_cache_enabled()

    def enter(self, stack: contextlib.ExitStack) -> None:
        if self.inference:
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for device_type, dtype in self.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=self.cache))


def _autocast_on(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except (RuntimeError, TypeError):
        return False


def _stated(calls: list[_Call]) -> list[tuple[tuple[_CallerState, Any], _Call]]:
    state = _CallerState()
    out = []
    for call in calls:
        device = call[3]
        stream = (
            torch.cuda.current_stream(device)
            if device is not None and device.type == "cuda"
            else None
        )
        out.append(((state, stream), call))
    return out


def _in_worker(state: tuple[_CallerState, Any], call: _Call) -> _Outcome:
    caller, stream = state
    try:
        with contextlib.ExitStack() as stack:
            caller.enter(stack)
            stack.enter_context(_device_context(call[3], stream))
            fn, a, kw, _ = call
            return True, fn(*a, **kw)
    except BaseException as exc:
        return False, exc


# The persistent pool. Every submit happens under ``_POOL_LOCK``, so nobody can hold on to an
# executor that is being replaced: growing swaps in a larger executor and retires the old one
# with ``shutdown(wait=False)``, which lets the work already queued on it finish; its threads
# then exit. Pool threads are marked as workers for their whole life (callbacks of futures
# completed there included), and ``parallel_apply`` runs serially on them: a nested call never
# waits for a pool it occupies.
_LOCAL = threading.local()
_MIN_WORKERS = 8
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def _mark_worker() -> None:
    _LOCAL.worker = True


def _submit(n: int, fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """Submit ``fn(*args)`` to the persistent pool, first grown to at least ``n`` workers."""
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < n:
            old = _POOL
            _POOL_SIZE = max(n, _MIN_WORKERS)
            _POOL = ThreadPoolExecutor(
                _POOL_SIZE, thread_name_prefix="treegather-apply", initializer=_mark_worker
            )
            if old is not None:
                old.shutdown(wait=False)  # its queued work still runs, then its threads exit
        return _POOL.submit(fn, *args)


# -- fork ------------------------------------------------------------------------------------------


def _fork(calls: list[_Call]) -> list[torch.futures.Future[Any]]:
    """One torch future per replica; scripted modules run in torch's inter-op pool."""
    futures = scripted_fanout(calls) if all(is_script_module(c[0]) for c in calls) else None
    if futures is not None:
        return futures
    out: list[torch.futures.Future[Any]] = []
    for ok, value in _serial(calls):  # eager Python: torch.jit.fork would run it inline anyway
        fut: torch.futures.Future[Any] = torch.futures.Future()
        _settle(fut, ok, value)
        out.append(fut)
    return out


def _outcome_of(fut: torch.futures.Future[Any]) -> _Outcome:
    try:
        return True, fut.wait()
    except BaseException as exc:
        return False, exc


# -- results ---------------------------------------------------------------------------------------


def _finish(outcomes: list[_Outcome], calls: list[_Call]) -> list[Any]:
    """The results; or one exception for every failure (``outcomes`` may stop short of
    ``calls`` after a ``KeyboardInterrupt`` or ``SystemExit``: the rest were not run)."""
    failures = [(i, calls[i][3], v) for i, (ok, v) in enumerate(outcomes) if not ok]
    if failures:
        raise combine_failures(failures, len(calls), not_run=range(len(outcomes), len(calls)))
    return [v for _, v in outcomes]


def _complete(
    result: torch.futures.Future[Any], outcomes: list[_Outcome], calls: list[_Call]
) -> None:
    try:
        value = _finish(outcomes, calls)
    except BaseException as exc:
        _settle(result, False, exc)
    else:
        _settle(result, True, value)


def _settle(fut: torch.futures.Future[Any], ok: bool, value: Any) -> None:
    if ok:
        fut.set_result(value)
    elif isinstance(value, Exception):
        fut.set_exception(value)
    else:  # torch's set_exception refuses BaseException; install the same unwrap by hand

        def reraise(exc: BaseException) -> None:
            raise exc

        fut._set_unwrap_func(reraise)
        fut.set_result(value)
