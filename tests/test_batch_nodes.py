"""Containers that carry the batch, enumerated: every node type torch's pytree registry holds at
test time, tensordict's classes and torch's structseqs, as outputs and as inputs, on 2 and 3
devices (fast paths and the definition), through ``tgd.all_gather`` and the ``Collector`` (one
process, and spawned groups of 2 and 3 ranks). Each case equals one device (the container
built from the whole batch, or from each shard's rows) or is refused with a typed error naming
the path. A class in the registry that no case covers fails :func:`test_every_registered_node_type_is_covered`,
a kind of value laid out by rows that no case holds :func:`test_every_rows_kind_is_covered`.

Every batch node of every case is also made to claim one more row than its leaves hold (where
its class lets it): scatter, gather, ``tgd.all_gather`` and the ``Collector`` refuse it, naming
its path and the replica, rank or add.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib.util
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import optree
import pytest
import spawned_groups
import tensordict
import torch
import torch.utils._pytree as torch_pytree
from spawned_groups import WORLD_SIZES
from tensordict import LazyStackedTensorDict, TensorDict, tensorclass
from tensordict.tensorclass import (
    MetaData,
    NonTensorData,
    NonTensorDataBase,
    NonTensorStack,
    TensorAttrs,
)
from tensordict.utils import LinkedList
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.nn.utils.rnn import PackedSequence, pack_sequence

import treegather as tg
import treegather.distributed as tgd
from treegather._caches import reference_only
from treegather._compiled import COMPILE_AFTER
from treegather._shards import balanced

Tensor = torch.Tensor
N, F = 10, 5  # rows, features: on 2 devices replica 0 holds 5 rows, F of them


def batch(n: int = N) -> Tensor:
    return torch.arange(n * F, dtype=torch.float32).reshape(n, F)


# ------------------------------------------------------------------------------- the cases


class Case(NamedTuple):
    name: str
    make: Callable[[Tensor], Any]
    """The container of a batch's rows ``x`` (rows, F)."""


Pair = collections.namedtuple("Pair", ["a", "b"])


@tensorclass
class Tagged:
    """A user's tensorclass with a string field (its batch size was [] after a gather)."""

    x: Tensor
    tag: str


@tg.register_dataclass(static=["tag"], batch_size="rows")
@dataclasses.dataclass
class Counted:
    """A user's class with a batch-sized field (and a string beside it)."""

    x: Tensor
    tag: str
    rows: int


@dataclasses.dataclass
class Windowed:
    """A user's node registered with ``register_node(batch_size=)``: two batch dims (rows, and
    a window of 2)."""

    x: Tensor
    size: tuple[int, int]


tg.register_node(
    Windowed,
    lambda w: ((w.x,), w.size, ("x",)),
    lambda size, children: Windowed(*children, size),
    batch_size=lambda size: size,
    with_batch_size=lambda size, new: tuple(new),
)


def _td(x: Tensor) -> TensorDict:
    # feature dims equal to replica 0's rows (5 of 10 on 2 devices, 4 on 3), and to the batch
    td = TensorDict(
        {"a": x, "b": torch.cat([x, x], 1), "c": x[:, :4]},
        batch_size=[len(x)],
        names=["batch"],
    )
    td.set_non_tensor("tag", "train")
    return td


def _sequences(x: Tensor) -> list[Tensor]:
    # row i: a sequence of 1 + i % 3 steps of its features
    return [x[i : i + 1].expand(1 + int(x[i, 0]) // F % 3, F) for i in range(len(x))]


def _row_names(x: Tensor, prefix: str = "row") -> list[str]:
    """A name per row of ``x`` (from its values: a shard's rows have the whole batch's names)."""
    return [f"{prefix}{int(v) // F}" for v in x[:, 0]]


def _lazy(x: Tensor, dim: int) -> LazyStackedTensorDict:
    if dim == 0:
        return LazyStackedTensorDict.lazy_stack([TensorDict({"a": r}, []) for r in x], 0)
    parts = [TensorDict({"a": x}, [len(x)]), TensorDict({"a": x * 2}, [len(x)])]
    return LazyStackedTensorDict.lazy_stack(parts, 1)


def _tensorclass_case(cls: type) -> Case | None:
    """A tensorclass not named below (a user's): its tensor fields hold the rows, its string
    fields a word."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        hint = str(field.type)
        if "Tensor" in hint:
            values[field.name] = None
        elif "str" in hint:
            values[field.name] = "word"
        else:
            return None
    tensors = [k for k, v in values.items() if v is None]

    def make(x: Tensor) -> Any:
        return cls(**{**values, **dict.fromkeys(tensors, x)}, batch_size=[len(x)])

    return Case(cls.__qualname__, make)


KNOWN: dict[Any, Callable[[Tensor], Any]] = {
    tuple: lambda x: (x, x[:, 0]),
    list: lambda x: [x, x[:, :2]],
    dict: lambda x: {"a": x, "n": x.sum(1)},
    collections.namedtuple: lambda x: Pair(x, x * 2),
    collections.OrderedDict: lambda x: collections.OrderedDict(b=x, a=x * 2),
    collections.defaultdict: lambda x: collections.defaultdict(list, {"a": x}),
    collections.deque: lambda x: collections.deque([x, x * 3]),
    immutable_list: lambda x: immutable_list([x, x * 2]),
    immutable_dict: lambda x: immutable_dict({"a": x}),
    TensorDict: _td,
    tensordict._td._SubTensorDict: lambda x: _td(x)._get_sub_tensordict(slice(None)),
    LazyStackedTensorDict: lambda x: _lazy(x, 0),
    NonTensorData: lambda x: {"x": x, "tag": NonTensorData("t", batch_size=[len(x)])},
    NonTensorDataBase: lambda x: {"x": x, "tag": NonTensorDataBase("t", batch_size=[len(x)])},
    MetaData: lambda x: {"x": x, "meta": MetaData({"lr": 0.1}, batch_size=[len(x)])},
    TensorAttrs: lambda x: {"x": x, "at": TensorAttrs("cpu", torch.float32, batch_size=[len(x)])},
    LinkedList: lambda x: LinkedList([x, x * 2]),
    Tagged: lambda x: Tagged(x=x, tag="word", batch_size=[len(x)]),
}
GRAPHS = "PyG graph batch"  # (in one process only: see _distributed)


def _graphs(x: Tensor) -> Any:
    """A PyG graph batch of one graph per row (``1 + i % 3`` nodes of its features, by value)."""
    with warnings.catch_warnings():  # (PyG 2.8 scripts helpers at import: torch deprecates it)
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch_geometric.data import Batch, Data

    none = torch.zeros(2, 0, dtype=torch.long)
    graphs = [Data(x=r.expand(1 + int(r[0]) // F % 3, F), edge_index=none) for r in x]
    return {"x": x, "g": Batch.from_data_list(graphs)}


# Cases of classes that are not (or not only) in torch's registry.
EXTRA: dict[str, Callable[[Tensor], Any]] = {
    "LazyStackedTensorDict(stack_dim=1)": lambda x: _lazy(x, 1),
    "PackedSequence": lambda x: pack_sequence(_sequences(x), enforce_sorted=False),
    "PackedSequence(sorted)": lambda x: {"p": pack_sequence(x.unsqueeze(1).unbind(0)), "x": x},
    "Counted (register_dataclass batch_size=)": lambda x: Counted(x, "w", len(x)),
    "Counted, no tensor": lambda x: {"x": x, "c": Counted(None, "w", len(x))},  # type: ignore[arg-type]
    "Counted, around a PackedSequence": lambda x: Counted(  # type: ignore[arg-type]
        pack_sequence(_sequences(x), enforce_sorted=False), "w", len(x)
    ),
    "Windowed (register_node batch_size=, 2 batch dims)": lambda x: Windowed(
        torch.stack([x, -x], 1), (len(x), 2)
    ),
    "TensorDict(batch_size=[])": lambda x: TensorDict({"x": x}, []),
    "TensorDict(nested)": lambda x: TensorDict({"in": _td(x), "y": x}, [len(x)]),
    # per-row strings: a NonTensorStack (a leaf of torch's pytree), alone, in a TensorDict (a
    # list as long as the batch), in a tensorclass's str field, stacked along dim 1
    "NonTensorStack": lambda x: {"x": x, "names": NonTensorStack.from_list(_row_names(x))},
    "TensorDict(per-row strings)": lambda x: TensorDict({"x": x, "name": _row_names(x)}, [len(x)]),
    "Tagged(per-row strings)": lambda x: Tagged(x=x, tag=_row_names(x), batch_size=[len(x)]),
    "NonTensorStack(stack_dim=1)": lambda x: {
        "x": x,
        "pairs": torch.stack(
            [NonTensorStack.from_list(_row_names(x)), NonTensorStack.from_list(_row_names(x, "b"))],
            1,
        ),
    },
    # one value for every row (tensordict's NonTensorData), a list
    "NonTensorData(list)": lambda x: TensorDict(
        {"x": x, "words": NonTensorData(["a", "b"], batch_size=[len(x)])}, [len(x)]
    ),
}
# torch's own classes registered as nodes that hold no user data: leaves for treegather.
VALUES = {
    ("torch", "Size"): "a shape (a value)",
    ("torch._higher_order_ops.auto_functionalize", "SchemaHolder"): "an operator schema",
    ("torch._higher_order_ops.flat_apply", "_ConstantFunction"): "a constant function (fx)",
    ("torch.distributed.tensor._op_schema", "TupleStrategy"): "a sharding strategy (DTensor)",
}
NOT_RUN = {
    tensordict.persistent.PersistentTensorDict: "an HDF5 file (h5py is not installed): "
    "registered with TensorDict's batch-node functions",
}


def classify() -> tuple[list[Case], dict[type, str], list[str]]:
    """The cases of every node type torch's registry holds now (and the extra ones), the value
    classes (leaves), and the names of the classes no case covers."""
    cases: list[Case] = []
    values: dict[type, str] = {}
    uncovered: list[str] = []
    for cls in list(torch_pytree.SUPPORTED_NODES):
        module = getattr(cls, "__module__", "")
        name = f"{module}.{getattr(cls, '__qualname__', cls)}"
        if cls in KNOWN:
            cases.append(Case(name, KNOWN[cls]))
        elif isinstance(cls, type) and optree.is_structseq_class(cls):
            n = cls.n_fields  # type: ignore[attr-defined]
            cases.append(Case(name, lambda x, c=cls, n=n: c(tuple(x + i for i in range(n)))))
        elif (module, getattr(cls, "__qualname__", "")) in VALUES:
            values[cls] = VALUES[module, cls.__qualname__]
        elif cls in NOT_RUN:
            values[cls] = NOT_RUN[cls]
        elif isinstance(cls, type) and tensordict.is_tensorclass(cls):
            case = _tensorclass_case(cls)
            if case is None:
                uncovered.append(name)
            else:
                cases.append(case)
        elif _model_output(cls) and not dataclasses.is_dataclass(cls):
            values[cls] = "a ModelOutput base that is no dataclass (transformers refuses instances)"
        elif _model_output(cls):
            first = dataclasses.fields(cls)[0].name
            cases.append(Case(name, lambda x, c=cls, f=first: c(**{f: x})))
        elif module.startswith(("test_", "tests.")) or module in {"conftest", "__main__"}:
            values[cls] = "defined by another test module (tested there)"
        else:
            uncovered.append(name)
    cases.extend(Case(name, make) for name, make in EXTRA.items())
    if importlib.util.find_spec("torch_geometric") is not None:
        cases.append(Case(GRAPHS, _graphs))
    return cases, values, uncovered


def _model_output(cls: Any) -> bool:
    module = sys.modules.get("transformers.utils")
    output = getattr(module, "ModelOutput", None)
    return isinstance(cls, type) and output is not None and issubclass(cls, output)


# ------------------------------------------------------------------------- what "equal" is


def same(a: Any, b: Any, at: str = "") -> str | None:
    """Where ``a`` and ``b`` differ (values, types, batch sizes, names), or ``None``."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        ok = (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return None if ok else f"{at}: {a!r} != {b!r}"
    if not _same_type(a, b):
        return f"{at}: {type(a).__qualname__} != {type(b).__qualname__}"
    if hasattr(a, "to_data_list"):  # (a PyG graph batch)
        return same(dict(a.to_dict()), dict(b.to_dict()), at)
    if isinstance(a, LazyStackedTensorDict):
        if a.stack_dim != b.stack_dim or len(a.tensordicts) != len(b.tensordicts):
            return f"{at}: stacks differ"
        return _first(
            same(x, y, f"{at}[{i}]") for i, (x, y) in enumerate(zip(a.tensordicts, b.tensordicts))
        )
    if tensordict.is_tensor_collection(a):
        if a.batch_size != b.batch_size:
            return f"{at}: batch_size {list(a.batch_size)} != {list(b.batch_size)}"
        if _names(a) != _names(b):
            return f"{at}: names {_names(a)} != {_names(b)}"
        if isinstance(a, NonTensorDataBase):
            return None if a.data == b.data else f"{at}: data {a.data!r} != {b.data!r}"
        if sorted(a.keys()) != sorted(b.keys()):
            return f"{at}: keys {sorted(a.keys())} != {sorted(b.keys())}"
        if tensordict.is_tensorclass(a):
            for field in dataclasses.fields(a):
                found = same(getattr(a, field.name), getattr(b, field.name), f"{at}.{field.name}")
                if found:
                    return found
            return None
        return _first(
            same(a._get_str(k, None), b._get_str(k, None), f"{at}[{k!r}]") for k in a.keys()
        )
    if isinstance(a, dict):
        if list(a) != list(b) or getattr(a, "default_factory", None) != getattr(
            b, "default_factory", None
        ):
            return f"{at}: keys {list(a)} != {list(b)}"
        return _first(same(a[k], b[k], f"{at}[{k!r}]") for k in a)
    if isinstance(a, (tuple, list, collections.deque)):
        if len(a) != len(b):
            return f"{at}: {len(a)} != {len(b)} items"
        return _first(same(x, y, f"{at}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    if dataclasses.is_dataclass(a):
        return _first(
            same(getattr(a, f.name), getattr(b, f.name), f"{at}.{f.name}")
            for f in dataclasses.fields(a)
        )
    return None if a == b else f"{at}: {a!r} != {b!r}"


def _same_type(a: Any, b: Any) -> bool:
    return type(a) is type(b)


def _names(td: Any) -> Any:
    try:
        return td.names
    except Exception:
        return None


def _first(found: Iterator[str | None] | Any) -> str | None:
    return next((f for f in found if f), None)


class Outcome(NamedTuple):
    kind: str  # "equal", "refused" (a typed error naming the path) or "wrong"
    detail: str


def outcome(expected: Any, run: Callable[[], Any], root: str) -> Outcome:
    """How ``run()`` compares with ``expected`` (a case that cannot be built is wrong)."""
    try:
        got = run()
    except tg.TreegatherError as exc:
        text = f"{type(exc).__name__}: {exc}"
        return Outcome("refused" if root in str(exc) else "wrong", text)
    except Exception as exc:  # untyped: a failure of the matrix
        return Outcome("wrong", f"untyped {type(exc).__name__}: {exc}")
    found = same(got, expected, root)
    return Outcome("wrong", found) if found else Outcome("equal", "")


def as_output(case: Case, k: int) -> Outcome:
    """The container of each shard's rows, gathered, against the whole batch's."""
    x = batch()
    shards = tg.scatter(x, ["cpu"] * k)
    return outcome(
        case.make(x), lambda: tg.gather([case.make(s) for s in shards], "cpu"), "outputs"
    )


def as_input(case: Case, k: int) -> Outcome:
    """The whole batch's container, scattered, against each shard's rows' container."""
    x = batch()
    parts = [case.make(s) for s in tg.scatter(x, ["cpu"] * k)]
    return outcome(parts, lambda: list(tg.scatter(case.make(x), ["cpu"] * k)), "inputs")


def both_ways(check: Callable[[Case, int], Outcome], case: Case, k: int) -> Outcome:
    """The outcome with the fast paths (cold, then compiled) and under the definition; they must
    be one outcome."""
    with reference_only():
        plain = check(case, k)
    for _ in range(COMPILE_AFTER + 1):
        fast = check(case, k)
        if fast != plain:
            return Outcome("wrong", f"fast path {fast} != definition {plain}")
    return plain


# ---------------------------------------------------------------------------------- tests

VALUE_CLASSES = classify()[1]
COUNTS: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


def test_every_rows_kind_is_covered() -> None:
    # every kind of value laid out by rows registered so far (late in a session: every
    # integration in use) is held by a case
    held = set()
    for case in classify()[0]:
        leaves, _ = tg._tree.flatten(case.make(batch()))
        held |= {r.kind.name for r in map(tg._tree.rows_of, leaves) if r is not None}
    kinds = set(tg._tree.batch._KINDS)
    assert kinds <= held, f"kinds of values laid out by rows no case holds: {kinds - held}"
    assert {"PackedSequence", "LazyStackedTensorDict", "NonTensorStack"} <= kinds


def test_every_registered_node_type_is_covered() -> None:
    cases, _, uncovered = classify()  # (the registry as it is now, late in a session)
    assert not uncovered, f"node types no case covers: {uncovered}"
    names = {c.name for c in cases}
    assert {"builtins.dict", "tensordict._td.TensorDict", "torch.return_types.max"} <= names
    assert len([n for n in names if n.startswith("torch.return_types.")]) >= 60


def test_value_classes_are_leaves() -> None:
    tg._tree.sync()  # (what a first scatter or gather does)
    for cls in VALUE_CLASSES:
        registered = optree.register_pytree_node.get(cls, namespace=tg.NAMESPACE)
        if cls in NOT_RUN:
            assert registered is not None and tg._tree.batch.rule_of(cls) is not None, cls
        elif (cls.__module__, cls.__qualname__) in VALUES:
            assert registered is None, cls
    assert tg.scatter({"x": batch(), "s": torch.Size([F])}, ["cpu"] * 2)[1]["s"] == torch.Size([F])


@pytest.mark.parametrize("k", [2, 3])
def test_containers_equal_one_device(k: int) -> None:
    wrong = []
    for case in classify()[0]:  # (the registry as it is when this runs)
        for way, check in (("output", as_output), ("input", as_input)):
            found = both_ways(check, case, k)
            COUNTS[f"{way} on {k} devices"][found.kind] += 1
            if found.kind != "equal":
                COUNTS["refusals"][f"{way} {case.name}: {found.detail.splitlines()[0]}"] += 1
            if found.kind == "wrong":
                wrong.append(f"{case.name} as {way} on {k} devices: {found.detail}")
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------- batch sizes their leaves do not hold


class Misclaim(NamedTuple):
    """One batch node of a case, claiming one more row than it holds."""

    case: Case
    path: tuple[Any, ...]
    """The node's path from the root, as optree gives it (for :func:`display_path`)."""
    node: Any
    leaves: bool
    """Whether it holds leaves joined with the rows (tensors, values laid out by rows)."""

    def where(self, root: str) -> str:
        return tg._tree.display_path(self.node, root)

    def make(self, x: Tensor) -> Any:
        """The case's container of rows ``x``, the node claiming one row more at dim 0."""
        leaves, spec = tg._tree.flatten(self.case.make(x))
        found = tg._tree.batch_nodes(spec)
        (i,) = [i for i, bn in enumerate(found) if bn.node.raw == self.node.raw]
        size = found[i].meta.size
        return tg._tree.rebuild(spec, leaves, {i: (size[0] + 1, *size[1:])})


def misclaims(cases: list[Case]) -> tuple[list[Misclaim], collections.Counter[str]]:
    """Every batch node (with a batch dim) of every case that can claim other rows than its
    leaves hold, and how many cannot (their class refuses to be rebuilt so)."""
    found: list[Misclaim] = []
    refused: collections.Counter[str] = collections.Counter()
    for case in cases:
        leaves, spec = tg._tree.flatten(case.make(batch()))
        for bn in tg._tree.batch_nodes(spec):
            if not bn.meta.size:
                continue
            held = leaves[bn.node.start : bn.node.stop]
            joined = any(
                (isinstance(v, Tensor) and v.dim() > 0) or tg._tree.rows_of(v) is not None
                for v in held
            )
            m = Misclaim(case, bn.node.raw, bn.node, joined)
            try:
                m.make(batch())
            except tg.ShapeMismatchError:  # (tensordict: its leaves must start with it)
                refused[bn.meta.rule.cls.__qualname__] += 1
                continue
            found.append(m)
    return found, refused


def _misclaimed(m: Misclaim, k: int, way: str) -> Outcome:
    """A misclaiming node in the last shard's container (gathered), or in the whole batch's
    (scattered): refused naming its path and the replica (or "its")."""
    x = batch()
    shards = list(tg.scatter(x, ["cpu"] * k))
    if way == "output":
        replicas = [m.case.make(s) for s in shards[:-1]] + [m.make(shards[-1])]
        run = functools.partial(tg.gather, replicas, "cpu")
        said, root = f"{m.where('outputs')}: replica {k - 1}'s", "outputs"
    else:
        run = functools.partial(tg.scatter, m.make(x), ["cpu"] * k)
        said, root = f"{m.where('inputs')}: its", "inputs"
    return _refused_saying(run, said, root, m.leaves or way == "input")


def _refused_saying(
    run: Callable[[], Any], said: str, root: str, checked: bool, otherwise: bool = False
) -> Outcome:
    """``run()`` must raise a BatchSizeError saying ``said`` (a node with no leaves to check
    in a gather: anything but an untyped error, "unchecked"; ``otherwise``: another typed error
    naming the path will do, "refused otherwise")."""
    try:
        run()
    except tg.BatchSizeError as exc:
        if said in str(exc):
            return Outcome("refused", f"BatchSizeError: {exc}")
        return Outcome("wrong", f"BatchSizeError without {said!r}: {exc}")
    except tg.TreegatherError as exc:
        if otherwise and root in str(exc):
            return Outcome("refused otherwise", f"{type(exc).__name__}: {exc}")
        kind = "wrong" if checked or root not in str(exc) else "unchecked"
        return Outcome(kind, f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        return Outcome("wrong", f"untyped {type(exc).__name__}: {exc}")
    return Outcome("wrong" if checked else "unchecked", "no error")


@pytest.mark.parametrize("k", [2, 3])
def test_a_batch_size_its_leaves_do_not_hold_is_refused(k: int) -> None:
    # (gather returned n=5 around 4 rows; scatter refused the same node)
    found, cannot = misclaims(classify()[0])
    COUNTS["nodes that cannot claim other rows"].update(cannot)
    wrong = []
    for m in found:
        for way in ("output", "input"):
            with reference_only():
                plain = _misclaimed(m, k, way)
            fast = _misclaimed(m, k, way)
            got = plain if fast == plain else Outcome("wrong", f"fast {fast} != {plain}")
            COUNTS[f"misclaimed {way} on {k} devices"][got.kind] += 1
            if got.kind == "wrong":
                wrong.append(f"{m.case.name} {m.where('outputs')} as {way}: {got.detail}")
    assert found and not wrong, "\n".join(wrong)


def test_a_node_without_leaves_is_checked_against_the_batch_only() -> None:
    # a gather has no batch to hold it to: its rows are added up, as the replicas claim them
    x = batch()
    outs = [{"x": s, "c": Counted(None, "w", len(s) + 1)} for s in x.split(5)]  # type: ignore[arg-type]
    assert tg.gather(outs, "cpu")["c"].rows == N + 2
    with pytest.raises(tg.BatchSizeError, match=r"inputs\['c'\]: its Counted batch size \[11\]"):
        tg.scatter({"x": x, "c": Counted(None, "w", N + 1)}, ["cpu"] * 2)  # type: ignore[arg-type]


def _collected(case: Case, rank: int, world: int) -> Any:
    """A Collector over this rank's rows (every ``world``-th, in batches of 2, in another
    order), exchanged: every sample once, in dataset order."""
    x = batch()
    mine = torch.arange(rank, N, world).flip(0)
    col = tgd.Collector()
    for chunk in mine.split(2):
        col.add(case.make(x[chunk]), indices=chunk)
    return col.all_gather()


def _gathered(case: Case, rank: int, world: int) -> Any:
    """``tgd.all_gather`` of this rank's rows (balanced, uneven) in one container."""
    sizes = balanced(N, world)
    start = sum(sizes[:rank])
    return tgd.all_gather(case.make(batch()[start : start + sizes[rank]]))


def distributed(rank: int, world: int) -> dict[str, tuple[str, str]]:
    """Every case's outcome through ``tgd.all_gather`` and the Collector (both ways).

    The cases travel a few at a time, as one dict (one exchange); a bundle that is not equal to
    one device is taken apart, each case on its own, to say which case is refused and why.
    """
    try:
        return _distributed(rank, world)
    except Exception:  # (a check that raises would end every later check of the group)
        return {"the check itself": ("wrong", traceback.format_exc())}


def _distributed(rank: int, world: int) -> dict[str, tuple[str, str]]:
    # (PyG is slow to import: a spawned rank imports it only in test_graphs' check, which takes
    # graph batches across ranks)
    cases = [c for c in classify()[0] if c.name != GRAPHS]
    out: dict[str, tuple[str, str]] = {}
    for way, run in (("all_gather", _gathered), ("Collector", _collected)):
        for mode in ("fast", "reference"):
            with reference_only() if mode == "reference" else contextlib.nullcontext():
                for at in range(0, len(cases), BUNDLE):
                    bundle = cases[at : at + BUNDLE]
                    whole = Case("bundle", lambda x, b=bundle: {c.name: c.make(x) for c in b})
                    found = outcome(
                        whole.make(batch()), functools.partial(run, whole, rank, world), "outputs"
                    )
                    for case in bundle:
                        if found.kind != "equal":
                            expected = case.make(batch())
                            found_one = outcome(
                                expected, functools.partial(run, case, rank, world), "outputs"
                            )
                        else:
                            found_one = found
                        out[f"{way} {mode} {case.name}"] = (found_one.kind, found_one.detail)
    for m in misclaims(cases)[0]:  # rank 0's node claiming a row more: refused on every rank
        wrong = Case(m.case.name, m.make if rank == 0 else m.case.make)
        for mode in ("fast", "reference"):
            with reference_only() if mode == "reference" else contextlib.nullcontext():
                got = _refused_saying(
                    functools.partial(_gathered, wrong, rank, world),
                    f"{m.where('outputs')}: replica 0's",
                    "outputs",
                    m.leaves,
                )
                key = f"{m.case.name} {m.where('outputs')}"
                out[f"misclaimed_all_gather {mode} {key}"] = tuple(got)  # type: ignore[assignment]
                got = _refused_saying(
                    functools.partial(_collected, wrong, rank, world),
                    f"{m.where('outputs')}: add #0's",
                    "outputs",
                    True,
                    otherwise=True,  # (a case the Collector refuses as it is)
                )
                out[f"misclaimed_Collector {mode} {key}"] = tuple(got)  # type: ignore[assignment]
    return out


BUNDLE = 12  # cases per exchange


spawned_groups.register("batch_nodes", budget_s=35)(distributed)


def _metadata_cases(rank: int) -> dict[str, Any]:
    """Trees whose node metadata differs on rank 0 and the other ranks."""
    other = rank > 0
    x = torch.zeros(2, 3)
    return {
        "TensorDict names": TensorDict({"x": x}, [2], names=["c" if other else "b"]),
        "TensorDict keys": TensorDict({"y" if other else "x": x}, [2]),
        "Counted tag": {"c": Counted(x, "w1" if other else "w0", 2)},
        "NonTensorData value": TensorDict(
            {"x": x, "words": NonTensorData(["d" if other else "a"], batch_size=[2])}, [2]
        ),
    }


# What every rank's error says, by case: the path, and each side of the difference.
METADATA_SAID = {
    "TensorDict names": ("outputs: the TensorDict's metadata differs", "'names': ['b']", "['c']"),
    "TensorDict keys": ("outputs.x: a leaf on rank 0; missing on rank", "outputs.y: missing"),
    "Counted tag": (
        "outputs['c']: the Counted's metadata differs: ('w0', 2) on rank 0; ('w1', 2)",
    ),
    "NonTensorData value": (
        "outputs.words: the NonTensorData's metadata differs",
        "'data': ['a']",
        "'data': ['d']",
        "NonTensorStack.from_list(values)",
    ),
}


@spawned_groups.register("batch_nodes.metadata", budget_s=10)
def other_metadata(rank: int, world: int) -> dict[str, Any]:
    """Each case's error on this rank, through ``all_gather`` (both ways) and a Collector."""
    out: dict[str, Any] = {}
    for name, tree in _metadata_cases(rank).items():
        for mode in ("fast", "reference"):
            with reference_only() if mode == "reference" else contextlib.nullcontext():
                try:
                    tgd.all_gather(tree)
                    out[f"{name} {mode}"] = "no error"
                except Exception as exc:
                    out[f"{name} {mode}"] = f"{type(exc).__name__}: {exc}"
    col = tgd.Collector()
    col.add(_metadata_cases(rank)["Counted tag"], indices=[2 * rank, 2 * rank + 1])
    try:
        col.all_gather()
        out["Counted tag Collector"] = "no error"
    except Exception as exc:
        out["Counted tag Collector"] = f"{type(exc).__name__}: {exc}"
    return out


def test_through_all_gather_and_collector_one_rank(world_of_one: None) -> None:
    _check_distributed({0: distributed(0, 1)}, "one rank")


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    found = spawned_groups.results(world, tmp_path_factory)
    seconds = max(res.get("seconds", {}).get("batch_nodes", 0.0) for res in found)
    COUNTS[f"seconds of the check on {world} ranks"][f"{seconds:.1f}"] += 1
    return world, [res["batch_nodes"] for res in found]


@pytest.mark.distributed
def test_through_all_gather_and_collector_on_ranks(ranks: Any) -> None:
    world, results = ranks
    _check_distributed(dict(enumerate(results)), f"{world} ranks")


@pytest.mark.distributed
def test_ranks_with_other_node_metadata_are_refused_naming_the_path(
    ranks: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # (every rank said "same paths and node types, but different node metadata", naming none)
    world = ranks[0]
    for rank, res in enumerate(spawned_groups.results(world, tmp_path_factory)):
        for key, said in res["batch_nodes.metadata"].items():
            name = key.rsplit(" ", 1)[0].removesuffix(" Collector")
            assert said.startswith("StructureMismatchError: "), (world, rank, key, said)
            for part in METADATA_SAID[name]:
                assert part in said, (world, rank, key, said)


def _check_distributed(results: dict[int, dict[str, tuple[str, str]]], where: str) -> None:
    wrong = []
    for rank, found in results.items():
        assert found, f"rank {rank} ran no case"
        for name, (kind, detail) in found.items():
            if rank == 0:
                COUNTS[f"{name.split()[0]} on {where}"][kind] += 1
                if kind != "equal":
                    COUNTS["refusals"][
                        f"{name.split()[0]} {' '.join(name.split()[2:])}: {detail.splitlines()[0]}"
                    ] += 1
            if kind == "wrong":
                wrong.append(f"rank {rank}, {name}: {detail}")
    assert not wrong, "\n".join(wrong[:20])


# ----------------------------------------------------------------- the symptoms, by name


def test_tensordict_output_keeps_its_batch_size() -> None:
    x = batch()
    shards = tg.scatter(x, ["cpu"] * 2)
    out = tg.gather([TensorDict({"x": s}, [len(s)], names=["batch"]) for s in shards], "cpu")
    assert out.batch_size == torch.Size([N]) and out.names == ["batch"]


def test_tensordict_input_shards_hold_their_rows() -> None:
    td = TensorDict({"x": torch.zeros(N, N)}, [N])
    td.set_non_tensor("s", "hello")
    shards = tg.scatter(td, ["cpu"] * 2)
    assert [s.batch_size for s in shards] == [torch.Size([5])] * 2
    assert [s["s"] for s in shards] == ["hello"] * 2


def test_a_batch_size_that_is_not_the_batch_is_refused() -> None:
    with pytest.raises(tg.BatchSizeError, match=r"inputs\['c'\]: its Counted batch size \[9\]"):
        tg.scatter({"c": Counted(batch(), "w", 9)}, ["cpu"] * 2)


def test_a_numpy_integer_batch_size_follows_the_rows() -> None:
    np = pytest.importorskip("numpy")
    x = batch(7)
    shards = tg.scatter(Counted(x, "w", np.int64(7)), ["cpu"] * 3)
    assert [(type(s.rows), s.rows) for s in shards] == [(np.int64, 3), (np.int64, 2), (np.int64, 2)]
    out = tg.gather(list(shards), "cpu")
    assert type(out.rows) is np.int64 and out.rows == 7 and torch.equal(out.x, x)


@pytest.mark.parametrize("rows", [None, 7.0, True, torch.tensor(7), "7", [7.0]], ids=repr)
def test_a_batch_size_that_is_no_int_is_refused_naming_the_path(rows: Any) -> None:
    # (a raw TypeError from wherever the size was first read: 'NoneType' object is not iterable)
    with pytest.raises(tg.ArgumentTypeError, match=r"inputs\['c'\]: the Counted's batch size"):
        tg.scatter({"c": Counted(batch(), "w", rows)}, ["cpu"] * 2)
    with pytest.raises(tg.ArgumentTypeError, match=r"outputs\['c'\]: the Counted's batch"):
        tg.gather([{"c": Counted(batch(), "w", rows)}] * 2, "cpu")


@pytest.mark.parametrize("d", [0, 1, -1])
def test_stacked_tensordicts_hold_the_stacked_batch_size(d: int) -> None:
    # as torch.stack(tds, d) (stack(1) came back [2] around leaves [2, 3, 4]); stack(-1) stacks
    # each leaf along its last dim, past the batch dims: the batch size is kept
    outs = [TensorDict({"x": torch.randn(2, 4), "n": TensorDict({}, [2])}, [2]) for _ in range(3)]
    x = torch.stack([o["x"] for o in outs], d)
    size = torch.stack(outs, d).batch_size if d >= 0 else torch.Size([2])
    for fast in (True, False):
        with contextlib.nullcontext() if fast else reference_only():
            got = tg.gather(outs, "cpu", tg.stack(d))
        assert got.batch_size == size and got["n"].batch_size == size
        assert torch.equal(got["x"], x)
    scalars = [TensorDict({"loss": torch.tensor(float(i))}, []) for i in range(3)]
    assert tg.gather(scalars, "cpu", tg.stack()).batch_size == torch.Size([3])


def test_stacked_tensordicts_with_names_are_refused_naming_the_path() -> None:
    # (they came back with batch size [3, 2] and names ['b']: one name for two dims)
    outs = [{"td": TensorDict({"x": torch.randn(2, 4)}, [2], names=["b"])} for _ in range(3)]
    with pytest.raises(tg.ShapeMismatchError, match=r"outputs\['td'\]: .* its names \['b'\]"):
        tg.gather(outs, "cpu", tg.stack())
    got = tg.gather([{"td": o["td"].rename(None)} for o in outs], "cpu", tg.stack())
    assert got["td"].batch_size == torch.Size([3, 2])


def test_a_tensordict_whose_leaves_cannot_hold_its_rows_is_refused() -> None:
    # x taken whole inside a TensorDict split by rows: tensordict guessed batch size [] instead
    td = TensorDict({"x": torch.randn(7, 4), "n": TensorDict({"y": torch.randn(7, 2)}, [7])}, [7])
    with pytest.raises(tg.ShapeMismatchError, match=r"inputs: the TensorDict cannot be rebuilt"):
        tg.scatter(td, ["cpu"] * 3, tg.by_path({"x": tg.broadcast()}))


def test_replicas_whose_other_batch_dims_differ_are_refused() -> None:
    outs = [TensorDict({}, [2, 3]), TensorDict({}, [2, 4])]  # (no leaf to be concatenated)
    with pytest.raises(
        tg.ShapeMismatchError, match=r"outputs: the replicas' TensorDict batch sizes"
    ):
        tg.gather(outs, "cpu")


def test_replicas_with_other_strings_are_refused() -> None:
    outs = [{"x": torch.zeros(2), "t": NonTensorData(s, batch_size=[2])} for s in "ab"]
    with pytest.raises(tg.StructureMismatchError, match=r"outputs\['t'\]"):
        tg.gather(outs, "cpu")


def test_replicas_with_other_values_for_every_row_are_refused_naming_the_field() -> None:
    # a NonTensorData (one value for all its rows) of a list: its value sat in the TensorDict's
    # metadata too, so the message named the TensorDict, cut before the values; now the field,
    # where they differ, and what to do with per-row values
    outs = [
        TensorDict(
            {"x": torch.zeros(len(w)), "words": NonTensorData(w, batch_size=[len(w)])}, [len(w)]
        )
        for w in (["a", "b", "c"], ["d", "e"])
    ]
    with pytest.raises(tg.StructureMismatchError) as info:
        tg.gather(outs, "cpu")
    text = str(info.value)
    assert text.startswith(
        "outputs.words: replica 1's static fields/metadata ...'data': ['d', 'e']"
    )
    assert "NonTensorStack.from_list(values)" in text


def test_per_row_strings_are_split_and_joined_by_rows() -> None:
    # a TensorDict holding a list as long as its batch (a NonTensorStack): scatter refused it,
    # blaming the leaves, and gather refused its shards; a bare NonTensorStack was sent whole
    # to every device (5 names came back as 10). Now its rows, as tensordict indexes and
    # concatenates them
    names = list("abcde")
    td = TensorDict({"x": torch.arange(5.0), "name": names}, [5])
    for fast in (True, False):
        with contextlib.nullcontext() if fast else reference_only():
            shards = tg.scatter(td, ["cpu"] * 2)
            assert [s["name"] for s in shards] == [td[:3]["name"], td[3:]["name"]]
            out = tg.gather(list(shards), "cpu")
            assert out["name"] == torch.cat([td[:3], td[3:]])["name"] == names
            assert out.batch_size == torch.Size([5])
            bare = tg.scatter(
                {"x": torch.arange(5), "n": NonTensorStack.from_list(names)}, ["cpu"] * 2
            )
            assert [s["n"].tolist() for s in bare] == [names[:3], names[3:]]
            assert tg.gather(list(bare), "cpu")["n"].tolist() == names


def test_one_value_for_every_row_is_kept_as_tensordict_keeps_it() -> None:
    # a NonTensorData holds one value for all its rows: each shard holds it, as td[rows] does
    td = TensorDict(
        {"x": torch.arange(5.0), "words": NonTensorData(["a", "b"], batch_size=[5])}, [5]
    )
    shards = tg.scatter(td, ["cpu"] * 2)
    assert [s["words"] for s in shards] == [td[:3]["words"], td[3:]["words"]] == [["a", "b"]] * 2
    assert tg.gather(list(shards), "cpu")["words"] == torch.cat([td[:3], td[3:]])["words"]


def test_packed_sequence_comes_back_as_one_device_packs_it() -> None:
    x = batch()
    one = pack_sequence(_sequences(x), enforce_sorted=False)
    out = tg.gather([pack_sequence(_sequences(s), enforce_sorted=False) for s in x.split(5)], "cpu")
    assert isinstance(out, PackedSequence)
    assert torch.equal(out.batch_sizes, one.batch_sizes) and torch.equal(out.data, one.data)


def test_collector_puts_a_packed_sequence_in_dataset_order() -> None:
    # (it was refused: "a PackedSequence holds its rows its own way, which the Collector cannot
    # put in dataset order"; now each add's sequences are placed as rows are, and packed again)
    seqs = [torch.full((n,), float(n)) for n in (2, 1, 3)]
    for fast in (True, False):
        with contextlib.nullcontext() if fast else reference_only():
            col = tgd.Collector()
            col.add({"p": pack_sequence([seqs[2], seqs[0]], enforce_sorted=False)}, indices=[2, 0])
            col.add({"p": pack_sequence([seqs[1]])}, indices=[1])
            out = col.all_gather()["p"]
        one = pack_sequence(seqs, enforce_sorted=False)
        assert isinstance(out, PackedSequence) and col.indices.tolist() == [0, 1, 2]
        for got, want in zip(out, one):
            assert (got is None and want is None) or torch.equal(got, want)


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    """The counts of the cases this module ran, shown at its end (``-rA`` or ``-v``: in the
    terminal)."""
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or not COUNTS:
        return
    reporter.write_line("")
    for key in sorted(COUNTS):
        if key != "refusals":
            reporter.write_line(f"batch nodes, {key}: {dict(COUNTS[key])}")
    for reason, n in sorted(COUNTS["refusals"].items()):
        reporter.write_line(f"  refused x{n}: {reason}")
