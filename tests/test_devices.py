"""Device arguments in torch's conventions: ints, strings, torch.device; -1 is the CPU."""

from __future__ import annotations

import pytest
import torch

from treegather._devices import as_device, as_devices


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
def test_as_device(given: object, expected: torch.device) -> None:
    assert as_device(given) == expected  # type: ignore[arg-type]
    assert as_device(given) == expected  # type: ignore[arg-type]  # cached


def test_as_devices_single_and_many() -> None:
    assert as_devices(-1) == (torch.device("cpu"),)
    assert as_devices("cpu") == (torch.device("cpu"),)
    assert as_devices([-1, "cpu", 0]) == (torch.device("cpu"),) * 2 + (torch.device("cuda", 0),)
    with pytest.raises(ValueError, match="at least one device"):
        as_devices([])


@pytest.mark.parametrize("bad", [True, False, 1.0, 0.0, -1.0, None, [0]])
def test_bools_floats_and_others_are_not_devices_even_after_equal_ints(bad: object) -> None:
    # True == 1 and 1.0 == 1 hash alike: a cache keyed by value alone would answer cuda:1.
    as_device(0), as_device(1), as_device(-1)
    with pytest.raises(TypeError, match="not a device"):
        as_device(bad)  # type: ignore[arg-type]


def test_index_below_minus_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"device index must be >= -1 \(-1 is the CPU\), got -2"):
        as_device(-2)
