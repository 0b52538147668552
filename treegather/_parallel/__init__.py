"""Data parallelism's replicate and apply steps, and the entry points that compose all four.

Read in one direction: fresh replica shells (:mod:`.shells`), replicas kept across steps
(:mod:`.kept`, built from shells), :func:`replicate` (either), :func:`parallel_apply`
(:mod:`.apply`, with the TorchScript fan-out in :mod:`.fork` and the failure reports in
:mod:`.failures`), one data-parallel step's replicas (:mod:`.step`), and the entry points:
:func:`data_parallel` (:mod:`.data_parallel`) and the ``torch.nn.DataParallel`` adapter
(:mod:`.nn`: :class:`DataParallel`, :func:`patch`).
"""

from __future__ import annotations

from .apply import Backend, parallel_apply, parallel_apply_async
from .data_parallel import data_parallel
from .nn import DataParallel, patch
from .replicate import replicate

__all__ = [
    "Backend",
    "DataParallel",
    "data_parallel",
    "parallel_apply",
    "parallel_apply_async",
    "patch",
    "replicate",
]
