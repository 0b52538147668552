"""parallel_apply / parallel_apply_async: backends, carried state, transforms, failures."""

from __future__ import annotations

import subprocess
import sys
import threading
import traceback
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import treegather as tg

if sys.version_info >= (3, 11):
    from builtins import BaseExceptionGroup, ExceptionGroup
else:
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup

BACKENDS = ["serial", "threads", "fork", "auto"]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * scale


def _shards(devices: list[str], rows: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(rows + i, 4, device=d) for i, d in enumerate(devices)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree_with_direct_calls(devices: list[str], backend: str) -> None:
    torch.manual_seed(0)
    net = MLP().to(devices[0])
    replicas = tg.replicate(net, devices)
    xs = _shards(devices)
    kwargs = [{"scale": 2.0}] * len(devices)
    outs = tg.parallel_apply(replicas, xs, kwargs, devices, backend=backend)  # type: ignore[arg-type]
    for out, x, d in zip(outs, xs, devices):
        assert out.device == torch.device(d)
        torch.testing.assert_close(out.to(devices[0]), net(x.to(devices[0]), scale=2.0))
    async_outs = tg.parallel_apply_async(replicas, xs, kwargs, backend=backend).wait()  # type: ignore[arg-type]
    for a, b in zip(outs, async_outs):
        torch.testing.assert_close(a, b)


def test_argument_conventions() -> None:
    Pair = namedtuple("Pair", "x y")
    assert tg.parallel_apply(lambda *a: a, [(1, 2), ()]) == [(1, 2), ()]
    assert tg.parallel_apply(lambda p: p.x + p.y, [Pair(1, 2), Pair(3, 4)]) == [3, 7]
    assert tg.parallel_apply([str.upper, str.lower], ["a", "B"], backend="threads") == ["A", "b"]
    assert tg.parallel_apply(len, []) == []


def test_length_mismatch_and_unknown_backend() -> None:
    with pytest.raises(ValueError, match="fns=3, args=2, kwargs=2, devices=2"):
        tg.parallel_apply([len] * 3, ["a", "b"])
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        tg.parallel_apply(len, ["a", "b"], backend="gpu")  # type: ignore[arg-type]


def test_auto_is_serial_on_cpu() -> None:
    names = tg.parallel_apply(
        lambda _: threading.current_thread().name, [0, 1], devices=["cpu"] * 2
    )
    assert names == [threading.current_thread().name] * 2


def _pool_threads() -> list[threading.Thread]:
    """treegather's worker threads (named ``treegather-apply_<n>``)."""
    return [t for t in threading.enumerate() if t.name.startswith("treegather-apply")]


def test_thread_pool_is_persistent() -> None:
    def ident(_: Any) -> int:
        return threading.get_ident()

    before = len(_pool_threads())
    seen: set[int] = set()
    for _ in range(10):
        seen.update(tg.parallel_apply(ident, list(range(4)), backend="threads"))
    assert threading.get_ident() not in seen
    assert seen <= {t.ident for t in _pool_threads()}
    # 40 tasks on at most the threads already there, or a first pool of 8 workers.
    assert len(_pool_threads()) <= max(before, 8)


def _state(_: Any) -> tuple[Any, ...]:
    x = torch.ones(2, 2, requires_grad=True)
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        (x @ x).dtype,
        threading.current_thread().name,
    )


def test_autocast_dtype_and_no_grad_reach_every_thread() -> None:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        states = tg.parallel_apply(_state, [0, 1, 2], backend="threads")
    for grad, inference, enabled, dtype, out_dtype, name in states:
        assert (grad, inference, enabled, dtype, out_dtype) == (
            False,
            False,
            True,
            torch.float16,
            torch.float16,
        )
        assert name.startswith("treegather-apply")
    states = tg.parallel_apply(_state, [0, 1], backend="threads")
    assert all(s[:5] == (True, False, False, torch.bfloat16, torch.float32) for s in states)


def test_inference_mode_reaches_every_thread() -> None:
    with torch.inference_mode():
        states = tg.parallel_apply(_state, [0, 1], backend="threads")
    assert all(s[0] is False and s[1] is True for s in states)


def _loss_through_apply(w: torch.Tensor, backend: str) -> torch.Tensor:
    xs = [torch.arange(3.0) + i for i in range(3)]
    outs = tg.parallel_apply(lambda x: (w * x).sin().sum(), xs, backend=backend)  # type: ignore[arg-type]
    return torch.stack(outs).sum()


@pytest.mark.parametrize("backend", ["threads", "fork", "serial"])
def test_torch_func_grad_is_exact(backend: str) -> None:
    w = torch.tensor([0.3, -0.2, 0.5])
    got = torch.func.grad(_loss_through_apply)(w, backend)
    expected = torch.autograd.functional.jacobian(lambda v: _loss_through_apply(v, "serial"), w)
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, expected)
    batched = torch.func.vmap(lambda v: _loss_through_apply(v, backend))(torch.stack([w, 2 * w]))
    torch.testing.assert_close(batched[1], _loss_through_apply(2 * w, "serial"))


def test_dispatch_mode_keeps_calls_on_the_caller_thread() -> None:
    seen: list[str] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(threading.current_thread().name)
            return func(*args, **(kwargs or {}))

    with Spy():
        tg.parallel_apply(torch.neg, [torch.ones(1), torch.ones(2)], backend="threads")
    assert seen and set(seen) == {threading.current_thread().name}


# -- TorchScript and fork ---------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fork_on_scripted_module_matches_threads_and_serial(devices: list[str]) -> None:
    torch.manual_seed(0)
    scripted = torch.jit.script(MLP().to(devices[0]))
    replicas = tg.replicate(scripted, devices)
    xs = _shards(devices)
    results = {
        b: tg.parallel_apply(replicas, xs, [{"scale": 3.0}] * len(xs), backend=b)  # type: ignore[arg-type]
        for b in ("fork", "threads", "serial")
    }
    for a, b, c in zip(*results.values()):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c)
    sum(o.sum() for o in results["fork"]).backward()
    assert scripted.a.weight.grad is not None and scripted.a.weight.grad.abs().sum() > 0
    grad_mode = tg.replicate(torch.jit.script(GradMode()), ["cpu"] * 3)
    with torch.no_grad():
        flags = tg.parallel_apply(grad_mode, [torch.ones(1)] * 3, backend="fork")
    assert [f.item() for f in flags] == [0.0] * 3
    assert [
        f.item() for f in tg.parallel_apply(grad_mode, [torch.ones(1)] * 3, backend="fork")
    ] == [1.0] * 3


class GradMode(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(torch.is_grad_enabled())


class Failing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() < 0):
            raise ValueError("negative input " + str(x.size(0)))
        return x * 2


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_scripted_fork_failure_maps_back_to_the_replica() -> None:
    scripted = torch.jit.script(Failing())
    replicas = tg.replicate(scripted, ["cpu"] * 3)
    xs = [torch.ones(2), -torch.ones(5), torch.ones(1)]
    with pytest.raises(ValueError, match=r"in replica 1 on device cpu: negative input 5") as info:
        tg.parallel_apply(replicas, xs, backend="fork")
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match="in replica 1"):
        tg.parallel_apply_async(replicas, xs, backend="fork").wait()
    assert [
        o.tolist() for o in tg.parallel_apply(replicas, [torch.ones(1)] * 3, backend="fork")
    ] == [[2.0]] * 3


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fork_with_arguments_that_do_not_fit_the_script_reports_each_replica() -> None:
    replicas = tg.replicate(torch.jit.script(MLP()), ["cpu"] * 2)
    with pytest.raises(ExceptionGroup) as info:
        tg.parallel_apply(replicas, ["not a tensor", "nor this"], backend="fork")
    errors = info.value.exceptions
    assert [str(e).split(":")[0] for e in errors] == ["in replica 0", "in replica 1"]
    assert all(isinstance(e, RuntimeError) and "Expected a value of type" in str(e) for e in errors)


EXIT_SCRIPT = """
import sys
import warnings

import torch

import treegather as tg

warnings.simplefilter("ignore", DeprecationWarning)


class Heavy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(128, 128) / 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(40):
            x = torch.tanh(x @ self.w)
        return x


reps = tg.replicate(torch.jit.script(Heavy()), ["cpu"] * 2)
xs = [torch.randn(64, 128)] * 2
mode = sys.argv[1]
if mode == "sync":
    tg.parallel_apply(reps, xs, backend="fork")
else:
    fut = tg.parallel_apply_async(reps, xs, backend="fork")
    if mode == "wait":
        fut.wait()
    else:
        fut.then(lambda f: len(f.value()))
print("exiting", flush=True)
"""


@pytest.mark.parametrize("modes", [("sync", "then")])
def test_fork_then_exit_at_once_is_clean(tmp_path: Any, modes: tuple[str, ...]) -> None:
    # Before treegather kept the latest fork batch referenced, about half of such runs
    # aborted with "terminate called without an active exception" (torch 2.13, CPU).
    script = tmp_path / "fork_exit.py"
    script.write_text(EXIT_SCRIPT)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for mode in modes
    ]
    for mode, proc in zip(modes, procs):
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 0, f"{mode}: rc={proc.returncode} {err[-2000:]}"
        assert "exiting" in out


def _root() -> Any:
    import pathlib

    return pathlib.Path(tg.__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(_root()) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


# -- failures --------------------------------------------------------------------------------------


class CodedError(Exception):
    def __init__(self, message: str, code: int, detail: str) -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail


def _maybe_fail(spec: Any) -> Any:
    if isinstance(spec, BaseException):
        raise spec
    return spec


def _apply(backend: str, specs: list[Any], use_async: bool) -> list[Any]:
    devices = ["cpu"] * len(specs)
    if use_async:
        return tg.parallel_apply_async(_maybe_fail, specs, devices=devices, backend=backend).wait()  # type: ignore[arg-type]
    return tg.parallel_apply(_maybe_fail, specs, devices=devices, backend=backend)  # type: ignore[arg-type]


FAIL_MODES = [
    pytest.param(b, a, id=f"{b}-{'async' if a else 'sync'}")
    for b in ("serial", "threads", "fork")
    for a in (False, True)
]


@pytest.mark.parametrize(("backend", "use_async"), FAIL_MODES)
def test_custom_exception_with_extra_arguments(backend: str, use_async: bool) -> None:
    original = CodedError("disk full", 28, "sda1")
    with pytest.raises(CodedError) as info:
        _apply(backend, [1, original, 3], use_async)
    err = info.value
    assert str(err) == "in replica 1 on device cpu: disk full"
    assert (err.code, err.detail) == (28, "sda1")
    assert err.__cause__ is original
    assert original.__traceback__ is not None
    assert "_maybe_fail" in "".join(traceback.format_tb(original.__traceback__))


@pytest.mark.parametrize(("backend", "use_async"), FAIL_MODES)
def test_two_failing_replicas_give_an_exception_group(backend: str, use_async: bool) -> None:
    with pytest.raises(ExceptionGroup) as info:
        _apply(backend, [KeyError("k"), 1, ValueError("bad value"), 3], use_async)
    group = info.value
    assert "2 of 4 replicas failed (replicas 0, 2)" in str(group)
    first, second = group.exceptions
    assert isinstance(first, KeyError) and first.args == ("k",)
    assert first.__notes__ == ["in replica 0 on device cpu"]  # type: ignore[attr-defined]
    assert isinstance(second, ValueError) and str(second) == "in replica 2 on device cpu: bad value"


@pytest.mark.parametrize(("backend", "use_async"), FAIL_MODES)
def test_system_exit_stays_itself(backend: str, use_async: bool) -> None:
    exit_ = SystemExit(3)
    with pytest.raises(SystemExit) as info:
        _apply(backend, [1, exit_], use_async)
    assert info.value is exit_ and info.value.code == 3
    # ValueError first: the serial loop (fork runs eager functions serially too) stops at a
    # SystemExit, so a replica after it would never run.
    with pytest.raises(BaseExceptionGroup) as group:
        _apply(backend, [ValueError("v"), SystemExit(4)], use_async)
    assert not isinstance(group.value, ExceptionGroup)
    assert [type(e) for e in group.value.exceptions] == [ValueError, SystemExit]
    assert _apply(backend, [1, 2], use_async) == [1, 2]


def test_unrebuildable_exception_becomes_runtime_error() -> None:
    token = object()

    class Strict(Exception):  # only its factory can make one: neither rebuilt nor copied
        def __new__(cls, *args: Any, token_: object = None) -> Strict:
            if token_ is not token:
                raise TypeError("Strict is made by its factory only")
            return super().__new__(cls, *args)

        def __init__(self, *args: Any, token_: object = None) -> None:
            super().__init__(*args)

    with pytest.raises(RuntimeError, match=r"in replica 0 on device cpu: .*Strict") as info:
        tg.parallel_apply(_maybe_fail, [Strict("a", "b", token_=token), 1], devices=["cpu"] * 2)
    assert isinstance(info.value.__cause__, Strict)
    with pytest.raises(ValueError, match=r"^in replica 1: v$"):
        tg.parallel_apply(_maybe_fail, [1, ValueError("v")])


class CodeOnly(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code

    def __str__(self) -> str:
        return f"code={self.code}"


@pytest.mark.parametrize(
    ("original", "expected_type", "expected_text"),
    [
        (KeyError("k"), KeyError, "'k'"),
        (FileNotFoundError(2, "gone", "f.txt"), FileNotFoundError, "[Errno 2] gone: 'f.txt'"),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), UnicodeDecodeError, "can't decode"),
        (CodeOnly(7), CodeOnly, "code=7"),
    ],
    ids=["KeyError", "OSError", "UnicodeDecodeError", "custom-str"],
)
def test_rebuilt_exceptions_keep_type_message_and_attributes(
    original: Exception, expected_type: type, expected_text: str
) -> None:
    with pytest.raises(expected_type) as info:
        tg.parallel_apply(_maybe_fail, [0, original], devices=["cpu", "cpu"])
    err = info.value
    assert expected_text in str(err)
    assert "in replica 1 on device cpu" in str(err) + "".join(getattr(err, "__notes__", []))
    assert err.__cause__ is original
    assert err.args == original.args  # the location is a note, never part of the arguments
    if isinstance(original, OSError):
        assert (err.errno, err.strerror, err.filename) == (2, "gone", "f.txt")  # type: ignore[attr-defined]
    if isinstance(original, CodeOnly):
        assert err.code == 7  # type: ignore[attr-defined]
    if isinstance(original, UnicodeDecodeError):
        assert isinstance(err, ValueError)
        assert (err.encoding, err.object, err.start, err.end, err.reason) == (  # type: ignore[attr-defined]
            "utf-8",
            b"\xff",
            0,
            1,
            "bad",
        )


def test_key_error_from_a_replica_keeps_its_key() -> None:
    def lookup(key: str) -> int:
        return {"a": 1}[key]

    with pytest.raises(KeyError) as info:
        tg.parallel_apply(lookup, ["a", "x", "a"], devices=["cpu"] * 3, backend="threads")
    assert info.value.args == ("x",)
    assert info.value.__notes__ == ["in replica 1 on device cpu"]  # type: ignore[attr-defined]


def test_the_original_exception_is_left_as_it_was() -> None:
    original = KeyError("k")
    original.add_note("from the user")
    with pytest.raises(KeyError) as info:
        tg.parallel_apply(_maybe_fail, [1, original], devices=["cpu"] * 2)
    assert info.value.__notes__ == ["from the user", "in replica 1 on device cpu"]  # type: ignore[attr-defined]
    assert original.__notes__ == ["from the user"]  # type: ignore[attr-defined]


class NoSize:
    pass


def _size_of(x: Any) -> Any:
    return x.size(0)


@pytest.mark.parametrize("backend", ["serial", "threads"])
def test_identical_failures_are_reported_once(backend: str) -> None:
    with pytest.raises(AttributeError) as info:
        tg.parallel_apply(_size_of, [NoSize()] * 3, devices=["cpu"] * 3, backend=backend)  # type: ignore[arg-type]
    err = info.value
    assert str(err) == (
        "in replicas 0, 1, 2 (devices cpu, cpu, cpu): 'NoSize' object has no attribute 'size'"
    )
    assert isinstance(err.__cause__, AttributeError) and err.name == "size"
    assert "_size_of" in "".join(traceback.format_tb(err.__cause__.__traceback__))
    with pytest.raises(KeyError) as keys:
        tg.parallel_apply(_maybe_fail, [KeyError("k"), 1, KeyError("k")])
    assert keys.value.args == ("k",)
    assert keys.value.__notes__ == ["in replicas 0, 2"]  # type: ignore[attr-defined]


def test_distinct_failures_make_one_group_entry_each() -> None:
    specs = [ValueError("bad"), KeyError("k"), ValueError("bad"), 3, ValueError("other")]
    with pytest.raises(ExceptionGroup) as info:
        tg.parallel_apply(_maybe_fail, specs, devices=["cpu"] * 5)
    group = info.value
    assert group.message == "4 of 5 replicas failed (replicas 0, 1, 2, 4); 3 distinct errors"
    assert [str(e) for e in group.exceptions] == [
        "in replicas 0, 2 (devices cpu, cpu): bad",
        "'k'",
        "in replica 4 on device cpu: other",
    ]
    assert [e.__cause__ for e in group.exceptions] == [specs[0], specs[1], specs[4]]


def test_nested_parallel_apply_in_workers_does_not_hang() -> None:
    def inner(i: int) -> list[int]:
        return tg.parallel_apply(lambda j: i * 10 + j, list(range(3)), backend="threads")

    assert tg.parallel_apply(inner, list(range(12)), backend="threads")[11] == [110, 111, 112]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["threads", "auto"])
def test_threads_on_cuda_carry_device_and_stream(backend: str) -> None:
    n = torch.cuda.device_count()
    devices = [f"cuda:{i}" for i in range(n)] + ["cuda:0"]

    def where(x: torch.Tensor) -> tuple[int, int]:
        return torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream

    side = torch.cuda.Stream(0)
    with torch.cuda.stream(side):
        got = tg.parallel_apply(
            where, [torch.ones(1, device=d) for d in devices], devices=devices, backend=backend
        )  # type: ignore[arg-type]
    assert [g[0] for g in got] == [torch.device(d).index for d in devices]
    assert got[0][1] == side.cuda_stream


# -- the pool under concurrency, nesting and interrupts (issue 10) ------------------------------


def _apply_threads(n: int) -> list[int]:
    return tg.parallel_apply(lambda i: i * 2, list(range(n)), backend="threads")


def _in_daemon(target: Any, seconds: float) -> list[BaseException]:
    """Run ``target`` in a daemon thread; a hang fails the test instead of hanging it."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s (deadlock?)"
    return errors


def test_growing_the_pool_never_fails_concurrent_calls() -> None:
    # Each call asks for a larger pool than the last one while three other threads submit.
    start = threading.Barrier(4)
    failures: list[BaseException] = []

    def hammer(offset: int) -> None:
        start.wait()
        for n in range(2, 34, 2):
            try:
                assert _apply_threads(n + offset) == [2 * i for i in range(n + offset)]
            except BaseException as exc:  # collected and asserted below
                failures.append(exc)

    def scenario() -> None:
        threads = [threading.Thread(target=hammer, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)

    assert _in_daemon(scenario, 30) == []
    assert failures == [], failures[:1]


CALLBACK_SCRIPT = """
import faulthandler
import torch
import treegather as tg

faulthandler.dump_traceback_later(25, exit=True)  # a deadlock fails with every thread's stack


def inner(fut):
    return tg.parallel_apply(torch.neg, [t * 2 for t in fut.value()], backend="threads")


chains = [
    tg.parallel_apply_async(torch.neg, [torch.ones(1)] * 2, backend="threads").then(inner)
    for _ in range(24)
]
print(sum(float(sum(f.wait())) for f in chains), flush=True)
"""


def test_parallel_apply_in_then_callbacks_does_not_deadlock(tmp_path: Any) -> None:
    # The callbacks run on pool workers; more chains than workers used to wait on each other.
    script = tmp_path / "chains.py"
    script.write_text(CALLBACK_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(24 * 2 * 2.0)


def test_callbacks_know_they_run_on_a_pool_thread() -> None:
    def nested(fut: Any) -> tuple[str, list[str]]:
        names = tg.parallel_apply(
            lambda _: threading.current_thread().name, [0, 1, 2], backend="threads"
        )
        return threading.current_thread().name, names

    go = threading.Event()

    def held(x: int) -> int:
        go.wait(10)
        return abs(x)

    def scenario() -> None:
        # Still pending when .then() is attached, so the callback runs where it completes.
        fut = tg.parallel_apply_async(held, [-1, -2], backend="threads").then(nested)
        go.set()
        outer, inner = fut.wait()
        assert outer.startswith("treegather-apply")
        assert inner == [outer] * 3  # inline on the callback's own thread

    assert _in_daemon(scenario, 20) == []


@pytest.mark.parametrize("backend", ["serial", "fork", "auto"])
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_serial_stops_at_keyboard_interrupt_and_system_exit(
    backend: str, use_async: bool, stop: type[BaseException]
) -> None:
    ran: list[int] = []

    def step(i: int) -> int:
        ran.append(i)
        if i == 1:
            raise stop()
        return i

    apply = tg.parallel_apply_async if use_async else tg.parallel_apply
    with pytest.raises(stop) as info:
        result = apply(step, [0, 1, 2, 3], devices=["cpu"] * 4, backend=backend)  # type: ignore[arg-type]
        if use_async:
            result.wait()  # type: ignore[union-attr]
    assert ran == [0, 1]
    assert type(info.value) is stop
    assert "replicas 2, 3 were not run" in "\n".join(getattr(info.value, "__notes__", []))


def test_serial_reports_failures_before_the_interrupt_with_it() -> None:
    ran: list[int] = []

    def step(i: int) -> int:
        ran.append(i)
        if i == 0:
            raise ValueError("zero")
        if i == 1:
            raise KeyboardInterrupt
        return i

    with pytest.raises(BaseExceptionGroup) as info:
        tg.parallel_apply(step, [0, 1, 2], backend="serial")
    assert ran == [0, 1]
    assert [type(e) for e in info.value.exceptions] == [ValueError, KeyboardInterrupt]


LEAK_SCRIPT = """
import threading
import time

import treegather as tg

sizes = [2, 5, 9, 3, 17, 24, 4]
for k in range(1000):
    n = sizes[k % len(sizes)]
    if k % 100 == 99:
        assert tg.parallel_apply_async(abs, list(range(-n, 0)), backend="threads").wait()[0] == n
    else:
        assert tg.parallel_apply(lambda i: 2 * i, list(range(n)), backend="threads")[-1] == 2 * n - 2


def pool_threads():
    return sum(t.name.startswith("treegather-apply") for t in threading.enumerate())


deadline = time.monotonic() + 20  # retired executors' threads exit once their queue is done
while pool_threads() > 24 and time.monotonic() < deadline:
    time.sleep(0.01)
print(pool_threads(), threading.active_count(), flush=True)
"""


def test_no_thread_leak_after_a_thousand_calls_of_mixed_sizes(tmp_path: Any) -> None:
    # A fresh process, so that the bound is known: the pool grows to the largest call (24),
    # and the executors it replaced while growing have let their threads go.
    script = tmp_path / "leak.py"
    script.write_text(LEAK_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    pool, active = map(int, proc.stdout.split())
    assert pool <= 24
    assert active <= pool + 1  # the main thread and the pool, nothing else


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fanout_classes_live_in_a_bounded_registered_cache() -> None:
    from treegather._caches import caches

    replicas = tg.replicate(torch.jit.script(GradMode()), ["cpu"] * 2)
    assert len(tg.parallel_apply(replicas, [torch.ones(1)] * 2, backend="fork")) == 2
    (fanout,) = [c for c in caches() if c.name == "apply.fanout_classes"]
    assert 1 <= len(fanout) <= fanout.maxsize
    tg.clear_caches()
    assert len(fanout) == 0
    outs = tg.parallel_apply(replicas, [torch.ones(1)] * 2, backend="fork")  # a cold cache
    assert [o.item() for o in outs] == [1.0, 1.0]


class Truncated(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message[:20])


def test_an_exception_that_rewrites_its_message_is_copied_not_wrapped() -> None:
    original = Truncated("disk is full")
    with pytest.raises(Truncated) as info:  # was a RuntimeError: the location cut the message
        tg.parallel_apply(_maybe_fail, [original, 1], devices=["cpu"] * 2)
    assert info.value.args == ("disk is full",)
    assert info.value.__notes__ == ["in replica 0 on device cpu"]  # type: ignore[attr-defined]
    assert info.value.__cause__ is original
