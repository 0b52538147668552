"""Each call of :mod:`treegather.distributed`, as one straight pipeline of four stages::

    describe  this rank's tree: its plan, its header, its payload (packed when it is small)
    exchange  the collectives: every rank's row, then payloads (and headers, when plans differ)
    place     what arrived, checked and read: every rank's leaves, or the default rules' result
    combine   the gather rules over the ranks' trees (gradients too, with ``sync_grads``)

The bodies of the public functions of :mod:`treegather.distributed` (whose docstrings document
the arguments); the Collector calls them too. The number of collectives never grows with the
number of leaves (ARCHITECTURE.md, "Across processes", counts every case).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import pickle
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

from .._errors import ArgumentTypeError, check_dim
from . import exchange
from .combine import combine
from .describe import describe
from .errors import StructuresDiffer, node_rows, raise_structure_mismatch
from .exchange import ALL_GATHER, GATHER, ROW_BYTES
from .group import Group, Problem, root_rank, target
from .group import group as process_group
from .payload import Local
from .place import place, sent

__all__ = ["all_gather", "broadcast", "collections_paused", "gather"]

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """Python's garbage collector paused for the block (resumed after, if it was on).

    A call makes objects per leaf that outlive it (the result's tensors and containers): with
    the collector on, a tree of 100,000 leaves set off collections that walk everything the
    process holds, again and again, and a leaf cost twice what it costs with it paused. The
    objects made here hold no cycles to find; the next collection, after the call, sees them
    once.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _paused(fn: F) -> F:
    """``fn`` run with the garbage collector paused (:func:`collections_paused`)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with collections_paused():
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


@_paused
def all_gather(
    tree: Any,
    layout: Any,
    group: Any,
    dim: int,
    sizes: int | None,
    sync_grads: bool,
    call: int = ALL_GATHER,
    *,
    handed: bool = False,
) -> Any:
    """:func:`treegather.distributed.all_gather`; ``call``: what the rows say it is (how errors
    name it: a Collector's exchange is one). ``handed``: ``tree`` is a list holding the tree,
    handed over, which the call empties, so that the tree's memory goes once it was sent (a
    Collector's payload)."""
    g = process_group(group)
    dim, problem = _checked_dim(dim)  # a bad dim travels in the first exchange: every rank raises
    sync = bool(sync_grads)
    local = _described(g, tree.pop() if handed else tree, layout, dim, sizes, sync)
    del tree
    arrived = exchange.all_gather(g, call, local, problem)
    if not sync and call != ALL_GATHER:  # (nothing reads the leaves now: their memory can go)
        local = local._replace(leaves=())
    try:
        placed = place(
            g.ranks, arrived, local, target(local.devices, arrived.buf.device), layout, dim
        )
    except StructuresDiffer:
        _name_differences(g, local, layout, dim)
    return combine(g, placed, local, layout, dim, sync, call == ALL_GATHER)


@_paused
def gather(
    tree: Any,
    dst: int,
    layout: Any,
    group: Any,
    dim: int,
    sizes: int | None,
    finish: Callable[[Any], Any] | None = None,
    call: int = GATHER,
    *,
    handed: bool = False,
) -> Any:
    """:func:`treegather.distributed.gather`; ``dst`` applies ``finish`` to the result, within the
    outcome it sends (an error there raises on every rank); ``call`` and ``handed`` as for
    :func:`all_gather`."""
    g = process_group(group)
    # A dst that names no rank (or a bad dim) travels in the first exchange: every rank raises.
    root, bad_root = root_rank(g, dst, "dst")
    if bad_root is None:
        dst = g.ranks[root]
    dim, bad_dim = _checked_dim(dim)
    local = _described(g, tree.pop() if handed else tree, layout, dim, sizes, False)
    del tree
    arrived = exchange.gather(g, call, root, dst, local, _either(bad_root, bad_dim))
    local = local._replace(leaves=())  # (nothing reads the leaves now: their memory can go)

    def result() -> Any:
        assert arrived is not None
        devices = target(local.devices, arrived.buf.device)
        out = combine(
            g,
            place(g.ranks, arrived, local, devices, layout, dim),
            local,
            layout,
            dim,
            False,
            False,
        )
        return out if finish is None else finish(out)

    return exchange.finish_gather(
        g, dst, root, result, lambda: _name_differences(g, local, layout, dim)
    )


@_paused
def broadcast(tree: Any, src: int, group: Any) -> Any:
    """:func:`treegather.distributed.broadcast`."""
    g = process_group(group)
    root, problem = root_rank(g, src, "src")  # (travels in the first exchange, as dst does)
    if problem is None:
        src = g.ranks[root]
    local = describe(tree, None, 0, None, with_spec=True) if g.rank == root else Local(None, b"")
    arrived = exchange.broadcast(g, root, src, local, problem)
    if g.rank == root and arrived.headers and "error" not in arrived.headers[0]:
        return tree
    return sent(arrived, src)


def _described(g: Group, tree: Any, layout: Any, dim: int, sizes: Any, sync: bool) -> Local:
    """Stage 1 for a call on ``g``: a small payload packed into its first collective's buffer,
    unless its tensors live on the accelerator whose own backend carries the bytes."""
    avoid = None
    if g.accelerator is not None and g.device != g.accelerator:
        avoid = g.accelerator.type
    capacity = g.state.capacity
    return describe(
        tree,
        layout,
        dim,
        sizes,
        sync,
        room=ROW_BYTES,
        capacity=capacity,
        avoid=avoid,
        order=g.rank == 0,
    )


def _name_differences(g: Group, local: Local, layout: Any, dim: int) -> NoReturn:
    """The structures differ: every rank exchanges its node paths (this error path only) and
    raises the same error naming every difference."""
    from .._layout import resolve

    assert local.spec is not None
    up_spec = resolve(local.spec, layout, "gather", dim, "outputs").up_spec
    table = pickle.dumps(node_rows(up_spec), protocol=pickle.HIGHEST_PROTOCOL)
    raise_structure_mismatch(g.ranks, exchange.objects(g, table))


def _checked_dim(dim: Any) -> tuple[int, Problem | None]:
    """``dim`` as an int (``numpy.int64`` too), or what is wrong with it. Never raises: the
    problem travels in the first exchange, so that every rank raises it, none waits."""
    if type(dim) is int:
        return dim, None
    try:
        return check_dim(dim, "dim"), None
    except ArgumentTypeError as exc:
        return 0, (ArgumentTypeError, str(exc).partition(": ")[2])


def _either(*problems: Problem | None) -> Problem | None:
    """This rank's problems as one (``None``: none)."""
    found = [p for p in problems if p is not None]
    if not found:
        return None
    typed = any(cls is ArgumentTypeError for cls, _ in found)
    return (ArgumentTypeError if typed else found[0][0]), "; ".join(text for _, text in found)
