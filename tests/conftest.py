"""Shared fixtures: one ``devices`` fixture (CPU always, CUDA when present); caches cleared
before every test."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import treegather

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("TREEGATHER_HYPOTHESIS_PROFILE", "ci"))

HAS_CUDA = torch.cuda.is_available()


def _device_sets() -> list[pytest.param]:
    params = [
        pytest.param(["cpu"], id="cpu1"),
        pytest.param(["cpu"] * 3, id="cpu3"),
    ]
    if HAS_CUDA:
        params.append(pytest.param(["cuda:0"] * 2, id="cuda0x2", marks=pytest.mark.cuda))
        n = torch.cuda.device_count()
        params.append(
            pytest.param([f"cuda:{i}" for i in range(n)], id=f"cuda_all{n}", marks=pytest.mark.cuda)
        )
    return params


@pytest.fixture(autouse=True)
def _cold_caches() -> None:
    """Every test starts cold, as in a fresh process: no structure, plan or compiled code
    cached by an earlier test can decide (or hide) what this one sees."""
    treegather.clear_caches()


@pytest.fixture(params=_device_sets())
def devices(request: pytest.FixtureRequest) -> list[str]:
    """A list of devices to run replicas on: repeated CPU always, CUDA when present."""
    return list(request.param)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA; none is available on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
