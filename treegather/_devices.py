"""TEMPORARY stub of the foundation's device helpers (replaced by main's module at the merge)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

DeviceLike = int | str | torch.device


def as_device(device: DeviceLike) -> torch.device:
    """Normalise ``device``: int ``i`` is ``cuda:i``, ``-1`` is the CPU."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, int):
        return torch.device("cpu") if device == -1 else torch.device("cuda", device)
    return torch.device(device)


def as_devices(devices: Sequence[DeviceLike] | DeviceLike) -> tuple[torch.device, ...]:
    """Normalise a device list."""
    if isinstance(devices, (int, str, torch.device)):
        return (as_device(devices),)
    return tuple(as_device(d) for d in devices)
