"""One data-parallel step's shards and replicas, shared by data_parallel and DataParallel.

Nothing split means one shard on the first device; a module's replicas for the step are its
kept ones, re-bound (:mod:`treegather._kept`), or fresh ones from :func:`treegather.replicate`,
after checking that the module is initialized (no lazy parameters) and on the source device.
The caller drops its references to the replicas before handing them back
(:func:`treegather._kept.give_back`), so that the kept shells can be stripped between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .._shards import Shards
from .kept import Kept, reusable, take
from .replicate import replicate


def _trim_unsplit(args_shards: Shards, kwargs_shards: Shards) -> tuple[Shards, Shards]:
    """Nothing was split: run once, on the first device (as torch does without inputs)."""
    if args_shards.sizes is not None or len(args_shards) <= 1:
        return args_shards, kwargs_shards
    devs = tuple(args_shards.devices[:1])
    return Shards(args_shards[:1], None, devs), Shards(kwargs_shards[:1], None, devs)


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
