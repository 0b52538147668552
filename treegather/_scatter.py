"""scatter: one input tree -> one tree per device, split or broadcast leaf by leaf."""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import Any

import torch

from ._builders import replica_builder
from ._devices import DeviceLike, accelerator_tensors_possible, as_devices
from ._errors import BatchSizeError, LeafTypeError, bullet_list
from ._gather import _move_tree
from ._layout import display_path, resolve
from ._rules import Broadcast, Split
from ._tree import describe, flatten

__all__ = ["Shards", "scatter", "scatter_kwargs"]

Tensor = torch.Tensor
_SIMPLE_LEAVES = frozenset({str, bytes, int, float, bool, complex, type(None)})
_SHAPE = operator.attrgetter("shape")
_IS_CPU = operator.attrgetter("is_cpu")
# len() of a tensor without the Python-level Tensor.__len__ wrapper (same result, torch function
# modes still honoured; 0 for a 0-dim tensor): about 40% cheaper than reading .shape.
_TENSOR_LEN = getattr(getattr(torch._C, "TensorBase", None), "__len__", None)


class Shards(list[Any]):
    """The per-device trees :func:`scatter` returns: a list, plus what gather needs to know.

    Attributes:
        sizes: rows in each shard (``None`` when nothing was split); pass them to
            :func:`gather` so that :func:`mean` is weighted exactly.
        devices: the device of each shard, in order.
    """

    sizes: tuple[int, ...] | None
    devices: tuple[torch.device, ...]

    def __init__(
        self,
        trees: Sequence[Any] = (),
        sizes: tuple[int, ...] | None = None,
        devices: tuple[torch.device, ...] = (),
    ) -> None:
        super().__init__(trees)
        self.sizes = sizes
        self.devices = devices

    def __repr__(self) -> str:
        return f"Shards({list.__repr__(self)}, sizes={self.sizes}, devices={list(map(str, self.devices))})"


def scatter(
    inputs: Any,
    devices: Sequence[DeviceLike] | DeviceLike,
    layout: Any = None,
    *,
    dim: int = 0,
) -> Shards:
    """Divide one input tree into one tree per device.

    Tensors of one or more dims are split along ``dim`` (balanced as ``torch.tensor_split``:
    10 rows on 4 devices give 3, 3, 2, 2); everything else (0-dim tensors, numbers, strings) is
    broadcast, tensors moved to each replica's device. When the batch has fewer rows than there
    are devices, only that many shards are made: never an empty shard. Every bad input is
    reported before anything is split or moved. Splits and moves are differentiable.

    Args:
        inputs: the tree to divide.
        devices: the target devices (ints are CUDA indices, ``-1`` the CPU; repeats allowed).
        layout: a rule, a prefix tree of rules, or :func:`by_path` patterns.
        dim: the dim tensors are split along by default.

    Returns:
        A :class:`Shards` list with one tree per used device, and the shard ``sizes``.

    Raises:
        BatchSizeError: split leaves disagree on the batch size.
        LeafTypeError: a rule does not apply to a leaf (``split()`` on a string, an unregistered
            dataclass).
        LayoutError: the layout does not fit the inputs.

    >>> import torch, treegather as tg
    >>> shards = tg.scatter({"x": torch.arange(10), "scale": 2.0}, ["cpu"] * 4)
    >>> [s["x"].tolist() for s in shards], shards.sizes, shards[3]["scale"]
    ([[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]], (3, 3, 2, 2), 2.0)
    """
    return _scatter(inputs, as_devices(devices), layout, dim, "inputs")


def scatter_kwargs(
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    devices: Sequence[DeviceLike] | DeviceLike,
    layout: Any = None,
    *,
    dim: int = 0,
) -> tuple[Shards, Shards]:
    """Scatter positional and keyword arguments together, torch-style.

    A prefix-tree ``layout`` mirrors ``(args, kwargs)``; :func:`by_path` paths start at the
    positional index or the keyword name (``"0.ids"``, ``"labels"``).

    Returns:
        ``(args_shards, kwargs_shards)``: per device a tuple of positional arguments and a dict of
        keyword arguments, the same number of each.

    >>> import torch, treegather as tg
    >>> a, kw = tg.scatter_kwargs((torch.zeros(4, 2),), {"labels": torch.arange(4)}, ["cpu"] * 2)
    >>> [x[0].shape[0] for x in a], [k["labels"].tolist() for k in kw]
    ([2, 2], [[0, 1], [2, 3]])
    """
    if not isinstance(args, tuple):
        args = tuple(args)
    kw = {} if kwargs is None else dict(kwargs)
    shards = _scatter((args, kw), as_devices(devices), layout, dim, None)
    return (
        Shards([s[0] for s in shards], shards.sizes, shards.devices),
        Shards([s[1] for s in shards], shards.sizes, shards.devices),
    )


@functools.lru_cache(maxsize=256)
def _balanced(n: int, k: int) -> tuple[int, ...]:
    base, extra = divmod(n, k)
    return tuple(base + (1 if i < extra else 0) for i in range(k))


def _scatter_default(
    leaves: list[Any], spec: Any, devs: tuple[torch.device, ...], dim: int
) -> Shards | None:
    """The default rules (split tensors of >= 1 dim, broadcast the rest): the per-step hot path.

    Returns ``None`` whenever anything is unusual (a batch-size mismatch, a bad dim, a
    dataclass leaf, tensors that must move), leaving it to the general path, which reports
    every problem before any work is done.
    """
    if not all(d.type == "cpu" for d in devs):
        return None
    T = Tensor
    count = len(leaves)
    if (
        count
        and list(map(type, leaves)).count(T) == count
        and (not accelerator_tensors_possible() or all(map(_IS_CPU, leaves)))
    ):
        # Plain CPU tensors only (the usual batch): every leaf's size along ``dim`` read in C,
        # then one tensor_split per leaf, also called from C.
        try:
            if dim == 0 and _TENSOR_LEN is not None:
                sizes = set(map(_TENSOR_LEN, leaves))  # 0 for a 0-dim tensor
            else:
                sizes = set(map(operator.itemgetter(dim), map(_SHAPE, leaves)))
        except IndexError:  # a 0-dim tensor, or a dim out of range
            sizes = None
        if sizes is not None and len(sizes) == 1 and 0 not in sizes:
            n = sizes.pop()
            k = min(n, len(devs))
            split = T.tensor_split  # looked up per call, as x.tensor_split would be
            if dim:
                columns = list(map(split, leaves, repeat(k, count), repeat(dim, count)))
            else:
                columns = list(map(split, leaves, repeat(k, count)))
            return Shards(_per_device(spec, k, columns), _balanced(n, k), devs[:k])
    # One pass: rows per split leaf, -1 for a leaf to broadcast, -2 for anything the general path
    # must look at (a tensor off the CPU, a leaf of another type).
    simple = _SIMPLE_LEAVES
    try:
        # ``type(x) is T`` first: isinstance against torch.Tensor goes through its metaclass.
        if accelerator_tensors_possible():
            rows = [
                (shape[dim] if (shape := x.shape) else -1)
                if (type(x) is T or isinstance(x, T)) and x.is_cpu
                else (-1 if type(x) in simple else -2)
                for x in leaves
            ]
        else:  # no accelerator was ever initialised: every tensor here is on the CPU
            rows = [
                (shape[dim] if (shape := x.shape) else -1)
                if type(x) is T or isinstance(x, T)
                else (-1 if type(x) in simple else -2)
                for x in leaves
            ]
    except IndexError:
        return None
    found = set(rows)
    found.discard(-1)
    if len(found) != 1:
        return None  # nothing to split, a mismatch, or -2: the general path handles them
    n = found.pop()
    k = min(n, len(devs))
    if k <= 0:
        return None
    used = devs[:k]
    if dim:
        columns = [x.tensor_split(k, dim) if r >= 0 else (x,) * k for x, r in zip(leaves, rows)]
    else:
        columns = [x.tensor_split(k) if r >= 0 else (x,) * k for x, r in zip(leaves, rows)]
    return Shards(_per_device(spec, k, columns), _balanced(n, k), used)


def _per_device(spec: Any, k: int, columns: list[Any]) -> list[Any]:
    """The k trees, from one column (k values) per leaf."""
    build = replica_builder(spec, k)
    if build is not None:
        return build(*columns)
    unflatten = spec.unflatten
    return [unflatten(c) for c in zip(*columns)]


def _scatter(
    inputs: Any, devs: tuple[torch.device, ...], layout: Any, dim: int, root: str | None
) -> Shards:
    leaves, spec = flatten(inputs)
    plan = resolve(spec, layout, "scatter", dim, root)
    if plan.default_only:
        fast = _scatter_default(leaves, spec, devs, dim)
        if fast is not None:
            return fast
    up: list[Any] = leaves if plan.up_spec is spec else plan.up_spec.flatten_up_to(inputs)

    # Pass 1: classify every position and validate everything, before any tensor is touched.
    splits: list[tuple[int, int]] = []  # (position, dim)
    items: list[int] = []
    lengths: dict[int, list[int]] = {}  # batch size -> positions
    explicit: dict[tuple[int, ...], list[int]] = {}
    problems: list[str] = []
    type_problem = False
    rules, groups = plan.rules, plan.groups
    for pos, x in enumerate(up):
        if groups[pos] is not None:
            if not isinstance(x, (list, tuple)):
                problems.append(
                    f"{display_path(plan.node_of(pos), root)}: split_items() needs a list or tuple, "
                    f"got {describe(x)}"
                )
                type_problem = True
                continue
            items.append(pos)
            lengths.setdefault(len(x), []).append(pos)
            continue
        rule = rules[pos]
        if rule is None:
            if isinstance(x, Tensor):
                if x.dim() == 0:
                    continue
                d = dim
            else:
                if dataclasses.is_dataclass(x) and not isinstance(x, type):
                    problems.append(
                        f"{display_path(plan.node_of(pos), root)}: {type(x).__qualname__} is a "
                        "dataclass treegather does not know, so it would be sent whole to every "
                        "device; register it with treegather.register_dataclass (or mark it "
                        "broadcast() in the layout)"
                    )
                    type_problem = True
                elif isinstance(x, (dict, list)):
                    # A dict/list subclass optree does not know is a leaf: without this check the
                    # whole batch inside it would silently go to every device.
                    base = "dict" if isinstance(x, dict) else "list"
                    problems.append(
                        f"{display_path(plan.node_of(pos), root)}: {type(x).__qualname__} is a "
                        f"{base} subclass treegather does not know, so it would be sent whole to "
                        "every device; register it with treegather.register_node (or mark it "
                        "broadcast() in the layout)"
                    )
                    type_problem = True
                continue
        elif isinstance(rule, Broadcast):
            continue
        elif isinstance(rule, Split):
            if not isinstance(x, Tensor):
                problems.append(
                    f"{display_path(plan.node_of(pos), root)}: {rule.describe()} needs a tensor, "
                    f"got {describe(x)}"
                    + (
                        " (use split_items() on a list of per-sample items)"
                        if isinstance(x, (str, bytes))
                        else ""
                    )
                )
                type_problem = True
                continue
            d = rule.dim
            if rule.sizes is not None:
                explicit.setdefault(rule.sizes, []).append(pos)
        else:
            raise AssertionError(rule)
        nd = x.dim()
        if not -nd <= d < nd or nd == 0:
            problems.append(
                f"{display_path(plan.node_of(pos), root)}: cannot split along dim {d}: "
                f"{describe(x)}"
            )
            continue
        splits.append((pos, d))
        lengths.setdefault(x.shape[d], []).append(pos)

    def where(positions: list[int]) -> str:
        shown = ", ".join(display_path(plan.node_of(p), root) for p in positions[:3])
        return shown + (f" and {len(positions) - 3} more" if len(positions) > 3 else "")

    if len(lengths) > 1:
        problems.append(
            "split leaves disagree on the batch size: "
            + "; ".join(
                f"{n} at {where(ps)}" for n, ps in sorted(lengths.items(), key=lambda kv: kv[1][0])
            )
        )
    if len(explicit) > 1:
        problems.append(
            "split rules give different sizes: "
            + "; ".join(f"{list(s)} at {where(ps)}" for s, ps in explicit.items())
        )
    if problems:
        hint = "use broadcast() for leaves every device needs whole" if lengths else None
        raise (LeafTypeError if type_problem else BatchSizeError)(bullet_list(problems, hint))

    k = len(devs)
    if not lengths:
        sizes: tuple[int, ...] | None = None
    else:
        n = next(iter(lengths))
        if explicit:
            sizes = next(iter(explicit))
            if sum(sizes) != n or len(sizes) > k:
                raise BatchSizeError(
                    f"split sizes {list(sizes)} must add up to the batch size {n} and name at "
                    f"most {k} shards (one per device)"
                )
        elif n == 0:
            sizes = (0,)  # an empty batch stays one (empty) shard rather than vanishing
        else:
            sizes = _balanced(n, min(n, k))
        k = len(sizes)
    used = devs[:k]

    # Pass 2: split and broadcast.
    columns: list[Any] = [None] * len(up)
    balanced = sizes is not None and not explicit and sizes == _balanced(sum(sizes), k)
    for pos, d in splits:
        x = up[pos]
        columns[pos] = x.tensor_split(k, d) if balanced else x.split(list(sizes or ()), d)
    if items:
        offsets = [0]
        for s in sizes or ():
            offsets.append(offsets[-1] + s)
        for pos in items:
            seq = up[pos]
            columns[pos] = tuple(seq[offsets[r] : offsets[r + 1]] for r in range(k))
    for pos, col in enumerate(columns):
        if col is None:
            columns[pos] = (up[pos],) * k
    per_replica = list(zip(*columns)) if columns else [()] * k

    # Pass 3: move to devices where needed.
    src = {x.device for x in up if isinstance(x, Tensor)}
    item_tensors = bool(items) and any(isinstance(v, Tensor) for pos in items for v in up[pos])
    trees = []
    up_spec = plan.up_spec
    for r in range(k):
        dev = used[r]
        leaves_r: list[Any] = list(per_replica[r])
        if src and src != {dev}:
            nb = dev.type == "cuda"
            leaves_r = [
                v.to(dev, non_blocking=nb) if isinstance(v, Tensor) and v.device != dev else v
                for v in leaves_r
            ]
        if item_tensors:
            for pos in items:
                leaves_r[pos] = _move_tree(leaves_r[pos], dev)
        trees.append(up_spec.unflatten(leaves_r))
    return Shards(trees, sizes, used)
