"""tensordict's classes as batch nodes, registered once tensordict is in use.

Never imported by ``import treegather`` unless tensordict is loaded already: :mod:`treegather._tree`
calls :func:`_sync` at import and whenever torch's pytree registry has grown (importing
tensordict, or declaring a ``@tensorclass``, registers classes there).

tensordict registers ``TensorDict``, its subclasses and every ``@tensorclass`` (``NonTensorData``
and ``MetaData`` included) with torch's pytree, with a context holding the ``batch_size``; its
unflatten guesses the batch size again from the leaves' shapes when they differ from it (a
feature dim equal to the rows is taken for a batch dim; a tensorclass with a string field,
``[]``). Here the same functions are registered with treegather's public batch-node option
(:func:`treegather.register_node`'s ``batch_size=``), reading and replacing that context's
``batch_size``: a shard holds its rows, a gather the rows joined, and the names, keys, device
and non-tensor entries are the metadata replicas agree on. Where tensordict would guess another
batch size than the one given (a leaf taken whole in a tensordict split by rows), the rebuild
is refused, naming the path, instead.

A ``_SubTensorDict`` (a view) comes back as a view of a new ``TensorDict`` and tensordict's
``LinkedList`` as a ``LinkedList``, not as the base class tensordict's own functions give.

A ``LazyStackedTensorDict`` stacked along dim 0 holds one tensordict per row: its rows are not
laid out along its leaves, so it is a :class:`~treegather._tree.Rows` value, split by slicing and
joined by stacking the rows' tensordicts again; stacked along another dim, it is a node of its
tensordicts (each a batch node). A ``NonTensorStack`` (per-row non-tensor values: a list of
names as long as a tensordict's batch, a tensorclass's ``str`` field given one; a leaf of
torch's pytree) holds no tensor, so it is a ``Rows`` value stacked along any dim: its rows are
split and joined with the batch as tensordict indexes and concatenates them (``stack[a:b]``,
``torch.cat``). A tensordict's non-tensor entries are its children, not its metadata. A
``NonTensorData`` holds one value for every row, as in tensordict: each shard holds it whole,
and replicas must agree on it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.utils._pytree as _torch_pytree

from ._tree.batch import BatchRule, Rows, RowsKind, rows_kind, unwrapped
from ._tree.registry import register_default, watch

__all__ = ["register_tensordicts"]


class _Context:
    """tensordict's pytree context (a dict): compared as tensordict compares it (its
    ``batch_size`` by its number of dims), hashed by what equal ones share."""

    __slots__ = ("value",)

    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Context) and bool(self.value == other.value)

    def __hash__(self) -> int:
        value = self.value
        keys = tuple(k if isinstance(k, str) else repr(k) for k in value.get("keys") or ())
        return hash((value.get("cls"), keys, len(_batch_size(self))))

    def __repr__(self) -> str:
        value = self.value
        shown = {k: value.get(k) for k in ("keys", "names", "device", "non_tensor_data")}
        return f"{getattr(value.get('cls'), '__qualname__', '?')}({shown}, batch_size={list(_batch_size(self))})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Context, (self.value,))


def _batch_size(ctx: _Context) -> tuple[int, ...]:
    found = ctx.value.get("batch_size")
    held = getattr(found, "batch_size", found)  # (tensordict's _PytreeBatchSize, or a Size)
    if held is None:
        raise ValueError("the tensordict's pytree context holds no static batch size")
    return tuple(held)


def _with_batch_size(ctx: _Context, size: tuple[int, ...]) -> _Context:
    value = dict(ctx.value)
    names = value.get("names")
    if names is not None and len(names) != len(size):  # (where a new dim goes is not known)
        raise ValueError(
            f"its names {list(names)} name {len(names)} batch dim(s), not {len(size)}; gather "
            f"it with as_list(), or without names (td.rename(None))"
        )
    found = value["batch_size"]
    shape = torch.Size(size)
    value["batch_size"] = shape if isinstance(found, torch.Size) else type(found)(shape)
    return _Context(value)


def _flatten(t_flatten: Any) -> Any:
    def flatten(td: Any) -> tuple[list[Any], _Context, tuple[Any, ...] | None]:
        children, context = t_flatten(td)
        if type(context.get("non_tensor_data")) is tuple:
            # a tensordict's non-tensor entries are children too (a NonTensorData, rebuilt with
            # the batch size it is given; a NonTensorStack, whose rows are split and joined with
            # the batch), not metadata of the tensordict: a value that differs between replicas
            # is named at its own path
            context["non_tensor_data"] = ()
        keys = context.get("keys")
        names = tuple(keys) if keys is not None and len(keys) == len(children) else None
        return list(children), _Context(context), names

    return flatten


def _unflatten(t_unflatten: Any, cls: type) -> Any:
    view = getattr(cls, "__name__", "") == "_SubTensorDict"

    def unflatten(ctx: _Context, children: Iterable[Any]) -> Any:
        values = list(children)
        out = t_unflatten(values, dict(ctx.value))  # (it may write into the context)
        if not all(map(_data, values)):  # (a template's placeholders)
            return out
        wanted = torch.Size(_batch_size(ctx))
        if out.batch_size != wanted:  # tensordict guessed another from the leaves' shapes
            raise ValueError(
                f"its leaves do not all start with the batch size {list(wanted)} "
                f"(tensordict would make it {list(out.batch_size)})"
            )
        if view and type(out) is not cls:
            out = out._get_sub_tensordict(slice(None))  # (tensordict rebuilds a TensorDict)
        return out

    return unflatten


def _data(value: Any) -> bool:
    """A tensor or a tensordict (a tree's value, not a template's placeholder)."""
    return isinstance(value, torch.Tensor) or hasattr(value, "batch_size")


def _list_flatten(values: list[Any]) -> tuple[list[Any], None]:
    return list(values), None


def _list_unflatten(cls: type) -> Any:
    def unflatten(_: None, children: Iterable[Any]) -> Any:
        # (torch's list functions, which tensordict registers it with, give a plain list)
        return cls(list(children))

    return unflatten


# --------------------------------------------------------------- a lazy stack along dim 0


def _lazy_kind(cls: Any) -> RowsKind:
    def rows(stack: Any) -> int:
        return int(stack.batch_size[0])

    def split(stack: Any, sizes: Sequence[int]) -> list[Any]:
        out, start = [], 0
        for n in sizes:
            if n:
                out.append(cls.lazy_stack(list(stack.tensordicts[start : start + n]), 0))
            else:  # (no tensordict to stack: tensordict's own empty slice)
                out.append(stack[start:start])
            start += n
        return out

    def join(stacks: Sequence[Any]) -> Any:
        parts = [td for s in stacks if rows(s) for td in s.tensordicts]
        return cls.lazy_stack(parts, 0) if parts else stacks[0]

    return rows_kind(RowsKind(cls.__qualname__, rows, split, join, _moved))


def _moved(stack: Any, device: torch.device) -> Any:
    """A lazy stack on ``device``; one without a device of its own, moved only if a tensor of
    it must be (a ``NonTensorStack`` holds none)."""
    if stack.device == device:
        return stack
    if stack.device is None:
        tensors = [t for t in _torch_pytree.tree_leaves(stack) if isinstance(t, torch.Tensor)]
        if all(t.device == device for t in tensors):
            return stack
    return stack.to(device)


def _non_tensor_kind(cls: Any) -> RowsKind:
    """A ``NonTensorStack``, stacked along any dim (it holds no tensor: nothing of it is a
    leaf): its rows are tensordict's own, indexed (``stack[a:b]``, empty slices too) and joined
    with ``torch.cat`` along dim 0, as tensordict concatenates tensordicts holding one."""

    def rows(stack: Any) -> int:
        return int(stack.batch_size[0])

    def split(stack: Any, sizes: Sequence[int]) -> list[Any]:
        out, start = [], 0
        for n in sizes:
            out.append(stack[start : start + n])
            start += n
        return out

    def join(stacks: Sequence[Any]) -> Any:
        return torch.cat(list(stacks), 0)

    return rows_kind(RowsKind(cls.__qualname__, rows, split, join, _moved))


def _rows_flatten(kind: RowsKind) -> Any:
    def flatten(stack: Any) -> tuple[list[Any], Any, tuple[Any, ...]]:
        return [Rows(stack, kind)], _ROWS, ("rows",)

    return flatten


def _rows_unflatten(meta: Any, children: Iterable[Any]) -> Any:
    (child,) = children
    return unwrapped(child)


_ROWS = "rows"  # (the metadata of a lazy stack held as rows)


def _lazy_flatten(t_flatten: Any, kind: RowsKind) -> Any:
    def flatten(stack: Any) -> tuple[list[Any], Any, tuple[Any, ...] | None]:
        if stack.stack_dim == 0:
            return [Rows(stack, kind)], _ROWS, ("tensordicts",)
        children, context = t_flatten(stack)
        return list(children), _Context(context), None

    return flatten


def _lazy_unflatten(t_unflatten: Any) -> Any:
    def unflatten(meta: Any, children: Iterable[Any]) -> Any:
        if meta == _ROWS:
            (child,) = children
            return unwrapped(child)
        return t_unflatten(list(children), dict(meta.value))

    return unflatten


# ------------------------------------------------------------------------- registration

_done: set[type] = set()

_ONE_VALUE = (
    "a {} holds one value for all its rows, which replicas must share; per-row values are a "
    "NonTensorStack (NonTensorStack.from_list(values), or a list as long as the batch in a "
    "TensorDict), split and joined by rows"
)


def register_tensordicts(pytree: Any) -> None:
    """Register every class tensordict's module ``pytree`` (``tensordict._pytree``) registered
    with torch's pytree and treegather does not know yet (the user's own registration wins)."""
    td_flatten = getattr(pytree, "_tensordict_flatten", None)
    lazy_flatten = getattr(pytree, "_lazy_tensordict_flatten", None)
    nodes: list[tuple[Any, Any, Any]] = [
        (c, n.flatten_fn, n.unflatten_fn) for c, n in _torch_pytree.SUPPORTED_NODES.items()
    ]
    stack = _non_tensor_stack()
    if stack is not None:  # (a leaf of torch's pytree, or a lazy stack there)
        nodes.insert(0, (stack, None, None))
    for cls, flatten_fn, unflatten_fn in nodes:
        if cls in _done or not isinstance(cls, type):
            continue
        if cls is stack:  # per-row non-tensor values: held whole, by rows, whatever its dim
            kind = _non_tensor_kind(cls)
            register_default(cls, _rows_flatten(kind), _rows_unflatten)
            _done.add(cls)
            continue
        if flatten_fn is td_flatten and td_flatten is not None:
            one = _ONE_VALUE.format(cls.__qualname__) if getattr(cls, "_is_non_tensor", 0) else ""
            rule = BatchRule(cls, _batch_size, _with_batch_size, one)
            flatten = _flatten(td_flatten)
            register_default(cls, flatten, _unflatten(unflatten_fn, cls), rule)
        elif cls is _linked_list():
            register_default(cls, _list_flatten, _list_unflatten(cls))
        elif flatten_fn is lazy_flatten and lazy_flatten is not None:
            kind = _lazy_kind(cls)
            flatten = _lazy_flatten(lazy_flatten, kind)
            register_default(cls, flatten, _lazy_unflatten(unflatten_fn))
        else:
            continue
        _done.add(cls)


def _non_tensor_stack() -> Any:
    """tensordict's ``NonTensorStack`` (per-row non-tensor values: a list of strings as long
    as the batch, in a tensordict), once its module is loaded."""
    return getattr(sys.modules.get("tensordict.tensorclass"), "NonTensorStack", None)


def _linked_list() -> Any:
    """tensordict's ``LinkedList`` (its ``names``), a list that comes back a ``LinkedList``."""
    return getattr(sys.modules.get("tensordict.utils"), "LinkedList", None)


def _sync() -> None:
    """Register tensordict's classes once ``tensordict._pytree`` is loaded: at import, and
    whenever torch's pytree registry has grown (a new ``@tensorclass``), so there is no cost on
    the hot path, and ``import treegather`` never imports tensordict."""
    module = sys.modules.get("tensordict._pytree")
    if module is not None:
        register_tensordicts(module)


watch(_sync)
