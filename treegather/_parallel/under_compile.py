"""Running eagerly under torch.compile: detect the compiler, and step outside of it.

treegather's entry points are not traced: called from a compiled function they run eagerly
(a graph break), through a ``torch.compiler.disable`` wrapper made once per function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._caches import LRU

# (torch's C hook that says whether a compiled frame's callback is set; read once)
_EVAL_FRAME_CALLBACK = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "get_eval_frame_callback", None
)


def _compiler_active() -> bool:
    """``torch.compile`` is tracing or running the calling frame (treegather must not be traced)."""
    if torch.compiler.is_compiling():
        return True
    return _EVAL_FRAME_CALLBACK is not None and _EVAL_FRAME_CALLBACK() is not None


_OUTSIDE_COMPILER: LRU[Callable[..., Any], Callable[..., Any]] = LRU(
    "data_parallel.outside_compiler", maxsize=8, trees=False
)


def _outside_compiler(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped in ``torch.compiler.disable``: run eagerly, nothing inside it traced.

    Made on first use only: importing ``torch._dynamo`` costs about a second, and a process
    that reaches this point has imported it already.
    """
    wrapped = _OUTSIDE_COMPILER.get(fn)
    if wrapped is None:
        reason = (
            f"treegather.{fn.__name__} runs eagerly; to compile the model, "
            f"pass torch.compile(model) to {fn.__name__} instead"
        )
        try:
            wrapped = torch.compiler.disable(fn, reason=reason)
        except TypeError:  # torch < 2.8 takes no reason
            wrapped = torch.compiler.disable(fn)
        _OUTSIDE_COMPILER.put(fn, wrapped)
    return wrapped
