"""Shared fixtures: one ``devices`` fixture (CPU always, CUDA when present); caches cleared
before every test."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from _pytest.doctest import DoctestItem
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


PACKAGE = pathlib.Path(treegather.__file__).resolve().parent
DOCTESTS = pytest.StashKey[list[str]]()
"""The doctests this run collected (when it collected the package), and those that skipped."""
SKIPPED_DOCTESTS = pytest.StashKey[list[str]]()
MIN_DOCTESTS = 20


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The doctests run once, in this session (the test command collects treegather/ with
    # --doctest-modules): a run that collects the package must find them, or it fails here.
    if any(pathlib.Path(arg).resolve() == PACKAGE for arg in config.args):
        found = [item.nodeid for item in items if isinstance(item, DoctestItem)]
        if len(found) <= MIN_DOCTESTS:
            raise pytest.UsageError(
                f"only {len(found)} doctests collected from treegather/ (expected more than "
                f"{MIN_DOCTESTS}): is --doctest-modules still in pyproject.toml's addopts?"
            )
        config.stash[DOCTESTS] = found
        config.stash[SKIPPED_DOCTESTS] = []
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA; none is available on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    skipped = _config.stash.get(SKIPPED_DOCTESTS, None) if _config is not None else None
    if skipped is not None and report.skipped and "::" in report.nodeid:
        if report.nodeid in _config.stash[DOCTESTS]:  # type: ignore[union-attr]
            skipped.append(report.nodeid)


_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A doctest that skipped did not run: the run fails (every example must run on CPU)."""
    skipped = session.config.stash.get(SKIPPED_DOCTESTS, [])
    if skipped:
        print(f"\n{len(skipped)} doctest(s) skipped, which must run: {', '.join(skipped)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


TORCHRUN_DEADLINE_S = 120.0  # the three scripts below, one launch


@pytest.fixture(scope="session")
def torchrun_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The stdout of each script that runs under ``torchrun --nproc-per-node 2`` (the
    notebooks' scripts, the README's "Across processes" blocks), from one launch."""
    import readme_blocks
    import torchrun_scripts

    tmp = tmp_path_factory.mktemp("torchrun")
    readme = tmp / "readme_across.py"
    readme.write_text(readme_blocks.across_script())
    notebooks = torchrun_scripts.ROOT / "notebooks"
    scripts = {
        "ddp_eval": notebooks / "ddp_eval.py",
        "contrastive": notebooks / "contrastive.py",
        "readme": readme,
    }
    return torchrun_scripts.launch(scripts, tmp, TORCHRUN_DEADLINE_S)
