"""Device arguments in torch's conventions: ints, strings, ``torch.device``; ``-1`` is the CPU."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch

from ._caches import LRU
from ._errors import ArgumentTypeError, DeviceError, safe_repr

__all__ = ["DeviceLike", "as_device", "as_devices", "accelerator_tensors_possible"]

DeviceLike = Union[int, str, torch.device]  # noqa: UP007 - a runtime alias

# Keyed by (exact type, value): True == 1 and 1.0 == 1 hash alike and must not find cuda:1.
_CACHE: LRU[tuple[type, object], torch.device] = LRU("devices", maxsize=256, trees=False)
_KEY_TYPES = (int, str, torch.device)
# Device lists, keyed by their items and the items' types.
_LISTS: LRU[tuple[object, ...], tuple[torch.device, ...]] = LRU(
    "device lists", maxsize=64, trees=False
)


def as_device(device: DeviceLike) -> torch.device:
    """Normalise ``device`` to a :class:`torch.device`.

    An int ``i >= 0`` is ``cuda:i`` (torch's ``device_ids`` convention), ``-1`` is the CPU.

    >>> as_device(-1), as_device("cpu"), as_device(torch.device("cpu"))
    (device(type='cpu'), device(type='cpu'), device(type='cpu'))
    >>> as_device("cpu:0")  # torch keeps CPU tensors on "cpu": the same device
    device(type='cpu')
    >>> as_device("gpu:0")
    Traceback (most recent call last):
    ...
    treegather.DeviceError: not a device: 'gpu:0' (...); write 'cpu', 'cuda:0', ...

    Raises:
        DeviceError: an unknown device string, an index below ``-1``, a CPU index other than
            0 (``"cpu:1"``: torch has one CPU device), or a CUDA device (an int id counts) where
            CUDA is not available.
        ArgumentTypeError: neither an int, a string nor a ``torch.device`` (``True``, ``1.0``).
    """
    if isinstance(device, torch.device) and device.type != "cuda" and device.index is None:
        return device  # nothing to normalise or check
    kind = type(device)
    if kind in _KEY_TYPES:
        hit = _CACHE.get((kind, device))
        if hit is not None:
            return hit
    out = _normalise(device)
    # "cuda" and torch.device("cuda") mean the current device, which may change.
    if kind in _KEY_TYPES and not (out.type == "cuda" and _without_index(device)):
        _CACHE.put((kind, device), out)
    return out


def _normalise(device: object) -> torch.device:
    if isinstance(device, torch.device):
        out = device
    elif isinstance(device, bool) or not isinstance(device, (int, str)):
        raise ArgumentTypeError(
            f"not a device: {safe_repr(device)} ({type(device).__name__}; expected an int, a "
            "string such "
            "as 'cuda:0' or 'cpu', or a torch.device)"
        )
    elif isinstance(device, int):
        if device < -1:
            raise DeviceError(f"device index must be >= -1 (-1 is the CPU), got {device}")
        out = torch.device("cpu") if device == -1 else torch.device("cuda", device)
    else:
        try:
            out = torch.device(device)
        except (RuntimeError, ValueError) as exc:
            raise DeviceError(
                f"not a device: {device!r} ({str(exc).splitlines()[0]}); write 'cpu', 'cuda:0', "
                "an int CUDA index, or -1 for the CPU"
            ) from None
    if out.type == "cpu" and out.index is not None:
        if out.index != 0:
            raise DeviceError(_indexed_cpu(device, None, 0))
        out = torch.device("cpu")  # torch keeps every CPU tensor on "cpu", whatever "cpu:0" said
    if out.type == "cuda":
        if not torch.cuda.is_available():
            given = str(device) if isinstance(device, torch.device) else repr(device)
            named = given if given.strip("'") == str(out) else f"{given} (that is {out})"
            raise DeviceError(
                f"device {named} is a CUDA device, but CUDA is not available on this machine "
                "(torch.cuda.is_available() is False); use 'cpu' or -1, repeated for several "
                "replicas (e.g. ['cpu'] * 4)"
            )
        if out.index is None:
            out = torch.device("cuda", torch.cuda.current_device())
    return out


def _indexed_cpu(given: object, where: str | None, count: int) -> str:
    """Why ``'cpu:1'`` is no device of its own, and what to write instead."""
    named = str(given) if isinstance(given, torch.device) else repr(given)
    many = f"['cpu'] * {count}" if count > 1 else "['cpu'] * 2"
    return (
        f"{where + ' is ' if where else ''}{named}, but torch has one CPU device: it keeps CPU "
        f"tensors and parameters on 'cpu' whatever the index (torch.ones(1, device={named})"
        ".device is cpu), so a CPU index names no device of its own; write 'cpu' (or -1), "
        f"repeated for several CPU replicas: {many}"
    )


def _cpu_index(device: object) -> int | None:
    """The index of a CPU device written with one (``'cpu:1'``), else ``None``."""
    if isinstance(device, torch.device):
        found = device
    elif isinstance(device, str):
        try:
            found = torch.device(device)
        except (RuntimeError, ValueError):
            return None
    else:
        return None
    return found.index if found.type == "cpu" else None


def _without_index(device: object) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).index is None


def as_devices(
    devices: Sequence[DeviceLike] | DeviceLike, name: str = "devices"
) -> tuple[torch.device, ...]:
    """Normalise a device list; a single device is a list of one. ``name``: the argument's, for
    errors.

    >>> as_devices(["cpu", -1])
    (device(type='cpu'), device(type='cpu'))

    torch has one CPU device: ``"cpu:0"`` is ``"cpu"``, and ``"cpu:1"`` is an error (repeat
    ``"cpu"`` for several CPU replicas):

    >>> as_devices(["cpu:0", "cpu:1"])
    Traceback (most recent call last):
    ...
    treegather.DeviceError: devices[1] is 'cpu:1', but torch has one CPU device: ...: ['cpu'] * 2
    """
    if isinstance(devices, (int, str, torch.device)):
        return (as_device(devices),)
    items = devices if type(devices) in (list, tuple) else list(devices)
    try:  # the same list each step: one lookup (keyed by every item and its type)
        key: Any = (*items, *map(type, items))
        hit = _LISTS.get(key)
    except TypeError:  # an unhashable item: not a device, as_device says so below
        key = hit = None
    if hit is not None:
        return hit
    try:
        out = tuple(as_device(d) for d in items)
    except DeviceError:
        for i, d in enumerate(items):  # name the entry, and the list to write instead
            if _cpu_index(d):
                raise DeviceError(_indexed_cpu(d, f"{name}[{i}]", len(items))) from None
        raise
    if not out:
        raise ValueError("devices must name at least one device")
    # "cuda" and torch.device("cuda") mean the current device, which may change.
    if key is not None and not any(
        d.type == "cuda" and _without_index(x) for d, x in zip(out, items)
    ):
        _LISTS.put(key, out)
    return out


# The kind of a device tuple (by identity: as_devices hands back the same tuple for the same list).
_KINDS: LRU[int, tuple[tuple[torch.device, ...], str]] = LRU(
    "device kinds", maxsize=64, trees=False
)


def kind(devs: tuple[torch.device, ...]) -> str:
    """``"cpu"`` or ``"cuda"`` when every device of ``devs`` is of that type, else ``"mixed"``.

    >>> kind(as_devices(["cpu"] * 2)), kind(as_devices(["cpu", "meta"]))
    ('cpu', 'mixed')
    """
    found = _KINDS.get(id(devs))
    if found is not None and found[0] is devs:
        return found[1]
    types = {d.type for d in devs}
    out = types.pop() if len(types) == 1 and types <= {"cpu", "cuda"} else "mixed"
    _KINDS.put(id(devs), (devs, out))
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
