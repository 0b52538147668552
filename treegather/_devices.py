"""Device arguments in torch's conventions: ints, strings, ``torch.device``; ``-1`` is the CPU."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch

__all__ = ["DeviceLike", "as_device", "as_devices", "accelerator_tensors_possible"]

DeviceLike = Union[int, str, torch.device]  # noqa: UP007 - a runtime alias

_CACHE: dict[tuple[type, object], torch.device] = {}


def as_device(device: DeviceLike) -> torch.device:
    """Normalise ``device`` to a :class:`torch.device`.

    An int ``i >= 0`` is ``cuda:i`` (torch's ``device_ids`` convention), ``-1`` is the CPU.

    >>> as_device(-1), as_device("cpu"), as_device(torch.device("cpu"))
    (device(type='cpu'), device(type='cpu'), device(type='cpu'))
    >>> as_device(1)
    device(type='cuda', index=1)
    """
    # Keyed by type too: True == 1 and 1.0 == 1 hash alike and must not find cuda:1.
    key = (type(device), device)
    try:
        return _CACHE[key]
    except (KeyError, TypeError):
        pass
    if isinstance(device, torch.device):
        out = device
    elif isinstance(device, bool):
        raise TypeError(f"not a device: {device!r}")
    elif isinstance(device, int):
        if device < -1:
            raise ValueError(f"device index must be >= -1 (-1 is the CPU), got {device}")
        out = torch.device("cpu") if device == -1 else torch.device("cuda", device)
    elif isinstance(device, str):
        out = torch.device(device)
    else:
        raise TypeError(
            f"not a device: {device!r} (expected an int, a string such as 'cuda:0' or 'cpu', "
            "or a torch.device)"
        )
    if out.type == "cuda" and out.index is None and torch.cuda.is_available():
        out = torch.device("cuda", torch.cuda.current_device())
    if len(_CACHE) < 256 and not (isinstance(device, str) and device == "cuda"):
        _CACHE[key] = out
    return out


def as_devices(devices: Sequence[DeviceLike] | DeviceLike) -> tuple[torch.device, ...]:
    """Normalise a device list; a single device is a list of one.

    >>> as_devices(["cpu", -1])
    (device(type='cpu'), device(type='cpu'))
    """
    if isinstance(devices, (int, str, torch.device)):
        return (as_device(devices),)
    out = tuple(as_device(d) for d in devices)
    if not out:
        raise ValueError("devices must name at least one device")
    return out


_OTHER_ACCELERATOR: bool | None = None


def _other_accelerator_available() -> bool:
    """XPU or MPS present (fixed for the life of the process)."""
    global _OTHER_ACCELERATOR
    if _OTHER_ACCELERATOR is None:
        xpu = getattr(torch, "xpu", None)
        mps = getattr(torch.backends, "mps", None)
        _OTHER_ACCELERATOR = bool(
            (xpu is not None and xpu.is_available()) or (mps is not None and mps.is_available())
        )
    return _OTHER_ACCELERATOR


def accelerator_tensors_possible() -> bool:
    """False when no tensor in this process can live off the CPU (no accelerator initialised).

    The hot paths use it to skip per-leaf device checks on CPU-only runs.
    """
    # torch.cuda._initialized only ever turns True; read it directly on the hot path (falling
    # back to the public call should a torch release drop it).
    initialized = getattr(torch.cuda, "_initialized", None)
    if initialized is None:
        initialized = torch.cuda.is_initialized()
    if initialized:
        return True
    other = _OTHER_ACCELERATOR
    return _other_accelerator_available() if other is None else other
