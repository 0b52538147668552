"""Regression tests for issue 10's list of what broke when speed was spread through the package.

One test (or a small group) per bullet of the issue's first list; each failed on the code before
the engine rework (commit 86d809b) and passes on the one engine. The thread-pool bullet and
``treegather.distributed`` are tested with the pool and the collectives.

No timing asserts: a cost cliff shows up as work that should not happen at all (a tensor's
``repr``, a layout resolved again), counted directly.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.utils._pytree as torch_pytree
from corpus import Tagged
from torch import nn

import treegather as tg
from treegather import _compiled, _layout

try:
    from treegather._compiled import COMPILE_AFTER
except ImportError:  # the code before the engine rework, where these tests must fail
    COMPILE_AFTER = 3

WARM = COMPILE_AFTER + 2  # calls after which a structure's guards and builders are compiled
CPU2 = ["cpu", "cpu"]


def _wide(prefix: str, n: int = 100) -> dict[str, torch.Tensor]:
    return {f"{prefix}{i}": torch.full((4, 2), float(i)) for i in range(n)}


# -------------------------------------------------------------------------- the cost cliff


def test_alternating_structures_never_format_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two 100-leaf dicts in turn (train/eval, a GAN step): a miss never ``repr``s a tensor.

    Before: every miss asked ``flatten_up_to`` first and optree formatted the whole tree into the
    error it raised (900x the cost of a hit).
    """
    calls = [0]
    original = torch.Tensor.__repr__

    def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> str:
        calls[0] += 1
        return original(self, *args, **kwargs)

    train, evaluation = _wide("train"), _wide("eval")
    monkeypatch.setattr(torch.Tensor, "__repr__", counting)
    for step in range(2 * WARM):
        tree = train if step % 2 else evaluation
        shards = tg.scatter(tree, CPU2)
        out = tg.gather(list(shards), "cpu")
        assert list(out) == list(tree)
    assert calls[0] == 0, f"Tensor.__repr__ called {calls[0]} times"


def test_rotating_more_structures_than_the_cache_holds_never_recompiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """20 dict structures in turn (the cache holds 16 per root type), scattered and gathered:
    after two turns no code is generated and no structure's steps are made again (each call
    costs at most a cold call's work), while the structures the cache keeps stay compiled; a
    structure then used repeatedly is taken in and compiled.

    Before, each structure was evicted before its next use, made again and, three sightings
    later, compiled again: code was generated 56 times in 100 calls.
    """
    from treegather._compiled import codegen, structure

    trees = [_wide(f"s{j}_", 6) for j in range(20)]
    outs = [list(tg.scatter(tree, ["cpu"] * 4)) for tree in trees]
    made = {"code": 0, "steps": 0}
    generate, steps = codegen._generate, structure.structure_steps

    def counting_generate(*args: Any, **kwargs: Any) -> Any:
        made["code"] += 1
        return generate(*args, **kwargs)

    def counting_steps(*args: Any, **kwargs: Any) -> Any:
        made["steps"] += 1
        return steps(*args, **kwargs)

    monkeypatch.setattr(codegen, "_generate", counting_generate)
    monkeypatch.setattr(structure, "structure_steps", counting_steps)

    def steady(call: Any, items: list[Any]) -> dict[str, int]:
        """What four turns of the rotation make, after six turns to settle (the structures
        the cache keeps are compiled on their third hit, in the fifth turn)."""
        tg.clear_caches()
        for turn in range(10):
            if turn == 6:
                made.update(code=0, steps=0)
            for item in items:
                call(item)
        return dict(made)

    assert steady(lambda out: tg.gather(out, "cpu"), outs) == {"code": 0, "steps": 0}
    assert steady(lambda tree: tg.scatter(tree, CPU2), trees) == {"code": 0, "steps": 0}
    assert list(tg.gather(outs[3], "cpu")) == list(trees[3])
    kept = structure._STRUCTURES.get(structure.bucket_key(trees[0]))
    assert len(kept) == structure._BUCKET
    assert all(st.read is not st._read_checked for st in kept)  # compiled, and found each turn
    hot = _wide("hot", 6)
    for _ in range(WARM):
        tg.scatter(hot, CPU2)
    found = _compiled.recognise(hot)[1]
    assert found is not None and found.read is not found._read_checked


def test_a_structure_costs_the_same_whatever_else_was_seen() -> None:
    """Issue 46: a warm 10-leaf dict is checked against no other structure's guard once it is
    found, whatever was seen before: neither a 20,000-leaf dict used more recently (another
    length: another bucket) nor another 10-leaf dict of the same length (the structure found
    last goes first). Before, the bucket kept its structures newest first, so the big one's
    guard ran before the small one's on every call, for good.
    """
    from treegather._compiled import structure

    bucket_key = getattr(structure, "bucket_key", type)  # (before: one bucket per root type)
    tg.clear_caches()
    small, twin = _wide("k", 10), _wide("twin", 10)
    big = _wide("k", 20_000)  # (its first keys are the small dict's)
    outs = list(tg.scatter(small, CPU2))
    for _ in range(WARM):
        tg.scatter(small, CPU2), tg.gather(outs, "cpu")
    for tree in (big, twin):
        tree_outs = list(tg.scatter(tree, CPU2))
        for _ in range(WARM):
            tg.scatter(tree, CPU2), tg.gather(tree_outs, "cpu")
    calls = collections.Counter[str]()
    others = [
        st
        for tree in (big, twin)
        for st in structure._STRUCTURES.get(bucket_key(tree))
        if structure.find(tree) and st is structure.find(tree)[0]  # type: ignore[index]
    ]
    assert len(others) == 2 and all(st.read is not st._read_checked for st in others)
    for st in others:  # every way a lookup reaches another structure, counted
        for name in ("read", "read_any"):
            reader = getattr(st, name)
            setattr(st, name, lambda tree, r=reader, n=name: (calls.update([n]), r(tree))[1])
        read_columns = st.columns_reader(2)[2]
        counted = lambda trees, r=read_columns: (calls.update(["columns"]), r(trees))[1]  # noqa: E731
        st.columns = {2: (counted, False, counted)}
    tg.scatter(small, CPU2), tg.gather(outs, "cpu")  # (the twin, found last, goes second)
    calls.clear()
    for _ in range(10):
        shards = tg.scatter(small, CPU2)
        assert tg.gather(outs, "cpu").keys() == small.keys() and len(shards) == 2
    assert not calls, dict(calls)


class ReprRaises:
    """A leaf whose repr fails (a lazy proxy, a handle to a closed resource)."""

    def __repr__(self) -> str:
        raise RuntimeError("repr not available")


class ReprRaisesTensor(torch.Tensor):
    """A tensor subclass whose repr fails."""

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        raise RuntimeError("repr not available")


@pytest.mark.parametrize("kind", ["object", "tensor_subclass"])
def test_leaf_whose_repr_raises_after_same_root_type_cached(kind: str) -> None:
    """A valid call must not depend on which structures with its root type were seen before."""
    for _ in range(WARM):  # another dict structure is cached and compiled
        tg.gather(list(tg.scatter({"x": torch.zeros(4), "y": torch.ones(4)}, CPU2)), "cpu")
    if kind == "object":
        odd: Any = ReprRaises()
    else:
        odd = torch.arange(4.0).as_subclass(ReprRaisesTensor)
    tree = {"x": torch.arange(4.0), "odd": odd}
    for _ in range(WARM):
        shards = tg.scatter(tree, CPU2)
        assert [s["x"].tolist() for s in shards] == [[0.0, 1.0], [2.0, 3.0]]
        out = tg.gather(list(shards), "cpu")
        assert out["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
        if kind == "object":
            assert [s["odd"] is odd for s in shards] == [True, True]
            assert out["odd"] == [odd, odd]
        else:
            assert type(out["odd"]) is ReprRaisesTensor
            assert out["odd"].as_subclass(torch.Tensor).tolist() == [0.0, 1.0, 2.0, 3.0]


# -------------------------------------------------------------------------- stale answers


@pytest.mark.parametrize("value", [True, 1.0, False, 0.0])
def test_static_field_keeps_its_type_after_an_equal_value_was_cached(value: Any) -> None:
    """A static field passed ``True`` after ``1`` was cached comes back ``True`` (not ``1``)."""
    cached = 0 if value in (False, 0.0) else 1
    data = torch.arange(4.0)
    for _ in range(WARM):
        assert tg.scatter(Tagged(data, name=cached), CPU2)[0].name == cached
        tg.gather([Tagged(data, name=cached)] * 2, "cpu")
    shards = tg.scatter(Tagged(data, name=value), CPU2)
    assert [type(s.name) for s in shards] == [type(value)] * 2
    assert [s.name for s in shards] == [value] * 2
    out = tg.gather([Tagged(data, name=value)] * 2, "cpu")
    assert type(out.name) is type(value) and out.name == value


class StrKey(str, enum.Enum):
    A = "a"


@pytest.mark.parametrize(
    ("cached", "key"), [(1, True), (1, 1.0), (0, False), ("a", StrKey.A)], ids=repr
)
def test_dict_key_keeps_its_type_after_an_equal_key_was_cached(cached: Any, key: Any) -> None:
    """``{True: x}`` after ``{1: x}`` was cached comes back with the key ``True``, as cold.

    (The same stale answer as a static field's: dict keys compared with ``==``.)
    """
    data = torch.arange(4.0)
    for _ in range(WARM):
        tg.scatter({cached: data}, CPU2)
        tg.gather([{cached: data}] * 2, "cpu")
    shards = tg.scatter({key: data}, CPU2)
    assert [type(k) for s in shards for k in s] == [type(key)] * 2
    out = tg.gather([{key: data}] * 2, "cpu")
    assert [type(k) for k in out] == [type(key)]


class KeptContext:
    """Registered only with torch's pytree; its unflatten keeps the context list it is given."""

    def __init__(self, names: list[Any], values: list[Any]) -> None:
        self.names, self.values = names, values


torch_pytree.register_pytree_node(
    KeptContext, lambda k: (list(k.values), list(k.names)), lambda ch, names: KeptContext(names, ch)
)


def test_a_cached_context_list_is_never_shared_between_results() -> None:
    """A structure whose node context is a list of plain values (``ModelOutput``'s keys) is
    rebuilt from the cached structure, and each result still gets a list of its own: changing
    one result's list changes no later result; ``[True]`` is not taken for ``[1]``."""
    data = torch.arange(4.0)
    outs = []
    for _ in range(WARM + 2):
        shards = tg.scatter(KeptContext(["a", 1], [data, data]), CPU2)
        out = tg.gather([KeptContext(["a", 1], [s.values[0], s.values[1]]) for s in shards], "cpu")
        assert out.names == ["a", 1] and [type(n) for n in out.names] == [str, int]
        out.names.append("changed")
        shards[0].names.append("changed")
        outs.append(out)
    assert len({id(o.names) for o in outs}) == len(outs)
    out = tg.gather([KeptContext([True], [data])] * 2, "cpu")
    assert [type(n) for n in out.names] == [bool]
    for _ in range(WARM):  # names that are strs, then an equal str subclass (an str enum)
        tg.gather([KeptContext(["a"], [data])] * 2, "cpu")
    out = tg.gather([KeptContext([StrKey.A], [data])] * 2, "cpu")
    assert [type(n) for n in out.names] == [StrKey]
    assert [type(n) for s in tg.scatter(KeptContext([True], [data]), CPU2) for n in s.names] == [
        bool,
        bool,
    ]


def test_rule_layout_keeps_its_fields_after_an_equal_rule_was_cached() -> None:
    """A plan cached for ``pad(fill=1)`` does not answer for ``pad(fill=True)``: the error names
    the rule the call gave, as a cold call does."""
    outs = [{"a": "x"}, {"a": "y"}]
    for _ in range(WARM):
        with pytest.raises(tg.TreegatherError, match=r"pad\(fill=1\)"):
            tg.gather(outs, "cpu", tg.pad(fill=1))
    with pytest.raises(tg.TreegatherError, match=r"pad\(fill=True\)"):
        tg.gather(outs, "cpu", tg.pad(fill=True))


@pytest.mark.parametrize("phase", ["scatter", "gather"])
def test_layout_true_after_layout_one_is_an_error_as_in_a_fresh_process(phase: str) -> None:
    """``{"a": True}`` is not a rule; a cached plan for the equal ``{"a": 1}`` must not say so."""
    data = {"a": torch.zeros(2, 4)}

    def call(layout: Any) -> Any:
        if phase == "scatter":
            return tg.scatter(data, CPU2, layout)
        return tg.gather([data, data], "cpu", layout)

    for _ in range(WARM):
        call({"a": 1})
    with pytest.raises(tg.LayoutError) as warm:
        call({"a": True})
    tg.clear_caches()
    with pytest.raises(tg.LayoutError) as cold:
        call({"a": True})
    assert str(warm.value) == str(cold.value)
    assert "True is not a rule" in str(cold.value)


# -------------------------------------------------------------------- caches that let go


def test_classes_created_per_call_are_freed() -> None:
    """A namedtuple (and a leaf class) made inside ``forward`` each step is not kept forever.

    Before: 4,000 of 4,000 such classes stayed alive after 2,000 calls.
    """
    namedtuples: list[weakref.ref[type]] = []
    leaf_classes: list[weakref.ref[type]] = []
    for i in range(2000):
        out_type = collections.namedtuple("Out", ["logits", "extra"])
        leaf_type = type("Handle", (), {})
        namedtuples.append(weakref.ref(out_type))
        leaf_classes.append(weakref.ref(leaf_type))
        shards = tg.scatter(out_type(torch.zeros(4, 2), {"h": leaf_type()}), CPU2)
        tg.gather(list(shards), "cpu")
        tg.gather([{"h": leaf_type(), "x": torch.zeros(1)}] * 2, "cpu")
        del out_type, leaf_type, shards
        if i == 999:
            gc.collect()
            halfway = sum(r() is not None for r in namedtuples + leaf_classes)
    gc.collect()
    alive_namedtuples = sum(r() is not None for r in namedtuples)
    alive_leaves = sum(r() is not None for r in leaf_classes)
    bound = _caches_bound()
    assert alive_namedtuples <= bound, f"{alive_namedtuples} of 2000 namedtuple classes alive"
    assert alive_leaves <= bound, f"{alive_leaves} of 2000 leaf classes alive"
    assert alive_namedtuples + alive_leaves <= halfway, "still growing after 1,000 calls"


def _caches_bound() -> int:
    """How many entries treegather's caches hold at most (each keeps at most one class)."""
    from treegather._caches import caches  # (absent before the rework: the test fails above)

    return sum(c.maxsize for c in caches())


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, extra: Any = None) -> Any:
        return {"y": self.linear(x), "extra": extra}


def _cyclic_garbage(call: Any) -> tuple[int, list[str]]:
    """Run ``call`` with the collector off; how many objects it left in reference cycles."""
    gc.collect()
    was_enabled, flags = gc.isenabled(), gc.get_debug()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        call()
        found = gc.collect()
        kinds = sorted({type(o).__qualname__ for o in gc.garbage})
        return found, kinds
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()


def test_data_parallel_model_no_refcycles() -> None:
    """torch's ``test_data_parallel_model_no_refcycles``, on ``treegather.DataParallel``.

    Before: each new structure left a reference cycle (the key-order checker's recursive
    closure), 20-25 objects per call.
    """
    model = tg.DataParallel(_Net(), device_ids=["cpu"] * 2)
    x = torch.randn(4, 1)
    for _ in range(WARM):
        model(x)
    found, kinds = _cyclic_garbage(lambda: model(x))
    assert found == 0, f"a warm call left {found} objects in cycles: {kinds}"
    extra = {"a": torch.zeros(4, 2), "b": [torch.zeros(4), ("tag", None)]}
    found, kinds = _cyclic_garbage(lambda: model(x, extra))
    assert found == 0, f"a new structure left {found} objects in cycles: {kinds}"


# ------------------------------------------------------------------------- inline layouts


def _count_resolutions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count plans built: ``_layout.plan._build`` is the work ``resolve`` does for a layout (it is
    what every path, cached or not, calls for a plan it does not have)."""
    count = [0]
    build = _layout.plan._build

    def counting(*args: Any) -> Any:
        count[0] += 1
        return build(*args)

    monkeypatch.setattr(_layout.plan, "_build", counting)
    return count


INLINE_LAYOUTS = {
    "by_path": lambda name: tg.by_path({"loss": "mean"}),
    "by_path with rules": lambda name: tg.by_path({"loss": tg.mean(), "*": tg.cat()}),
    "prefix dict": lambda name: {"loss": "mean", name: 0},
}


def test_inline_layouts_are_resolved_like_hoisted_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gather(outs, "cpu", tg.by_path({...}))`` in a loop (as every example writes it), or an
    equal prefix-tree dict each call, resolves no more than a hoisted layout: once the
    structure is known (its second sighting), never again.

    Before: ``by_path`` had no value equality, so an inline one was resolved every call.
    """
    count = _count_resolutions(monkeypatch)

    def outputs(name: str) -> list[Any]:
        return [{"loss": torch.tensor(float(r)), name: torch.zeros(2, 3)} for r in range(2)]

    for what, make in INLINE_LAYOUTS.items():
        per_call: dict[str, list[int]] = {"hoisted": [], "inline": []}
        layout = make(f"hoisted_{what}")
        hoisted, inline = outputs(f"hoisted_{what}"), outputs(f"inline_{what}")
        for _ in range(2 * WARM):  # (two structures, each cold at its first call)
            before = count[0]
            tg.gather(hoisted, "cpu", layout)
            per_call["hoisted"].append(count[0] - before)
            before = count[0]
            out = tg.gather(inline, "cpu", make(f"inline_{what}"))
            per_call["inline"].append(count[0] - before)
            assert out["loss"].item() == 0.5
        assert per_call["inline"] == per_call["hoisted"], (what, per_call)
        assert sum(per_call["inline"][2:]) == 0, (what, per_call)


# ---------------------------------------------------------------------------------- depth


def _deep(levels: int, leaf: Any) -> Any:
    tree = leaf
    for i in range(levels):
        tree = {"c": tree} if i % 2 else [tree]
    return tree


def _bottom(tree: Any, levels: int) -> Any:
    for i in reversed(range(levels)):
        tree = tree["c"] if i % 2 else tree[0]
    return tree


def test_thousand_level_tree_scatters_and_gathers() -> None:
    """A 1000-level tree (dict/list alternating) that optree flattens: cold and warm, no
    ``RecursionError`` anywhere (guards, plans, paths, builders)."""
    levels = 1000
    tree = _deep(levels, torch.arange(6.0))
    for call in range(WARM):
        shards = tg.scatter(tree, CPU2)
        assert [_bottom(s, levels).tolist() for s in shards] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        out = tg.gather(list(shards), "cpu")
        assert _bottom(out, levels).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], call
        assert type(out) is dict and type(out["c"]) is list


def test_a_users_defaultdict_is_never_changed_by_a_structure_check() -> None:
    """Found after the rework: the compiled guard indexed a defaultdict before comparing its
    keys, and indexing a missing key inserts it. A replica with other keys than the structure
    seen before got a new key (and an empty list) while gather was only checking it."""
    seen = collections.defaultdict(list, {"a": {"x": torch.zeros(2)}, "b": [torch.ones(2)]})
    for _ in range(WARM):
        tg.gather([seen, seen], "cpu")
    other = collections.defaultdict(list, {"c": {"x": torch.zeros(2)}, "b": [torch.ones(2)]})
    for replicas in ([other, other], [seen, other]):
        mismatch = replicas[0] is seen
        with pytest.raises(tg.StructureMismatchError) if mismatch else contextlib.nullcontext():
            tg.gather(replicas, "cpu")
        assert list(other) == ["c", "b"]


# ----------------------------------------------------------------------------- clearing


def _fill_caches() -> None:
    for name in ("a", "b", "c"):
        tree = {name: torch.zeros(4), "tag": name}
        for _ in range(WARM):
            tg.gather(list(tg.scatter(tree, CPU2)), "cpu")


def test_clear_caches_empties_every_cache() -> None:
    from treegather._caches import caches

    _fill_caches()
    assert any(len(c) for c in caches()), "nothing was cached: the test tests nothing"
    tg.clear_caches()
    assert {c.name: len(c) for c in caches()} == {c.name: 0 for c in caches()}


def test_registering_a_node_clears_caches_and_is_seen_at_once() -> None:
    from treegather._caches import caches

    @dataclasses.dataclass
    class Fresh:
        data: Any

    outs = [{"f": Fresh(torch.ones(2)), "x": torch.zeros(2)} for _ in range(2)]
    for _ in range(WARM):  # unregistered: a leaf, and an error that says to register it
        with pytest.raises(tg.LeafTypeError, match="register_dataclass"):
            tg.gather(outs, "cpu")
        tg.gather([{"x": torch.zeros(2)}] * 2, "cpu")  # (something for the caches to hold)
    _fill_caches()
    assert any(len(c) for c in caches()), "nothing was cached: the test tests nothing"
    tg.register_dataclass(Fresh)
    # Every cache of tree structures is empty (kept replicas, devices and generated
    # TorchScript classes do not depend on which classes are nodes).
    assert {c.name: len(c) for c in caches() if c.trees} == {c.name: 0 for c in caches() if c.trees}
    out = tg.gather(outs, "cpu")
    assert type(out["f"]) is Fresh and out["f"].data.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_tensors_next_to_plain_values_scatter_as_the_definition_does() -> None:
    """The flags of a transformers call (``use_cache=False``) beside the batch: warm calls
    (the compiled layer's per-step case) give what ``reference_only()`` gives, each plain value
    the very object in every shard; a batch size that differs, or a 0-dim tensor among them,
    is the definition's answer too."""
    from treegather._caches import reference_only

    ids = torch.arange(24).view(6, 4)
    flags = {"use_cache": False, "n": 3, "scale": -0.0, "name": "x", "raw": b"y", "z": 1j}
    for _ in range(WARM + 1):
        got = tg.scatter({"ids": ids, **flags, "mask": ids > 3}, ["cpu"] * 3)
        with reference_only():
            ref = tg.scatter({"ids": ids, **flags, "mask": ids > 3}, ["cpu"] * 3)
        assert got.sizes == ref.sizes == (2, 2, 2)
        for a, b in zip(got, ref):
            assert list(a) == list(b) and torch.equal(a["ids"], b["ids"])
            assert all(a[key] is flags[key] for key in flags)
    for bad in (
        {"ids": ids, "more": torch.ones(5), "use_cache": True},
        {"ids": ids, "t": torch.tensor(1.0), "f": 1},
    ):
        for _ in range(WARM + 1):
            outcomes = []
            for context in (contextlib.nullcontext, reference_only):
                with context():
                    try:
                        shards = tg.scatter(bad, CPU2)
                        outcomes.append(("ok", shards.sizes, [sorted(s) for s in shards]))
                    except tg.TreegatherError as exc:
                        outcomes.append((type(exc).__name__, str(exc)))
            assert outcomes[0] == outcomes[1]
