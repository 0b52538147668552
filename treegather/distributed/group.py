"""The process group of a :mod:`treegather.distributed` call: ranks, devices, and its state.

:func:`group` resolves ``group=`` once per call. What never changes for a process group (this
process's rank, the global ranks, the kind of device its object collectives use, the backend
config; for the default group on CPU, the whole :class:`Group`) is looked up once per group and
kept in a cache (:class:`Facts`, in the :class:`~treegather._caches.WeakCache`
``distributed.groups``, keyed weakly by the group object). :func:`treegather.clear_caches`
empties it, harmlessly: the next call looks the same facts up again.

The *inline capacity* (:class:`ProtocolState`) is protocol state, not a cache, and the group's
kept receive buffer (:func:`receive_buffer`) a cache: ARCHITECTURE.md, "The wire plan, in detail".
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .._caches import WeakCache
from .._errors import ArgumentTypeError

__all__ = [
    "BAD_ROOT",
    "Facts",
    "Group",
    "ProtocolState",
    "data_device",
    "group",
    "placement",
    "Problem",
    "receive_buffer",
    "root_rank",
    "target",
]


class ProtocolState:
    """What every rank of a process group must keep identical between calls: not a cache."""

    __slots__ = ("__weakref__", "capacity")

    def __init__(self) -> None:
        self.capacity = 0  # bytes of payload the next first collective carries per rank


class Facts:
    """What never changes for a process group (a cache entry: looked up again when cleared)."""

    __slots__ = ("accelerator_kind", "fixed", "kind", "rank", "ranks", "state")

    def __init__(
        self,
        rank: int,
        ranks: list[int],
        kind: str,
        accelerator_kind: str | None,
        state: ProtocolState,
    ) -> None:
        self.rank = rank
        self.ranks = ranks
        self.kind = kind  # the device type of object collectives ("cpu" for gloo)
        self.accelerator_kind = accelerator_kind  # a native accelerator backend, if any
        self.state = state  # the group's protocol state (held by _PROTOCOL, not by this cache)
        self.fixed: Group | None = None  # the default group's Group, when on CPU only


class Group(NamedTuple):
    handle: Any  # the ProcessGroup (the default group's object for ``group=None``)
    rank: int  # this process's rank in the group
    ranks: list[int]  # global rank of each group rank
    device: torch.device  # where the small exchanges run (torch's object-collective device)
    accelerator: torch.device | None  # this process's current accelerator, if the group has one
    state: ProtocolState


# The fixed facts of each process group: a cache, keyed weakly by the ProcessGroup.
_FACTS: WeakCache[Any, Facts] = WeakCache("distributed.groups", maxsize=64, trees=False)
# The protocol state of each process group: NOT a cache (see the module docstring), so not in
# the registry that clear_caches() empties. Keyed weakly by the ProcessGroup: a destroyed and
# re-created group starts afresh on every rank.
_PROTOCOL: weakref.WeakKeyDictionary[Any, ProtocolState] = weakref.WeakKeyDictionary()
# The receive buffer each group keeps for its next large wire-plan call (a cache: clearing it on
# one rank only changes where that rank receives, not what any rank sends).
_KEPT: WeakCache[ProtocolState, torch.Tensor] = WeakCache(
    "distributed.receive_buffers", maxsize=8, trees=False
)
MAX_KEPT = 128 << 20  # bytes: larger receive buffers are never kept


def group(handle: Any) -> Group:
    """The :class:`Group` for ``group=`` (``None``: the default group)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() "
            "on every rank (torchrun sets the environment it needs) before treegather.distributed."
        )
    pg = handle if handle is not None else dist.group.WORLD
    facts = _FACTS.get(pg)
    if facts is None:
        facts = _new_facts(handle, pg)
    fixed = facts.fixed
    if fixed is not None and handle is None:
        return fixed
    device = _device(facts.kind)
    accelerator = device if device.type != "cpu" else None
    if accelerator is None and facts.accelerator_kind is not None:
        accelerator = _device(facts.accelerator_kind)
    found = Group(handle, facts.rank, facts.ranks, device, accelerator, facts.state)
    # The default group on CPU only: no current device to follow (and no reference from the
    # facts to a group object, which keys them weakly).
    if accelerator is None and handle is None:
        facts.fixed = found
    return found


def _new_facts(handle: Any, pg: Any) -> Facts:
    rank = dist.get_rank(handle)
    if rank < 0:
        raise ValueError("this process is not a member of the process group passed as group=")
    ranks = list(dist.get_process_group_ranks(pg))
    facts = Facts(rank, ranks, _comm_kind(handle), _accelerator_kind(pg), _protocol_state(pg))
    try:
        _FACTS.put(pg, facts)
    except TypeError:  # not weakly referenceable: looked up on every call
        pass
    return facts


def _protocol_state(pg: Any) -> ProtocolState:
    """The group's protocol state, kept for as long as the group lives (never cleared)."""
    try:
        state = _PROTOCOL.get(pg)
    except TypeError:  # not weakly referenceable: a fresh state per call (capacity stays 0)
        return ProtocolState()
    if state is None:
        state = _PROTOCOL.setdefault(pg, ProtocolState())
    return state


def _comm_kind(handle: Any) -> str:
    """The device type collectives of ``group`` run on: CPU for gloo, the GPU for NCCL."""
    pick = getattr(dist.distributed_c10d, "_get_object_coll_device", None)
    if pick is not None:
        return str(pick(handle))
    return "cuda" if "nccl" in str(dist.get_backend(handle)).lower() else "cpu"


def _device(kind: str) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)
    index = (
        module.current_device() if module is not None and hasattr(module, "current_device") else 0
    )
    return torch.device(kind, index)


def _accelerator_kind(pg: Any) -> str | None:
    """The accelerator a group has a native backend for.

    ``"cpu:gloo,cuda:nccl"`` (torch's default on GPU machines) qualifies; plain ``"gloo"``
    (which torch lists as ``"cpu:gloo,cuda:gloo"``) does not: gloo stages GPU tensors through
    the CPU anyway.
    """
    try:
        config = str(dist.get_backend_config(pg))
    except (AttributeError, RuntimeError, ValueError):
        return None
    for entry in config.split(","):
        kind, _, backend = entry.partition(":")
        if kind in ("", "cpu") or backend in ("", "gloo"):
            continue
        module = getattr(torch, kind, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            return kind
    return None


def placement(g: Group, devices: frozenset[torch.device]) -> int:
    """What this rank's tensors want: 0 the exchange device, 1 the accelerator, 2 either."""
    if g.accelerator is None or g.device == g.accelerator:
        return 0
    if not devices:
        return 2
    return 1 if all(d.type == g.accelerator.type for d in devices) else 0


def data_device(g: Group, placements: Sequence[int]) -> torch.device:
    """Carry tensor bytes on the accelerator when every rank's tensors live there.

    A group with several backends (``"cpu:gloo,cuda:nccl"``, torch's default on GPU machines)
    runs object collectives on the CPU; tensors already on the GPU then go through NCCL instead.
    """
    flags = set(placements)
    if g.accelerator is not None and 0 not in flags and 1 in flags:
        return g.accelerator
    return g.device


BAD_ROOT = -2  # the root of a call whose dst/src names no rank of the group (-1: no root)
# What is wrong with a rank's arguments, found before the first exchange: (error class, text).
Problem = tuple[type[Exception], str]


def root_rank(g: Group, rank: Any, name: str) -> tuple[int, Problem | None]:
    """Map a global ``dst``/``src`` rank to its rank in the group, or ``(BAD_ROOT, why)``.

    Never raises: the other ranks may already wait in the first exchange, which carries the
    problem, so that every rank raises it (:mod:`treegather.distributed.exchange`). Ints
    and integer types with ``__index__`` (``numpy.int64``) are ranks; ``True`` is not.
    """
    if type(rank) is int and rank in g.ranks:
        return g.ranks.index(rank), None
    value = None
    if not isinstance(rank, bool):
        try:
            value = operator.index(rank)
        except TypeError:
            pass
    if value is None:
        got = f"{type(rank).__name__} {_shown(rank)}"
        return BAD_ROOT, (ArgumentTypeError, f"{name} must be an int (a global rank), got {got}")
    if value not in g.ranks:
        return BAD_ROOT, (
            ValueError,
            f"{name}={_shown(rank)} is not a rank of the process group (ranks {g.ranks})",
        )
    return g.ranks.index(value), None


def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # a repr that raises must not hide the error it describes
        text = f"<{type(value).__qualname__} object>"
    return text if len(text) <= 80 else text[:77] + "..."


def target(devices: frozenset[torch.device], carrier: torch.device) -> torch.device:
    """Results go where this rank's tensors are; if they are spread out, where the bytes came."""
    if len(devices) == 1:
        return next(iter(devices))
    return carrier if devices else torch.device("cpu")


def receiving_device(kind: str) -> torch.device:
    """This rank's device of the kind the sender's tensor was on (its current one), else CPU."""
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)
    if module is not None and getattr(module, "is_available", lambda: False)():
        return torch.device(kind, module.current_device())
    return torch.device("cpu")


def receive_buffer(g: Group, nbytes: int, device: torch.device, *, keep: bool) -> torch.Tensor:
    """A ``uint8`` buffer of ``nbytes`` on ``device`` for a payload collective.

    With ``keep`` (the results will not alias the buffer), a CPU buffer of up to ``MAX_KEPT``
    bytes is kept for the group's next call, and the kept one is reused when it is at least
    ``nbytes`` and at most twice that. (GPU memory is reused by torch's caching allocator.)
    """
    if not keep or device.type != "cpu" or nbytes > MAX_KEPT:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    kept = _KEPT.get(g.state)
    if kept is not None and kept.device == device and nbytes <= kept.numel() <= 2 * nbytes:
        return kept[:nbytes]
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    _KEPT.put(g.state, buf)
    return buf
