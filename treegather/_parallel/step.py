"""One data-parallel step's shards and replicas, shared by data_parallel and DataParallel.

Nothing split means one shard on the first device; a module's replicas for the step are its
kept ones, re-bound (:mod:`treegather._kept`), or fresh ones from :func:`treegather.replicate`,
after checking that the module is initialized (no lazy parameters) and on the source device.
The caller drops its references to the replicas before handing them back
(:func:`treegather._kept.give_back`), so that the kept shells can be stripped between steps.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._combine import Inputs
from .._shards import Shards
from .kept import Kept, reusable, take
from .replicate import replicate


def _trim_unsplit(args_shards: Shards, kwargs_shards: Shards) -> tuple[Shards, Shards]:
    """Nothing was split: run once, on the first device (as torch does without inputs)."""
    if args_shards.sizes is not None or len(args_shards) <= 1:
        return args_shards, kwargs_shards
    devs = tuple(args_shards.devices[:1])
    return Shards(args_shards[:1], None, devs), Shards(kwargs_shards[:1], None, devs)


def calls_of(args: Sequence[Any], kwargs: Sequence[Mapping[str, Any]] | None) -> Inputs:
    """Each replica's call ``(args, kwargs)``, as :func:`treegather.parallel_apply` makes it
    (a tuple, not a namedtuple, is the positional arguments): what ``mean(weight=f)`` reads."""
    kws: Sequence[Mapping[str, Any]] = [{}] * len(args) if kwargs is None else kwargs
    return tuple(
        [
            (a if isinstance(a, tuple) and not hasattr(a, "_fields") else (a,), dict(kw))
            for a, kw in zip(args, kws)
        ]
    )


def _replicas_for_step(
    module: nn.Module, devices: Sequence[torch.device], source: torch.device
) -> tuple[list[nn.Module], Kept | None]:
    """This step's replicas: the kept shells re-bound when the module is unchanged (issue 14)."""
    detach = not torch.is_grad_enabled()
    if not reusable(module, devices):
        _check_module_device(module, source)
        return replicate(module, devices, detach=detach), None
    replicas, kept, fresh = take(
        module, devices, detach, before_build=lambda: _check_module_device(module, source)
    )
    if kept is not None and not fresh and not kept.on(_concrete(source)):
        _check_module_device(module, source)  # raises, naming the tensor
    return replicas, kept


def _concrete(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_module_device(module: nn.Module, device: torch.device) -> None:
    device = _concrete(device)
    for kind, named in (
        ("parameter", module.named_parameters()),
        ("buffer", module.named_buffers()),
    ):
        for name, t in named:
            if t.device != device:
                raise RuntimeError(
                    f"module must have its parameters and buffers on device {device} "
                    f"(devices[0]) but {kind} {name!r} is on {t.device}; move the module with "
                    f"module.to({str(device)!r}) or list {t.device} first"
                )


def hint_module_kwargs(
    exc: Exception,
    fn: Callable[..., Any],
    inputs: Any,
    module_kwargs: Mapping[str, Any] | None,
    dp: bool = False,
) -> None:
    """After a failed call, add to ``exc`` the hint ``module_kwargs=batch`` (``dp``:
    ``dp(**batch)``, for :class:`treegather.DataParallel`, whose ``inputs`` are the positional
    arguments) when a dict batch whose keys name parameters of ``fn`` (``forward`` for a
    module: every Hugging Face model) was passed as the one positional argument (the caller
    re-raises ``exc``; nothing is added to a step that does not fail)."""
    if dp:
        one = isinstance(inputs, tuple) and len(inputs) == 1
        names = _parameters_named_by(fn, inputs[0]) if one and not module_kwargs else []
    else:
        names = _parameters_named_by(fn, inputs) if not module_kwargs else []
    if names:
        module = isinstance(fn, nn.Module)
        owner = type(fn).__name__ + ".forward" if module else "fn"
        named = f"a dict whose keys name parameters of {owner} ({', '.join(names)})"
        if dp:
            hint = (
                f"Hint: dp(batch) got {named} as its one positional argument; to call "
                f"{owner}(**batch), pass its items as keywords: dp(**batch)"
            )
        else:
            hint = (
                f"Hint: inputs is {named} but it was passed as one positional argument; to "
                f"call {owner}(**batch), pass it as module_kwargs: "
                f"data_parallel({'model' if module else 'fn'}, (), devices, module_kwargs=batch)"
            )
        if hasattr(exc, "add_note"):
            exc.add_note(hint)
        else:  # pragma: no cover - Python 3.10
            exc.__notes__ = [*getattr(exc, "__notes__", ()), hint]


def _parameters_named_by(fn: Callable[..., Any], inputs: Any) -> list[str]:
    """The keys of a Mapping ``inputs`` that are parameter names of ``fn`` (or its forward)."""
    if not isinstance(inputs, Mapping):
        return []
    try:
        params = inspect.signature(fn.forward if isinstance(fn, nn.Module) else fn).parameters
    except (TypeError, ValueError):
        return []
    named = {
        name for name, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    return [k for k in inputs if isinstance(k, str) and k in named]
