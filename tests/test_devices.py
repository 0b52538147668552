"""Device arguments in torch's conventions: ints, strings, torch.device; -1 is the CPU."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import treegather as tg
from treegather._devices import as_device, as_devices
from treegather._errors import check_dim


@pytest.fixture
def cuda_claimed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CUDA reported available (nothing here touches a GPU), with cold caches either side."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tg.clear_caches()
    yield
    tg.clear_caches()


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CUDA reported unavailable, as on a CPU-only machine, with cold caches either side."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tg.clear_caches()
    yield
    tg.clear_caches()


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (-1, torch.device("cpu")),
        ("cpu", torch.device("cpu")),
        (torch.device("cpu"), torch.device("cpu")),
        (0, torch.device("cuda", 0)),
        (3, torch.device("cuda", 3)),
        ("cuda:1", torch.device("cuda", 1)),
    ],
)
def test_as_device(cuda_claimed: None, given: object, expected: torch.device) -> None:
    assert as_device(given) == expected  # type: ignore[arg-type]
    assert as_device(given) == expected  # type: ignore[arg-type]  # cached


def test_as_devices_single_and_many(cuda_claimed: None) -> None:
    assert as_devices(-1) == (torch.device("cpu"),)
    assert as_devices("cpu") == (torch.device("cpu"),)
    assert as_devices([-1, "cpu", 0]) == (torch.device("cpu"),) * 2 + (torch.device("cuda", 0),)
    with pytest.raises(ValueError, match="at least one device"):
        as_devices([])


@pytest.mark.parametrize("bad", [True, False, 1.0, 0.0, -1.0, None, [0]])
def test_bools_floats_and_others_are_not_devices_even_after_equal_ints(
    cuda_claimed: None, bad: object
) -> None:
    # True == 1 and 1.0 == 1 hash alike: a cache keyed by value alone would answer cuda:1.
    as_device(0), as_device(1), as_device(-1)
    with pytest.raises(tg.ArgumentTypeError, match="not a device") as info:
        as_device(bad)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)


def test_index_below_minus_one_is_refused() -> None:
    with pytest.raises(
        tg.DeviceError, match=r"device index must be >= -1 \(-1 is the CPU\), got -2"
    ) as info:
        as_device(-2)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("bad", ["gpu:0", "cuda:x", "", "cpu:0:1"])
def test_bad_device_strings_are_device_errors(bad: str) -> None:
    with pytest.raises(tg.DeviceError, match=rf"^not a device: {bad!r} \(") as info:
        as_device(bad)
    assert isinstance(info.value, ValueError)
    assert str(info.value).endswith("write 'cpu', 'cuda:0', an int CUDA index, or -1 for the CPU")


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (0, "device 0 (that is cuda:0)"),
        (2, "device 2 (that is cuda:2)"),
        ("cuda:1", "device 'cuda:1'"),
        ("cuda", "device 'cuda'"),
        (torch.device("cuda", 0), "device cuda:0"),
    ],
)
def test_cuda_devices_without_cuda_say_so(no_cuda: None, given: object, named: str) -> None:
    with pytest.raises(tg.DeviceError) as info:
        as_device(given)  # type: ignore[arg-type]
    assert str(info.value) == (
        f"{named} is a CUDA device, but CUDA is not available on this machine "
        "(torch.cuda.is_available() is False); use 'cpu' or -1, repeated for several replicas "
        "(e.g. ['cpu'] * 4)"
    )


def test_a_cached_cuda_device_is_not_answered_once_cuda_is_gone(
    monkeypatch: pytest.MonkeyPatch, cuda_claimed: None
) -> None:
    assert as_device(0) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tg.clear_caches()
    with pytest.raises(tg.DeviceError, match="CUDA is not available"):
        as_device(0)


def test_int_device_ids_without_cuda_fail_early_in_every_entry_point(no_cuda: None) -> None:
    x = torch.ones(4, 2)
    for call in (
        lambda: tg.scatter(x, [0, 1]),
        lambda: tg.replicate(nn.Linear(2, 2), [0, 1]),
        lambda: tg.data_parallel(nn.Linear(2, 2), x, [0, 1]),
        lambda: tg.DataParallel(nn.Linear(2, 2), device_ids=[0, 1]),
        lambda: tg.parallel_apply(torch.neg, [x, x], devices=[0, 1]),
        lambda: tg.gather([x, x], 0),
    ):
        with pytest.raises(tg.DeviceError, match=r"^device 0 \(that is cuda:0\) is a CUDA device"):
            call()


def test_cpu_0_is_the_cpu_in_every_entry_point() -> None:
    """torch keeps CPU tensors and parameters on ``cpu`` whatever the index, so ``"cpu:0"`` (or
    ``torch.device("cpu", 0)``) is that device: a module on the CPU runs on it."""
    x = torch.arange(8.0).view(4, 2)
    net = nn.Linear(2, 3)
    for cpu0 in ("cpu:0", torch.device("cpu", 0)):
        assert as_device(cpu0) == torch.device("cpu")
        assert as_devices([cpu0, "cpu"]) == (torch.device("cpu"),) * 2
        assert tg.gather([x, x], cpu0).device == torch.device("cpu")
        assert tg.scatter(x, [cpu0, cpu0]).devices == (torch.device("cpu"),) * 2
        torch.testing.assert_close(tg.data_parallel(net, x, [cpu0]), net(x))
        torch.testing.assert_close(tg.data_parallel(net, x, [cpu0, cpu0]), net(x))
        torch.testing.assert_close(tg.DataParallel(net, device_ids=[cpu0, cpu0])(x), net(x))
        assert len(tg.replicate(net, [cpu0, cpu0])) == 2


def test_other_cpu_indices_are_a_device_error_saying_to_repeat_cpu() -> None:
    """``devices=["cpu:0", "cpu:1"]``: a DeviceError naming the entry and saying to write
    ``["cpu"] * 2`` (it was a RuntimeError from the module check whose hint,
    ``module.to('cpu:0')``, cannot help: torch keeps CPU parameters on ``cpu``)."""
    x = torch.ones(4, 2)
    net = nn.Linear(2, 2)
    for cpu1 in ("cpu:1", torch.device("cpu", 1)):
        many = r"\['cpu'\] \* 3"
        for call, where in (
            (lambda: tg.scatter(x, ["cpu:0", "cpu", cpu1]), "devices[2]"),  # noqa: B023
            (lambda: tg.replicate(net, ["cpu", cpu1, "cpu"]), "devices[1]"),  # noqa: B023
            (lambda: tg.data_parallel(net, x, ["cpu:0", cpu1, "cpu"]), "devices[1]"),  # noqa: B023
            (lambda: tg.DataParallel(net, device_ids=[cpu1, "cpu", "cpu"]), "device_ids[0]"),  # noqa: B023
            (lambda: tg.explain(x, None, ["cpu", "cpu", cpu1]), "devices[2]"),  # noqa: B023
        ):
            with pytest.raises(tg.DeviceError) as info:
                call()
            message = str(info.value)
            assert message.startswith(f"{where} is "), message
            assert "torch has one CPU device" in message and "cpu:1" in message
            assert re.search(many + "$", message), message
        with pytest.raises(tg.DeviceError, match=r"torch has one CPU device.*\['cpu'\] \* 2$"):
            tg.gather([x, x], cpu1)
        with pytest.raises(tg.DeviceError, match=r"torch has one CPU device"):
            tg.data_parallel(net, x, [cpu1])
    assert torch.ones(1, device="cpu:1").device == torch.device("cpu")  # why: no device of its own


def test_error_classes_are_public_and_refine_builtins() -> None:
    assert issubclass(tg.DeviceError, tg.TreegatherError) and issubclass(tg.DeviceError, ValueError)
    assert issubclass(tg.ArgumentTypeError, tg.TreegatherError)
    assert issubclass(tg.ArgumentTypeError, TypeError)


# ------------------------------------------------------------------------------------ dim


def test_check_dim_accepts_ints() -> None:
    assert check_dim(0, "scatter") == 0
    assert check_dim(-2, "gather") == -2
    assert type(check_dim(torch.tensor(1).item(), "gather")) is int


@pytest.mark.parametrize(
    ("dim", "message"),
    [
        (
            True,
            "scatter: dim must be an int (a tensor dim, negative from the end), got bool True; "
            "write dim=0 or dim=1 (a bool is not a dim)",
        ),
        (
            1.0,
            "scatter: dim must be an int (a tensor dim, negative from the end), got float 1.0; "
            "write dim=1",
        ),
        (
            "0",
            "scatter: dim must be an int (a tensor dim, negative from the end), got str '0'; "
            "write an int such as dim=0",
        ),
        (
            None,
            "scatter: dim must be an int (a tensor dim, negative from the end), got NoneType "
            "None; write an int such as dim=0",
        ),
    ],
)
def test_check_dim_refuses_bools_floats_and_others(dim: object, message: str) -> None:
    with pytest.raises(tg.ArgumentTypeError) as info:
        check_dim(dim, "scatter")
    assert str(info.value) == message
    assert isinstance(info.value, TypeError)
