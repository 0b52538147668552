"""treegather: data parallelism as pure functions over pytrees."""

from ._apply import parallel_apply, parallel_apply_async
from ._replicate import replicate

__all__ = [
    # replicate and apply (issue 3)
    "replicate",
    "parallel_apply",
    "parallel_apply_async",
]
