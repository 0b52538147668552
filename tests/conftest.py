"""Shared fixtures: one ``devices`` fixture (CPU always, CUDA when present); caches cleared
before every test."""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import spawned_groups
import torch
import torch.distributed as dist
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


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per multi-device step of ``data_parallel`` or ``DataParallel``: True when its
    replicas were built anew, False when kept ones were re-bound (issue 14)."""
    import treegather._parallel.step as step_module

    log: list[bool] = []
    real = step_module.take  # looked up there by _replicas_for_step (both entry points)

    def take(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        log.append(result[2])
        return result

    monkeypatch.setattr(step_module, "take", take)
    return log


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: tiny ops (BatchNorm of 3 rows) wait on a busy thread pool else."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A gloo group of this process alone (a HashStore: no port), for single-rank checks."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(params=_device_sets())
def devices(request: pytest.FixtureRequest) -> list[str]:
    """A list of devices to run replicas on: repeated CPU always, CUDA when present."""
    return list(request.param)


PACKAGE = pathlib.Path(treegather.__file__).resolve().parent
DOCTESTS = pytest.StashKey[list[str]]()
"""The doctests this run collected (when it collected the package), and those that skipped."""
SKIPPED_DOCTESTS = pytest.StashKey[list[str]]()
MIN_DOCTESTS = 20


Job = tuple[Any, Callable[[], Callable[[], Any]]]  # a key, and what makes its job


def _background_job(item: pytest.Item) -> Job | None:
    """The multi-process run (or fresh interpreter) a test reads its results from: a gloo
    group, the torchrun launch, or what the test's module names (its ``background_job``)."""
    world = spawned_groups.world_of(item)
    if world is not None:
        return ("group", world), functools.partial(spawned_groups.group_job, world)
    if "torchrun_outputs" in getattr(item, "fixturenames", ()):
        return ("torchrun",), lambda: functools.partial(
            _torchrun, spawned_groups.scratch("torchrun")
        )
    own = getattr(getattr(item, "module", None), "background_job", None)
    return own(item) if own is not None else None  # type: ignore[no-any-return]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The tests that read a multi-process run's results go last, in their order: their runs
    # start at collection, in the background (pytest_collection_finish), and have the
    # single-process tests' time to finish.
    items.sort(key=lambda item: _background_job(item) is not None)  # (a stable sort)
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


def pytest_collection_finish(session: pytest.Session) -> None:
    """The multi-process runs the selected tests need (the gloo groups, the torchrun launch,
    the notebooks' kernels, fresh interpreters) start now, in the background, one after another in the order the tests need them: they
    run while the single-process tests do, and their tests wait for them."""
    jobs = dict(job for job in map(_background_job, session.items) if job is not None)
    for key, make in jobs.items():
        spawned_groups.start(key, make())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A doctest that skipped did not run: the run fails (every example must run on CPU)."""
    spawned_groups.stop()  # (what still runs in the background is stopped)
    skipped = session.config.stash.get(SKIPPED_DOCTESTS, [])
    if skipped:
        print(f"\n{len(skipped)} doctest(s) skipped, which must run: {', '.join(skipped)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


TORCHRUN_DEADLINE_S = 150.0  # the four scripts below, one launch


@pytest.fixture(scope="session")
def torchrun_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The stdout of each script that runs under ``torchrun --nproc-per-node 2`` (the
    notebooks' scripts, the frameworks guide's Hugging Face Trainer part, the README's "Across
    processes" blocks), from one launch (started at collection, in the background, where the
    session's tests were collected)."""
    job = spawned_groups.started(("torchrun",))
    if job is not None:
        return job.result()  # type: ignore[no-any-return]
    return _torchrun(tmp_path_factory.mktemp("torchrun"))


def _torchrun(tmp: pathlib.Path) -> dict[str, str]:
    import readme_blocks
    import torchrun_scripts

    readme = tmp / "readme_across.py"
    readme.write_text(readme_blocks.across_script())
    notebooks = torchrun_scripts.ROOT / "notebooks"
    trainer = tmp / "frameworks_transformers.py"  # (the guide's Hugging Face part alone)
    guide = str(notebooks / "frameworks.py")
    trainer.write_text(
        f"import runpy, sys\nsys.argv = [{guide!r}, 'transformers']\n"
        f"runpy.run_path({guide!r}, run_name='__main__')\n"
    )
    scripts = {
        "ddp_eval": notebooks / "ddp_eval.py",
        "contrastive": notebooks / "contrastive.py",
        "readme": readme,
        "frameworks_transformers": trainer,
    }
    return torchrun_scripts.launch(scripts, tmp, TORCHRUN_DEADLINE_S, stop=spawned_groups.STOP)
