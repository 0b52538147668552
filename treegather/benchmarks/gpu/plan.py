"""What one run of the GPU check does: its sizes on the chip and in the dry run, and what a
stage hands back (its rows, or why it skipped or failed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

__all__ = ["DRY_RUN", "ON_CHIP", "Found", "Plan", "StageFailed", "StageSkipped"]

Row = dict[str, Any]

ROOT = Path(__file__).resolve().parents[3]
"""The checkout the package was imported from (its ``tests/`` hold the test suite)."""

FAST_TESTS = "cuda or not (distributed or notebook or transformers)"
"""The test stage's marker expression: every cuda-marked test, and the suite's tests that
spawn no process group, run no notebook and build no transformers model."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizes of one run: :data:`ON_CHIP` (one CUDA device) or :data:`DRY_RUN` (the CPU)."""

    device: str
    """Where the replicas go, repeated :attr:`replicas` times (``"cuda:0"`` or ``"cpu"``)."""
    replicas: int = 2
    leaves: tuple[int, ...] = (10, 100, 1000)
    """The scatter/gather batches' leaf counts (and those of the copies counted)."""
    rounds: int = 9
    """Interleaved timing rounds of the scatter/gather stage and the evaluation."""
    target_s: float = 0.05
    """The length of one timing sample of the scatter/gather stage."""
    step_models: tuple[str, ...] = ("bert12", "llama")
    """The step stage's models: the 12-layer benchmark BERT and a tiny transformers model
    (:data:`~treegather.benchmarks.architectures.ARCHITECTURES`)."""
    step_batch: int = 16
    step_rounds: int = 5
    step_target_s: float = 0.2
    bert_layers: int = 12
    bert_vocab: int = 30522
    test_paths: tuple[str, ...] = ("tests",)
    test_keyword: str | None = None
    """A ``pytest -k`` expression narrowing the test stage (the dry run's)."""
    test_timeout_s: float = 200.0
    dist_leaves: tuple[int, ...] = (10, 100, 1000)
    dist_repeats: int = 15
    eval_samples: int = 10_001
    eval_batch: int = 64
    ranks_timeout_s: float = 120.0

    @property
    def cuda(self) -> bool:
        """Whether the replicas are on a CUDA device."""
        return self.device.startswith("cuda")


ON_CHIP = Plan(device="cuda:0")
"""One CUDA device, ``cuda:0`` repeated twice: at most 6 minutes in all (the tests take most)."""

DRY_RUN = Plan(
    device="cpu",
    rounds=2,
    target_s=0.002,
    step_batch=8,
    step_rounds=1,
    step_target_s=0.001,
    bert_layers=2,
    bert_vocab=64,
    # the cuda-marked tests of two files (they skip here) and the devices' CUDA checks
    test_paths=("tests/test_transfer.py", "tests/test_devices.py"),
    test_keyword="cuda",
    test_timeout_s=90.0,
    dist_leaves=(10, 100),
    dist_repeats=3,
    eval_samples=257,
    eval_batch=32,
    ranks_timeout_s=90.0,
)
"""Every stage on repeated CPU devices, small and short: the command cannot rot unseen."""


@dataclasses.dataclass
class Found:
    """What a stage measured: its rows (one table), a one-line summary, and notes."""

    rows: list[Row]
    summary: str
    notes: list[str] = dataclasses.field(default_factory=list)


class StageSkipped(Exception):
    """The stage cannot run here (no CUDA, an optional package missing): why, in words."""


class StageFailed(AssertionError):
    """The stage ran and something failed; ``rows`` holds what it measured up to then."""

    def __init__(self, message: str, rows: list[Row] | None = None) -> None:
        super().__init__(message)
        self.rows = rows or []
