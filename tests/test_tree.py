"""The pytree layer: which classes are nodes, how they are rebuilt, key order, the torch bridge."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, deque, namedtuple
from typing import Any

import pytest
import torch
import torch.utils._pytree as torch_pytree
from corpus import (
    CASE_IDS,
    CASES,
    AttrDict,
    CausalLMOutput,
    FrozenSample,
    ModelOutputBase,
    Point,
    Sample,
    Tagged,
    assert_tree_equal,
    gather_inverse,
)

import treegather as tg
from treegather._compiled import recognise
from treegather._tree import flatten, format_path, nodes

CPU2 = ["cpu", "cpu"]


def roundtrip(tree: Any, devices: list[str] = CPU2) -> Any:
    shards = tg.scatter(tree, devices)
    return tg.gather(shards, "cpu", gather_inverse(tree), sizes=shards.sizes)


# ---------------------------------------------------------------------- flatten / unflatten


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_flatten_then_unflatten_rebuilds_the_tree(case: Any) -> None:
    leaves, spec = flatten(case.tree)
    assert_tree_equal(spec.unflatten(leaves), case.tree)
    # A second call (served by the structure cache) gives the same answer.
    leaves2, spec2 = flatten(case.tree)
    assert_tree_equal(spec2.unflatten(leaves2), case.tree)
    assert len(leaves2) == len(leaves)


def test_none_is_an_empty_node_not_a_leaf() -> None:
    leaves, _ = flatten({"a": None, "b": [None, 1]})
    assert leaves == [1]


def test_strings_and_numbers_are_leaves() -> None:
    leaves, _ = flatten({"s": "abc", "i": 1, "f": 2.0, "t": torch.tensor(1)})
    assert len(leaves) == 4
    assert "abc" in leaves


def test_nodes_and_format_path_write_paths_as_users_type_them() -> None:
    tree = {"out": Point(x=[torch.zeros(1)], y=torch.zeros(1))}
    _, spec = flatten(tree)
    paths = [format_path("outputs", n.path) for n in nodes(spec)]
    assert paths == [
        "outputs",
        "outputs['out']",
        "outputs['out'].x",
        "outputs['out'].x[0]",
        "outputs['out'].y",
    ]


# ------------------------------------------------------------------------------ registration


def test_register_dataclass_as_a_function_and_as_a_decorator() -> None:
    @dataclasses.dataclass
    class AsFunction:
        a: Any

    assert tg.register_dataclass(AsFunction) is AsFunction

    @tg.register_dataclass(static=())
    @dataclasses.dataclass
    class AsDecoratorWithArgs:
        a: Any

    for cls in (AsFunction, AsDecoratorWithArgs, Sample):
        out = roundtrip(cls(torch.arange(4)) if cls is not Sample else cls(torch.arange(4), 1))
        assert type(out) is cls
    shards = tg.scatter(AsFunction(torch.arange(4)), CPU2)
    assert [s.a.tolist() for s in shards] == [[0, 1], [2, 3]]


def test_register_dataclass_rejects_what_it_cannot_register() -> None:
    class NotADataclass:
        pass

    with pytest.raises(TypeError, match="register_dataclass expects a class decorated"):
        tg.register_dataclass(NotADataclass)
    with pytest.raises(ValueError, match="already registered"):
        tg.register_dataclass(Sample)

    @dataclasses.dataclass
    class Fields:
        a: Any

    with pytest.raises(ValueError, match=r"no field\(s\) \['nope'\]"):
        tg.register_dataclass(Fields, static=("nope",))


def test_static_fields_are_passed_through_untouched() -> None:
    shards = tg.scatter(Tagged(data=torch.arange(6), name="eval"), ["cpu"] * 3)
    assert [s.name for s in shards] == ["eval"] * 3
    assert [s.data.tolist() for s in shards] == [[0, 1], [2, 3], [4, 5]]
    out = tg.gather(shards, "cpu")
    assert out.name == "eval"
    assert out.data.tolist() == list(range(6))


def test_static_fields_must_agree_between_replicas() -> None:
    outs = [Tagged(torch.zeros(1), name="a"), Tagged(torch.zeros(1), name="b")]
    with pytest.raises(tg.StructureMismatchError, match="static"):
        tg.gather(outs, "cpu")


def test_static_field_declared_with_field_metadata() -> None:
    @tg.register_dataclass
    @dataclasses.dataclass
    class WithMeta:
        x: Any
        n: int = dataclasses.field(default=0, metadata={"static": True})

    leaves, _ = flatten(WithMeta(torch.zeros(2), 5))
    assert len(leaves) == 1
    assert roundtrip(WithMeta(torch.arange(4), 5)).n == 5


def test_frozen_dataclass_is_rebuilt_through_its_constructor() -> None:
    tree = FrozenSample(image=torch.arange(6).reshape(3, 2), label="cat")
    out = roundtrip(tree)
    assert_tree_equal(out, tree)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.label = "dog"  # type: ignore[misc]


def test_dataclass_field_without_init_is_restored() -> None:
    @tg.register_dataclass
    @dataclasses.dataclass
    class Late:
        x: Any
        extra: Any = dataclasses.field(init=False, default=None)

    obj = Late(torch.arange(4))
    obj.extra = "set later"
    out = roundtrip(obj)
    assert out.extra == "set later"
    assert out.x.tolist() == [0, 1, 2, 3]


def test_model_output_shaped_dataclass_equals_one_made_normally() -> None:
    # Non-tensor content, so that == is the OrderedDict/dataclass equality itself.
    made = CausalLMOutput(logits="logits", hidden_states=("h0", "h1"))
    assert list(made.keys()) == ["logits", "hidden_states"]
    out = roundtrip(made)
    assert type(out) is CausalLMOutput
    assert out == made
    assert list(out.keys()) == ["logits", "hidden_states"]
    assert out.loss is None and "loss" not in out


def test_model_output_with_tensors_is_rebuilt_with_the_same_keys() -> None:
    made = CausalLMOutput(logits=torch.ones(4, 2), hidden_states=(torch.zeros(4, 3),))
    shards = tg.scatter(made, CPU2)
    for s in shards:
        assert type(s) is CausalLMOutput
        assert list(s.keys()) == ["logits", "hidden_states"]
        assert s["logits"] is s.logits
    out = tg.gather(shards, "cpu")
    normal = CausalLMOutput(logits=out.logits, hidden_states=out.hidden_states)
    assert list(out.keys()) == list(normal.keys())
    assert_tree_equal(out, made)


def test_register_node_with_names() -> None:
    shards = tg.scatter(AttrDict(b=torch.arange(4), a="note"), CPU2)
    assert all(type(s) is AttrDict for s in shards)
    assert [s["b"].tolist() for s in shards] == [[0, 1], [2, 3]]
    out = tg.gather(shards, "cpu", tg.by_path({"a": "first"}))
    assert out == AttrDict(b=out["b"], a="note")
    assert list(out) == ["b", "a"]


def test_registering_twice_is_an_error() -> None:
    class Once:
        def __init__(self, v: Any) -> None:
            self.v = v

    tg.register_node(Once, lambda o: ((o.v,), None), lambda aux, ch: Once(*ch))
    with pytest.raises(ValueError, match="already registered"):
        tg.register_node(Once, lambda o: ((o.v,), None), lambda aux, ch: Once(*ch))


# ----------------------------------------------------------------------- torch pytree bridge


def test_class_registered_with_torch_pytree_after_import_is_a_node() -> None:
    class Late:
        def __init__(self, a: Any, b: Any) -> None:
            self.a, self.b = a, b

    # Seen first while unknown: a leaf, broadcast whole.
    before = tg.scatter({"p": Late(torch.arange(4), "s")}, CPU2, tg.broadcast())
    assert before[0]["p"].a.tolist() == [0, 1, 2, 3]

    torch_pytree.register_pytree_node(
        Late, lambda p: ([p.a, p.b], ["a", "b"]), lambda ch, ctx: Late(*ch)
    )
    shards = tg.scatter({"p": Late(torch.arange(4), "s")}, CPU2)
    assert [s["p"].a.tolist() for s in shards] == [[0, 1], [2, 3]]
    assert [s["p"].b for s in shards] == ["s", "s"]
    out = tg.gather(shards, "cpu", tg.by_path({"p.b": "first"}))
    assert type(out["p"]) is Late
    assert out["p"].a.tolist() == [0, 1, 2, 3] and out["p"].b == "s"


def test_class_registered_with_optree_directly_after_it_was_a_leaf_is_a_node() -> None:
    """``optree.register_pytree_node(cls, ..., namespace=tg.NAMESPACE)`` is seen as
    :func:`treegather.register_node` is, by structures compiled while the class was a leaf: a
    shard gets its 4 rows (as a leaf holding the batch it is refused, not sent whole);
    unregistering it makes it a leaf again. Before, the cached structures kept treating it as
    a leaf."""
    import optree

    class Box:
        def __init__(self, x: Any) -> None:
            self.x = x

    def tree() -> Any:
        return {"a": torch.zeros(8), "box": Box(torch.arange(8))}

    def refused() -> None:  # a leaf holding the batch: it would be sent whole to each device
        with pytest.raises(tg.LeafTypeError, match=r"inputs\['box'\]: .*Box is an object"):
            tg.scatter(tree(), CPU2)
        assert type(tg.gather([tree(), tree()], "cpu")["box"]) is list

    for _ in range(5):  # compiled while Box is a leaf
        refused()
    optree.register_pytree_node(
        Box,  # type: ignore[arg-type]
        lambda b: ((b.x,), None),
        lambda _, ch: Box(*ch),
        namespace=tg.NAMESPACE,
    )
    try:
        for _ in range(5):
            shards = tg.scatter(tree(), CPU2)
            assert [s["box"].x.tolist() for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7]]
            out = tg.gather(shards, "cpu")
            assert type(out["box"]) is Box and out["box"].x.tolist() == list(range(8))
    finally:
        optree.unregister_pytree_node(Box, namespace=tg.NAMESPACE)
    refused()


def test_dataclass_registered_with_torch_pytree_is_understood() -> None:
    @dataclasses.dataclass
    class TorchDC:
        x: Any
        y: Any

    torch_pytree.register_dataclass(TorchDC)
    shards = tg.scatter(TorchDC(torch.arange(6), torch.ones(6, 2)), ["cpu"] * 3)
    assert len(shards) == 3 and all(type(s) is TorchDC for s in shards)
    assert shards.sizes == (2, 2, 2)
    out = tg.gather(shards, "cpu")
    assert_tree_equal(out, TorchDC(torch.arange(6), torch.ones(6, 2)))


def test_torch_own_types_stay_leaves() -> None:
    leaves, _ = flatten({"size": torch.Size([2, 3])})
    assert leaves == [torch.Size([2, 3])]


# ------------------------------------------------------------------------------- key order


def test_gather_keeps_replica_0_key_order_after_the_cache_saw_another_order() -> None:
    ab = {"a": torch.ones(2), "b": torch.zeros(2)}
    ba = {"b": torch.zeros(2), "a": torch.ones(2)}
    assert list(tg.gather([ab, ab], "cpu")) == ["a", "b"]
    assert list(tg.gather([ba, ba], "cpu")) == ["b", "a"]
    assert list(tg.gather([ab, ab], "cpu")) == ["a", "b"]


def test_gather_key_order_with_a_layout_after_the_cache_saw_another_order() -> None:
    layout = tg.by_path({"a": "cat"})
    ab = {"a": torch.ones(2), "b": torch.zeros(2)}
    ba = {"b": torch.zeros(2), "a": torch.ones(2)}
    assert list(tg.gather([ab, ab], "cpu", layout)) == ["a", "b"]
    assert list(tg.gather([ba, ba], "cpu", layout)) == ["b", "a"]


def test_scatter_keeps_the_input_key_order_after_the_cache_saw_another_order() -> None:
    ab = {"a": torch.ones(4, 2), "b": torch.arange(4)}
    ba = {"b": torch.arange(4), "a": torch.ones(4, 2)}
    assert [list(s) for s in tg.scatter(ab, CPU2)] == [["a", "b"]] * 2
    assert [list(s) for s in tg.scatter(ba, CPU2)] == [["b", "a"]] * 2
    layout = {"b": 0, "a": 1}
    split_a = {"a": torch.ones(2, 4), "b": torch.arange(4)}
    split_b = {"b": torch.arange(4), "a": torch.ones(2, 4)}
    assert [list(s) for s in tg.scatter(split_b, CPU2, layout)] == [["b", "a"]] * 2
    shards = tg.scatter(split_a, CPU2, layout)
    assert [list(s) for s in shards] == [["a", "b"]] * 2
    assert shards[0]["a"].shape == (2, 2) and shards[0]["b"].tolist() == [0, 1]


def test_nested_key_order_is_kept() -> None:
    x = {"outer": [{"y": torch.arange(2), "x": torch.arange(2)}], "first": torch.arange(2)}
    flatten(x)
    y = {"first": torch.arange(2), "outer": [{"x": torch.arange(2), "y": torch.arange(2)}]}
    out = tg.gather(tg.scatter(y, CPU2), "cpu")
    assert list(out) == ["first", "outer"]
    assert list(out["outer"][0]) == ["x", "y"]


def test_replicas_may_list_the_same_keys_in_another_order() -> None:
    r0 = {"b": torch.tensor([1.0]), "a": torch.tensor([10.0])}
    r1 = {"a": torch.tensor([20.0]), "b": torch.tensor([2.0])}
    out = tg.gather([r0, r1], "cpu")
    assert list(out) == ["b", "a"]
    assert out["a"].tolist() == [10.0, 20.0]
    assert out["b"].tolist() == [1.0, 2.0]


def test_layout_keys_are_paired_by_key_not_by_position() -> None:
    data = {"b": torch.arange(4), "a": torch.ones(2, 4)}
    shards = tg.scatter(data, CPU2, {"a": 1, "b": 0})
    assert shards[0]["a"].shape == (2, 2)
    assert shards[0]["b"].tolist() == [0, 1]
    outs = [{"b": torch.ones(1, 3), "a": torch.ones(1, 3)} for _ in range(2)]
    out = tg.gather(outs, "cpu", {"a": 1, "b": 0})
    assert out["a"].shape == (1, 6) and out["b"].shape == (2, 3)


def test_container_types_are_rebuilt_exactly() -> None:
    od = OrderedDict([("z", torch.arange(4)), ("a", torch.arange(4))])
    dd: defaultdict[str, Any] = defaultdict(int, {"y": torch.arange(4), "b": torch.arange(4)})
    Pair = namedtuple("Pair", ["left", "right"])
    nt = Pair(torch.arange(4), torch.arange(4))
    for tree in (od, dd, nt, [torch.arange(4)], (torch.arange(4),)):
        shards = tg.scatter(tree, CPU2)
        assert all(type(s) is type(tree) for s in shards)
        out = tg.gather(shards, "cpu")
        assert_tree_equal(out, tree)
    assert tg.gather(tg.scatter(dd, CPU2), "cpu").default_factory is int
    assert list(tg.gather(tg.scatter(od, CPU2), "cpu")) == ["z", "a"]


def test_the_compiled_layer_recognises_what_flatten_makes_cold_and_warm() -> None:
    tree = {"b": [torch.zeros(1), "x"], "a": None}
    for _ in range(5):  # a sighting, a new structure, hits, then the compiled guard
        leaves, _, spec = recognise(tree)
        assert spec == flatten(tree)[1] and leaves == flatten(tree)[0]


# ------------------------------------------------- mapping types behind the structure cache


def test_nested_mapping_types_are_kept_after_the_cache_saw_another_mapping_type() -> None:
    # optree's flatten_up_to accepts dict, OrderedDict and defaultdict for one another, so a
    # cached structure must not rebuild a plain dict as the OrderedDict seen before.
    t = torch.arange(4)
    made = [
        {"x": OrderedDict(a=t, b=t)},
        {"x": {"a": t, "b": t}},
        {"x": defaultdict(int, a=t, b=t)},
        {"x": OrderedDict(a=t)},
        {"x": {"a": t}},
    ]
    for tree in made:
        shards = tg.scatter(tree, CPU2)
        assert all(type(s["x"]) is type(tree["x"]) for s in shards), tree
        out = tg.gather(shards, "cpu")
        assert type(out["x"]) is type(tree["x"])
        leaves, spec = flatten(tree)
        assert type(spec.unflatten(leaves)["x"]) is type(tree["x"])


def test_default_factory_is_kept_after_the_cache_saw_another_factory() -> None:
    t = torch.arange(4)
    for factory in (list, int, list):
        tree = defaultdict(factory, {"a": t})
        assert tg.scatter(tree, CPU2)[0].default_factory is factory
        assert tg.gather([tree, tree], "cpu").default_factory is factory
        nested = {"d": defaultdict(factory, {"a": t, "b": t})}
        assert tg.scatter(nested, CPU2)[1]["d"].default_factory is factory
        out = tg.gather([nested, nested], "cpu", tg.by_path({"d.a": "cat"}))
        assert out["d"].default_factory is factory


# --------------------------------------------- transformers' ModelOutput, via torch's pytree


class TorchModelOutput(ModelOutputBase):
    """transformers' ModelOutput registers every subclass with torch's pytree as it is created:
    children are the values of the non-None fields, the context their keys."""

    def __init_subclass__(cls) -> None:
        torch_pytree.register_pytree_node(
            cls,
            lambda out: (list(out.values()), list(out.keys())),
            lambda values, context: cls(**dict(zip(context, values))),
        )


@dataclasses.dataclass
class TorchLMOutput(TorchModelOutput):
    loss: Any = None
    logits: Any = None
    hidden_states: Any = None


def test_model_output_registered_with_torch_pytree_round_trips() -> None:
    made = TorchLMOutput(logits=torch.arange(8.0).reshape(4, 2), hidden_states=(torch.ones(4, 1),))
    shards = tg.scatter({"out": made}, CPU2)
    assert all(type(s["out"]) is TorchLMOutput for s in shards)
    assert [list(s["out"].keys()) for s in shards] == [["logits", "hidden_states"]] * 2
    out = tg.gather([s["out"] for s in shards], "cpu")
    assert type(out) is TorchLMOutput and out.loss is None
    assert_tree_equal(out, made)
    loss = tg.gather(
        [TorchLMOutput(loss=torch.tensor(float(r)), logits=torch.ones(1, 2)) for r in range(2)],
        "cpu",
        tg.by_path({"loss": "mean"}),
    )
    assert loss.loss.item() == 0.5 and list(loss.keys()) == ["loss", "logits"]


def test_model_output_with_different_fields_per_replica_is_a_mismatch() -> None:
    outs = [
        TorchLMOutput(logits=torch.ones(1, 2)),
        TorchLMOutput(loss=torch.ones(()), logits=torch.ones(1, 2)),
    ]
    with pytest.raises(tg.StructureMismatchError, match="'loss'"):
        tg.gather(outs, "cpu")


def test_register_dataclass_after_the_torch_bridge_picked_the_class_up() -> None:
    # transformers registers its outputs with torch's pytree; a user then registering the same
    # class with treegather (to mark a static field, say) must not depend on whether a
    # treegather call happened in between.
    @dataclasses.dataclass
    class Bridged:
        x: Any
        tag: str = "t"

    torch_pytree.register_dataclass(Bridged)
    tg.scatter(torch.arange(4), CPU2)  # any treegather call bridges torch's new classes
    assert tg.register_dataclass(Bridged, static=("tag",)) is Bridged
    leaves, _ = flatten(Bridged(torch.arange(4), "s"))
    assert len(leaves) == 1  # the treegather registration (tag static) is the one in use
    shards = tg.scatter(Bridged(torch.arange(4), "s"), CPU2)
    assert [s.tag for s in shards] == ["s", "s"]
    with pytest.raises(ValueError, match="already registered"):
        tg.register_dataclass(Bridged)


def test_torch_return_types_and_deques_are_nodes() -> None:
    x = torch.randn(6, 3)
    shards = tg.scatter(x, ["cpu"] * 3)
    out = tg.gather([s.max(1) for s in shards], "cpu")
    assert type(out) is type(x.max(1))
    assert torch.equal(out.values, x.max(1).values) and torch.equal(out.indices, x.max(1).indices)
    d = deque([torch.arange(4), "tag"], maxlen=5)
    back = tg.gather(tg.scatter(d, CPU2), "cpu", deque(["cat", "first"], maxlen=5))
    assert type(back) is deque and back.maxlen == 5
    assert back[0].tolist() == [0, 1, 2, 3] and back[1] == "tag"


def test_deque_maxlen_is_kept_after_the_cache_saw_another_maxlen() -> None:
    t = torch.arange(4)
    for maxlen in (5, 3, None, 5):
        tree = {"d": deque([t], maxlen=maxlen)}
        assert tg.scatter(tree, CPU2)[0]["d"].maxlen == maxlen
        assert tg.gather([tree, tree], "cpu")["d"].maxlen == maxlen


# ------------------------------------------------------------- cycles and deep trees


def _cyclic() -> dict[str, Any]:
    d: dict[str, Any] = {"x": torch.zeros(4)}
    d["self"] = d
    return d


def _cyclic_list() -> list[Any]:
    items: list[Any] = [torch.zeros(4)]
    items.append({"up": items})
    return items


def _deep(levels: int, leaf: Any) -> Any:
    tree = leaf
    for _ in range(levels):
        tree = {"a": tree}
    return tree


CYCLE_CALLS: dict[str, tuple[Any, str]] = {
    "scatter": (lambda: tg.scatter(_cyclic(), CPU2), "inputs['self'] is inputs itself"),
    "scatter a list": (
        lambda: tg.scatter([torch.zeros(4), {"up": _cyclic_list()}], CPU2),
        "inputs[1]['up'][1]['up'] is inputs[1]['up'] itself",
    ),
    "scatter_kwargs": (
        lambda: tg.scatter_kwargs((_cyclic(),), {}, CPU2),
        "args[0]['self'] is args[0] itself",
    ),
    "gather": (lambda: tg.gather([_cyclic(), _cyclic()], "cpu"), "outputs['self'] is outputs"),
    "gather, replica 1": (
        lambda: tg.gather([{"x": torch.zeros(4), "self": {}}, _cyclic()], "cpu"),
        "replica 1: outputs['self'] is outputs itself",
    ),
    "explain": (lambda: tg.explain(_cyclic()), "inputs['self'] is inputs itself"),
}


@pytest.mark.parametrize("name", sorted(CYCLE_CALLS))
def test_a_tree_that_contains_itself_is_a_typed_error_naming_where_the_cycle_closes(
    name: str,
) -> None:
    """``d["self"] = d``: a :class:`TreeDepthError` naming the path that leads back to an
    ancestor, cold and with a structure of the same root type compiled. Before: optree's bare
    ``RecursionError``."""
    call, fragment = CYCLE_CALLS[name]
    for _ in range(2):
        with pytest.raises(tg.TreeDepthError, match="contains itself") as info:
            call()
        assert fragment in str(info.value)
        for _ in range(5):  # a dict structure compiled, for the next round
            tg.gather(list(tg.scatter({"x": torch.zeros(4), "self": {}}, CPU2)), "cpu")


def test_a_tree_deeper_than_optree_flattens_is_a_typed_error() -> None:
    tree = {"b": torch.zeros(4), "d": _deep(1000, torch.zeros(4))}  # 1001 levels
    for call in (
        lambda: tg.scatter(tree, CPU2),
        lambda: tg.gather([tree, tree], "cpu"),
        lambda: tg.explain(tree),
    ):
        with pytest.raises(tg.TreeDepthError, match="nested deeper than 1000 levels") as info:
            call()
        assert "['d']['a']['a']" in str(info.value) and len(str(info.value)) < 500


def test_a_deep_tree_that_does_not_fit_its_prefix_layout_is_a_layout_error() -> None:
    """A 1000-level tree whose prefix layout stops short: the explanation of the mismatch walks
    the layout without recursion. Before: a RecursionError from that walk."""
    tree = _deep(1000, torch.zeros(4))
    with pytest.raises(tg.LayoutError, match="not a prefix") as info:
        tg.scatter(tree, CPU2, _deep(999, {"b": 0}))
    assert "the layout lacks key(s) 'a' and has key(s) 'b' the data does not" in str(info.value)


# ------------------------------------------------------- what an unknown value holds


def test_held_tensor_reads_state_only_and_stays_within_its_bounds() -> None:
    from treegather._tree import held_tensor
    from treegather._tree.held import BUDGET, DEPTH

    class Guarded:
        """Every way of running code on access raises: the walk must use none of them."""

        __slots__ = ("__dict__", "__ids", "empty")

        def __init__(self) -> None:
            self.meta = "m"
            self.__ids = torch.arange(4)

        @property
        def batch(self) -> Any:
            raise AssertionError("a property was called")

        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"__getattr__({name!r}) was called")

    class Box:
        def __init__(self, value: Any) -> None:
            self.value = value

    class Items(list):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            raise AssertionError("the subclass's __iter__ was called")

    assert held_tensor(Guarded())[0] == "._Guarded__ids"  # type: ignore[index]
    assert held_tensor(Box(Items([1, torch.zeros(2)])))[0] == ".value[1]"  # type: ignore[index]
    nested: Any = torch.zeros(2)
    for _ in range(DEPTH - 1):
        nested = [nested]
    assert held_tensor(Box(nested)) is not None  # DEPTH levels down: found
    assert held_tensor(Box([nested])) is None  # one more: not read
    assert held_tensor(Box([0] * BUDGET + [torch.zeros(2)])) is None  # past the budget
    assert held_tensor(Box([0] * (BUDGET - 3) + [torch.zeros(2)])) is not None
    assert held_tensor(Box(torch.tensor(1.0))) is None  # a 0-dim tensor is no batch
    assert held_tensor(torch.nn.Linear(2, 2)) is None  # a module's tensors are its state
    assert held_tensor(Box(torch.nn.Linear(2, 2))) is None  # (and it is not entered)
