"""Errors are part of the API: classes, pinned messages, full paths, every problem, no partial work."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import namedtuple
from typing import Any, ClassVar

import pytest
import torch
from corpus import FILLS_THAT_DO_NOT_FIT, Sample, Tagged

import treegather as tg
from treegather._errors import safe_repr
from treegather._rules import fill_fits
from treegather._rules.leafwise import fill_value

CPU2 = ["cpu", "cpu"]
Out = namedtuple("Out", ["logits", "hidden"])

ERRORS = [
    (tg.LayoutError, ValueError),
    (tg.StructureMismatchError, ValueError),
    (tg.BatchSizeError, ValueError),
    (tg.LeafTypeError, TypeError),
    (tg.ShapeMismatchError, ValueError),
]


# -------------------------------------------------------------------------------- classes


@pytest.mark.parametrize(("cls", "builtin"), ERRORS, ids=[c.__name__ for c, _ in ERRORS])
def test_error_classes_refine_builtins_and_show_the_public_module(cls: type, builtin: type) -> None:
    assert issubclass(cls, tg.TreegatherError)
    assert issubclass(cls, builtin)
    assert cls.__module__ == "treegather"
    assert repr(cls) == f"<class 'treegather.{cls.__name__}'>"
    assert tg.TreegatherError.__module__ == "treegather"


# --------------------------------------------------------------------- full paths, pinned


def test_gather_shape_error_names_full_paths_shapes_the_rule_and_a_hint() -> None:
    outs = [
        Out(torch.ones(2, 3), [torch.ones(1, 2)] * 3),
        Out(torch.ones(2, 4), [torch.ones(1, 2), torch.ones(1, 2), torch.ones(1, 5)]),
    ]
    with pytest.raises(tg.ShapeMismatchError) as info:
        tg.gather(outs, "cpu")
    assert str(info.value) == (
        "2 problems:\n"
        "  - outputs.logits: cat(dim=0) needs equal sizes in every dim but 0, got replica 0: "
        "[2, 3], replica 1: [2, 4]\n"
        "  - outputs.hidden[2]: cat(dim=0) needs equal sizes in every dim but 0, got replica 0: "
        "[1, 2], replica 1: [1, 5]\n"
        "Hint: pad() concatenates tensors whose other dims differ; as_list() keeps per-replica "
        "values\n"
        "(treegather.explain(tree, layout) shows the rule of every leaf)"
    )


def test_gather_dict_paths_are_written_with_keys() -> None:
    outs = [{"outputs": {"logits": torch.ones(1, 2)}}, {"outputs": {"logits": torch.ones(1, 3)}}]
    with pytest.raises(tg.ShapeMismatchError, match=r"^outputs\['outputs'\]\['logits'\]: cat"):
        tg.gather(outs, "cpu")


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (
            tg.stack(),
            "outputs['t']: stack() needs equal shapes, got replica 0: [2], replica 1: [3, 1]",
        ),
        (
            tg.mean(),
            "outputs['t']: mean() needs equal shapes, got replica 0: [2], replica 1: [3, 1]",
        ),
        (tg.sum(), "outputs['t']: sum() needs equal shapes, got replica 0: [2], replica 1: [3, 1]"),
        (
            tg.cat(),
            "outputs['t']: cat() needs tensors with the same number of dims, "
            "got replica 0: [2], replica 1: [3, 1]",
        ),
        (
            tg.pad(),
            "outputs['t']: pad() needs tensors with the same number of dims (>= 1), "
            "got replica 0: [2], replica 1: [3, 1]",
        ),
    ],
    ids=["stack", "mean", "sum", "cat", "pad"],
)
def test_rule_errors_name_the_path_the_rule_and_the_shapes(layout: Any, message: str) -> None:
    outs = [{"t": torch.ones(2)}, {"t": torch.ones(3, 1)}]
    with pytest.raises(tg.ShapeMismatchError) as info:
        tg.gather(outs, "cpu", tg.by_path({"t": layout}))
    assert message in str(info.value)


def test_cat_of_0_dim_and_n_dim_is_named() -> None:
    with pytest.raises(
        tg.ShapeMismatchError, match=r"outputs\['t'\]: cat\(dim=0\) cannot mix 0-dim"
    ):
        tg.gather([{"t": torch.ones(2)}, {"t": torch.tensor(1.0)}], "cpu")


def test_cat_dim_out_of_range_is_named() -> None:
    with pytest.raises(
        tg.ShapeMismatchError,
        match=r"outputs\['t'\]: cat\(dim=3\) is out of range for 1-dim tensors",
    ):
        tg.gather([{"t": torch.ones(2)}, {"t": torch.ones(2)}], "cpu", {"t": 3})


@pytest.mark.parametrize("rule", ["cat", "stack", "mean", "sum", "pad"])
def test_a_non_tensor_under_a_tensor_rule_is_a_leaf_type_error(rule: str) -> None:
    with pytest.raises(tg.LeafTypeError) as info:
        tg.gather([{"t": torch.ones(2)}, {"t": "x"}], "cpu", {"t": rule})
    assert f"outputs['t']: {rule}(" in str(info.value)
    assert "replica 1 holds str 'x'" in str(info.value)


def test_first_check_names_the_path() -> None:
    with pytest.raises(tg.ShapeMismatchError) as info:
        tg.gather([{"lr": 0.1}, {"lr": 0.2}], "cpu", tg.by_path({"lr": tg.first(check=True)}))
    msg = str(info.value)
    assert "outputs['lr']" in msg
    assert "first(check=True): replica 1 differs from replica 0 (float 0.2 vs float 0.1)" in msg


def test_cat_items_names_the_path() -> None:
    with pytest.raises(tg.LeafTypeError) as info:
        tg.gather([{"w": ["a"]}, {"w": "b"}], "cpu", tg.by_path({"w": tg.cat_items()}))
    msg = str(info.value)
    assert "outputs['w']" in msg
    assert "cat_items() needs a list or tuple in every replica; replica 1 holds str 'b'" in msg


def test_scatter_errors_name_path_shape_dtype_device_and_rule() -> None:
    with pytest.raises(tg.TreegatherError) as info:
        tg.scatter({"images": torch.ones(2, 3)}, CPU2, tg.by_path({"images": tg.split(2)}))
    assert str(info.value) == (
        "inputs['images']: cannot split along dim 2: "
        "Tensor(shape=(2, 3), dtype=torch.float32, device=cpu)\n"
        "(treegather.explain(tree, layout) shows the rule of every leaf)"
    )


def test_scatter_lists_every_problem() -> None:
    tree = {"a": "x", "b": 3, "c": torch.tensor(1.0)}
    with pytest.raises(tg.LeafTypeError) as info:
        tg.scatter(tree, CPU2, tg.split())
    assert str(info.value) == (
        "3 problems:\n"
        "  - inputs['a']: split() needs a tensor, got str 'x' (use split_items() on a list of "
        "per-sample items)\n"
        "  - inputs['b']: split() needs a tensor, got int 3\n"
        "  - inputs['c']: cannot split along dim 0: Tensor(shape=(), dtype=torch.float32, "
        "device=cpu)\n"
        "(treegather.explain(tree, layout) shows the rule of every leaf)"
    )


def test_batch_size_error_message_is_pinned() -> None:
    with pytest.raises(tg.BatchSizeError) as info:
        tg.scatter({"images": torch.zeros(4, 3), "labels": torch.zeros(3)}, CPU2)
    assert str(info.value) == (
        "split leaves disagree on the batch size: 4 at inputs['images']; 3 at inputs['labels']\n"
        "Hint: use broadcast() for leaves every device needs whole\n"
        "(treegather.explain(tree, layout) shows the rule of every leaf)"
    )


def test_structure_errors_list_every_replica_and_path() -> None:
    outs = [{"a": 1, "b": [1]}, {"a": None, "b": [1, 2]}, {"c": 1}]
    with pytest.raises(tg.StructureMismatchError) as info:
        tg.gather(outs, "cpu")
    assert str(info.value) == (
        "3 problems:\n"
        "  - outputs['a']: replica 0 has int 1, replica 1 has None\n"
        "  - outputs['b']: replica 0 has a list of 1 item(s), replica 1 has a list of 2 item(s)\n"
        "  - outputs: replica 2 lacks key(s) 'a', 'b' and has extra key(s) 'c' (compared with "
        "replica 0)\n"
        "Hint: every replica must return the same structure; for a node whose length varies by "
        "replica (per-sample lists) use cat_items() or as_list() in the layout"
    )


def test_structure_error_in_a_namedtuple_uses_attribute_paths() -> None:
    outs = [Out(torch.ones(1), [torch.ones(1)] * 3), Out(torch.ones(1), [torch.ones(1), None, 1])]
    with pytest.raises(tg.StructureMismatchError) as info:
        tg.gather(outs, "cpu")
    assert (
        "outputs.hidden[1]: replica 0 has Tensor(shape=(1,), dtype=torch.float32, device=cpu)"
        ", replica 1 has None" in str(info.value)
    )


def test_structure_error_inside_a_dataclass_names_the_field() -> None:
    outs = [{"s": Sample(torch.ones(1), [1])}, {"s": Sample(torch.ones(1), [1, 2])}]
    with pytest.raises(tg.StructureMismatchError) as info:
        tg.gather(outs, "cpu")
    assert str(info.value).startswith(
        "outputs['s'].label: replica 0 has a list of 1 item(s), replica 1 has a list of 2 item(s)"
    )


def test_static_field_mismatch_names_the_node() -> None:
    outs = [{"t": Tagged(torch.ones(1), name="a")}, {"t": Tagged(torch.ones(1), name="b")}]
    with pytest.raises(tg.StructureMismatchError, match=r"outputs\['t'\]: replica 1's static"):
        tg.gather(outs, "cpu")


def test_unregistered_dataclass_hint() -> None:
    @dataclasses.dataclass
    class Batch:
        x: Any

    with pytest.raises(tg.LeafTypeError, match=r"register it with treegather\.register_dataclass"):
        tg.scatter({"b": Batch(torch.ones(2))}, CPU2)


def test_unregistered_dict_subclass_hint() -> None:
    class Features(dict):  # type: ignore[type-arg]
        pass

    with pytest.raises(tg.LeafTypeError) as info:
        tg.scatter({"f": Features(x=torch.ones(2))}, CPU2)
    msg = str(info.value)
    assert msg.startswith("inputs['f']: ")
    assert "register it with treegather.register_node" in msg


def test_layout_errors_name_the_layout_path() -> None:
    with pytest.raises(tg.LayoutError, match=r"layout at inputs\['x'\]: unknown rule 'spit'"):
        tg.scatter({"x": torch.ones(2)}, CPU2, {"x": "spit"})
    with pytest.raises(tg.LayoutError, match=r"layout at kwargs\['y'\]: 'cat' is a gather rule"):
        tg.scatter_kwargs((), {"y": torch.ones(2)}, CPU2, ((), {"y": "cat"}))


# ------------------------------------------------------------------- no partial work first


class Spy(torch.Tensor):
    """A tensor subclass logging every torch function called on it."""

    calls: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name not in (
            "__get__",
            "dim",
            "shape",
            "device",
            "__repr__",
            "size",
            "__format__",
            "__hash__",
            "__eq__",
            "__bool__",
        ):
            cls.calls.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


def spy(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape).as_subclass(Spy)


@pytest.mark.parametrize(
    ("last", "rule", "error"),
    [
        ("not a tensor", "split", tg.LeafTypeError),
        ((5,), "split", tg.BatchSizeError),
        ((4, 2), tg.split(2), tg.TreegatherError),
    ],
    ids=["type", "batch", "dim"],
)
def test_scatter_fails_before_splitting_or_moving_anything(
    last: Any, rule: Any, error: type
) -> None:
    z = last if isinstance(last, str) else spy(*last)
    tree = {"a": spy(4, 3), "b": [spy(4), spy(4, 2)], "z_last": z}
    layout = tg.by_path({"z_last": rule})
    Spy.calls.clear()
    with pytest.raises(error):
        tg.scatter(tree, ["cpu"] * 3, layout)
    assert Spy.calls == []
    # The same tree without the mistake does split (so the spy does see the work).
    tg.scatter({"a": spy(4, 3), "b": [spy(4), spy(4, 2)]}, ["cpu"] * 3)
    assert any("split" in c for c in Spy.calls)


def test_scatter_fails_before_calling_tensor_split_or_to(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("tensor_split", "split", "to", "chunk", "narrow"):
        original = getattr(torch.Tensor, name)

        def counting(
            self: torch.Tensor, *a: Any, _name: str = name, _orig: Any = original, **k: Any
        ) -> Any:
            calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counting)
    tree = {"a": torch.zeros(6, 2), "b": torch.zeros(6), "z": torch.zeros(7)}
    with pytest.raises(tg.BatchSizeError):
        tg.scatter(tree, ["cpu"] * 3)
    assert calls == []
    tg.scatter({"a": torch.zeros(6, 2)}, ["cpu"] * 3)
    assert calls  # the patch is seen by scatter


def test_gather_structure_error_comes_before_any_cat(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_cat, real_stack = torch.cat, torch.stack
    monkeypatch.setattr(torch, "cat", lambda *a, **k: calls.append("cat") or real_cat(*a, **k))
    monkeypatch.setattr(
        torch, "stack", lambda *a, **k: calls.append("stack") or real_stack(*a, **k)
    )
    outs = [{"a": torch.ones(2), "z": torch.ones(1)}, {"a": torch.ones(2), "z": None}]
    with pytest.raises(tg.StructureMismatchError):
        tg.gather(outs, "cpu")
    assert calls == []


def test_gather_rule_error_in_the_last_leaf_comes_before_any_copy_to_the_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "Errors happen before anything is copied": when replicas live off the target device, a
    # mistake in the last leaf must not leave the earlier leaves copied over first. (On one
    # device the combine pass finds shape problems itself; then nothing is returned and no
    # custom rule runs, see the next test.) The meta device stands in for another device here
    # (as the target: a meta tensor gathered onto the CPU is an error of its own).
    moves: list[str] = []
    real_to = torch.Tensor.to

    def counting_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        moves.append("to")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    outs = [
        {"a": torch.ones(2, 3), "z": torch.ones(1, 2)},
        {"a": torch.ones(2, 3), "z": torch.ones(1, 5)},
    ]
    with pytest.raises(tg.ShapeMismatchError, match=r"outputs\['z'\]"):
        tg.gather(outs, "meta")
    assert moves == []


def test_gather_rule_error_on_one_device_lists_every_problem_and_returns_nothing() -> None:
    outs = [
        {"a": torch.ones(2, 3), "b": torch.ones(1, 4), "z": torch.ones(1, 2)},
        {"a": torch.ones(2, 3), "b": torch.ones(1, 3), "z": torch.ones(1, 5)},
    ]
    with pytest.raises(tg.ShapeMismatchError) as info:
        tg.gather(outs, "cpu")
    assert "outputs['b']" in str(info.value) and "outputs['z']" in str(info.value)
    assert "2 problems" in str(info.value)


def test_gather_rule_error_comes_before_a_custom_rule_runs() -> None:
    # A custom rule may have side effects (logging, metrics): it must not run for a gather that
    # then fails on another leaf.
    calls: list[list[Any]] = []

    def custom(values: list[Any], device: torch.device) -> Any:
        calls.append(values)
        return values

    outs = [
        {"m": 1, "z": torch.ones(1, 2)},
        {"m": 2, "z": torch.ones(1, 5)},
    ]
    with pytest.raises(tg.ShapeMismatchError, match=r"outputs\['z'\]"):
        tg.gather(outs, "cpu", tg.by_path({"m": custom}))
    assert calls == []


@pytest.mark.parametrize(
    ("rule", "ndim"),
    [(tg.pad(dim=2), 2), (tg.pad(dim=-3), 2), (tg.stack(dim=3), 1), (tg.stack(dim=-3), 1)],
    ids=["pad2", "pad-3", "stack3", "stack-3"],
)
def test_a_dim_out_of_range_is_an_error_not_a_wrap_around(rule: Any, ndim: int) -> None:
    # pad(dim=2) on 2-dim tensors must not quietly concatenate along dim 0 (2 % 2).
    shape = (2, 3) if ndim == 2 else (3,)
    outs = [{"t": torch.ones(shape)}, {"t": torch.ones(shape)}]
    with pytest.raises(tg.ShapeMismatchError) as info:
        tg.gather(outs, "cpu", tg.by_path({"t": rule}))
    assert f"outputs['t']: {rule.describe()} is out of range" in str(info.value)


# --------------------------------------------- no silent wrong results, errors that lead to a fix


@pytest.mark.parametrize(
    "layout", [None, tg.cat(), tg.stack(), tg.mean(), tg.sum(), tg.pad()], ids=repr
)
def test_mixed_dtypes_across_replicas_are_an_error_not_a_promotion(layout: Any) -> None:
    outs = [{"id": torch.tensor([123456789])}, {"id": torch.tensor([0.5])}]
    for _ in range(5):  # cold, then through the compiled layer
        with pytest.raises(tg.ShapeMismatchError) as info:
            tg.gather(outs, "cpu", layout)
        text = str(info.value)
        assert "outputs['id']" in text and "torch.int64" in text and "torch.float32" in text
        assert "one dtype" in text


def test_bool_and_float_replicas_do_not_mix() -> None:
    with pytest.raises(tg.ShapeMismatchError, match=r"replica 0: torch.bool, replica 1"):
        tg.gather([torch.tensor([True]), torch.tensor([0.5])], "cpu")


@pytest.mark.parametrize(
    ("dtype", "fill"),
    [(torch.bool, -1), (torch.uint8, -1), (torch.int64, -1.5), (torch.int64, float("nan"))],
)
def test_pad_fill_the_dtype_cannot_hold_is_an_error_naming_path_dtype_and_fill(
    dtype: torch.dtype, fill: float
) -> None:
    outs = [{"m": torch.ones(1, 2, dtype=dtype)}, {"m": torch.ones(1, 3, dtype=dtype)}]
    with pytest.raises(tg.LeafTypeError) as info:
        tg.gather(outs, "cpu", tg.pad(fill=fill))
    text = str(info.value)
    assert "outputs['m']" in text and str(dtype) in text and repr(fill) in text


# Every dtype a tensor can be padded in, and fills at and beyond their edges.
PAD_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    *(getattr(torch, f"float8_{kind}") for kind in ("e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz")),
    torch.float8_e8m0fnu,
]
NAN, INF = float("nan"), float("inf")
EDGE_FILLS = [
    *(0, 1, -1, 127, 128, 255, 256, -129, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**400),
    *(0.5, -0.5, 1.0, -1.0, 65504.0, 65520.0, 70000.0, 448.0, 449.0, 1e39, -1e39, 3.0e38),
    *(1e-50, 1e308, NAN, INF, -INF, True, False),
    *(1j, 1 + 0j, complex(1e39, 0), complex(0, 70000), complex(NAN, 0), complex(0.5, -2)),
]


def _stored(fill: Any, dtype: torch.dtype) -> Any:
    t = torch.zeros(2, dtype=dtype).new_full((2,), fill)
    return (t.to(torch.complex64) if dtype == torch.complex32 else t)[0].item()


def _is_the_fill(stored: Any, fill: Any) -> bool:
    """``stored`` is ``fill`` as a dtype keeps it: whole numbers exactly, a float rounded (never
    to another sign, to 0 from a nonzero value, or to an infinity), NaN as NaN."""
    if isinstance(stored, complex) or isinstance(fill, complex):
        s, f = complex(stored), complex(fill)
        return _is_the_fill(s.real, f.real) and _is_the_fill(s.imag, f.imag)
    if isinstance(stored, (bool, int)):
        return stored == fill
    if fill != fill:
        return stored != stored
    if math.isinf(fill) or math.isinf(stored):
        return stored == fill
    if fill == 0:
        return bool(stored == 0)
    if stored == 0:
        return abs(fill) < 1e-30  # (a tiny fill underflowing to 0 is rounding)
    return (stored > 0) == (fill > 0) and 0.5 <= stored / fill <= 2  # (float8: powers of 2)


COMPLEX_HALF = "ignore:ComplexHalf support is experimental:UserWarning"


@pytest.mark.filterwarnings(COMPLEX_HALF)
@pytest.mark.parametrize("dtype", PAD_DTYPES, ids=str)
def test_fill_fits_says_what_torch_stores_as_the_fill(dtype: torch.dtype) -> None:
    """``pad``'s check of its fill (:func:`fill_fits`) against torch, for every dtype and fills
    at and beyond the edges: a fill it accepts is stored as itself; one it refuses would be
    refused by torch, wrapped, cut, overflowed (complex32 overflows to inf silently) or stored
    as another number; a complex fill fits no real dtype, even with no imaginary part."""
    for fill in EDGE_FILLS:
        fits = fill_fits(fill, dtype)
        if isinstance(fill, complex) and not dtype.is_complex:
            assert not fits, fill
            continue
        try:
            stored = _stored(fill_value(fill, dtype) if fits else fill, dtype)
        except (RuntimeError, OverflowError):
            stored = torch_refused = object()
        else:
            torch_refused = None
        if fits:
            assert torch_refused is None and _is_the_fill(stored, fill), (fill, stored)
        else:
            assert torch_refused is not None or not _is_the_fill(stored, fill), (fill, stored)


def _fill_error(text: str, path: str, dtype: torch.dtype, fill: Any) -> None:
    assert path in text and str(dtype) in text and safe_repr(fill) in text, text


@pytest.mark.filterwarnings(COMPLEX_HALF)
@pytest.mark.parametrize(("dtype", "fill"), FILLS_THAT_DO_NOT_FIT, ids=str)
def test_a_fill_the_dtype_cannot_hold_is_a_leaf_type_error_in_gather_and_data_parallel(
    dtype: torch.dtype, fill: Any
) -> None:
    """Not torch's bare overflow error: a ``LeafTypeError`` naming the path, the dtype and the
    fill, cold and through the compiled layer, in ``tg.gather`` and ``data_parallel``, and
    ``explain`` says it too."""
    outs = [{"m": torch.ones(1, 2).to(dtype)}, {"m": torch.ones(1, 3).to(dtype)}]
    for _ in range(3):
        with pytest.raises(tg.LeafTypeError) as info:
            tg.gather(outs, "cpu", {"m": tg.pad(fill=fill)})
        _fill_error(str(info.value), "outputs['m']", dtype, fill)

    def widths(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": torch.ones(len(x), 1 + int(x[0])).to(dtype)}

    with pytest.raises(tg.LeafTypeError) as info:
        tg.data_parallel(widths, torch.arange(2.0), ["cpu"] * 2, out_layout={"h": tg.pad(1, fill)})
    _fill_error(str(info.value), "outputs['h']", dtype, fill)
    explained = str(tg.explain(outs[0], {"m": tg.pad(fill=fill)}, way="gather"))
    assert "cannot be stored" in explained, explained


def test_pad_fill_the_dtype_holds_still_pads() -> None:
    outs = [torch.ones(1, 2, dtype=torch.uint8), torch.ones(1, 3, dtype=torch.uint8)]
    out = tg.gather(outs, "cpu", tg.pad(fill=255))
    assert out.dtype == torch.uint8 and out[0, 2].item() == 255


def test_unknown_containers_holding_tensors_are_not_sent_whole() -> None:
    import collections

    class Pair(tuple):  # a tuple subclass optree does not know: a leaf
        pass

    for value in (collections.UserDict(ids=torch.zeros(8, 2)), Pair((torch.zeros(8),))):
        with pytest.raises(tg.LeafTypeError, match=r"inputs\['enc'\].*register_node"):
            tg.scatter({"x": torch.zeros(8, 1), "enc": value}, CPU2)
    # Containers of plain values are still broadcast, and broadcast() is the way out.
    shards = tg.scatter({"x": torch.zeros(8, 1), "cfg": collections.UserDict(lr=0.1)}, CPU2)
    assert shards[1]["cfg"]["lr"] == 0.1
    tree = {"x": torch.zeros(8, 1), "enc": collections.UserDict(ids=torch.zeros(8, 2))}
    assert tg.scatter(tree, CPU2, tg.by_path({"enc": tg.broadcast()}))[0]["enc"] is tree["enc"]


def test_numpy_arrays_next_to_split_data_are_refused() -> None:
    np = pytest.importorskip("numpy")
    with pytest.raises(tg.LeafTypeError, match=r"inputs\['ids'\].*torch.as_tensor"):
        tg.scatter({"x": torch.zeros(4, 1), "ids": np.arange(4)}, CPU2)
    # Alone (nothing split) an array is broadcast like any value.
    assert tg.scatter({"ids": np.arange(4)}, CPU2)[1]["ids"].tolist() == [0, 1, 2, 3]


def test_cat_items_checks_each_list_against_its_shard_size() -> None:
    outs = [{"ids": list(range(9))}, {"ids": list(range(9))}]  # a broadcast list, never split
    with pytest.raises(tg.BatchSizeError) as info:
        tg.gather(outs, "cpu", {"ids": tg.cat_items()}, sizes=[5, 4])
    assert "outputs['ids']" in str(info.value) and "split_items()" in str(info.value)
    ok = tg.gather([{"ids": [1, 2]}, {"ids": [3]}], "cpu", {"ids": tg.cat_items()}, sizes=[2, 1])
    assert ok == {"ids": [1, 2, 3]}


def test_data_parallel_catches_a_per_sample_list_that_was_never_split() -> None:
    def fn(x: torch.Tensor, ids: list[int]) -> dict[str, Any]:
        return {"y": x, "ids": ids}

    with pytest.raises(tg.BatchSizeError, match="split_items"):
        tg.data_parallel(
            fn,
            (torch.zeros(9, 1), list(range(9))),
            ["cpu"] * 2,
            out_layout=tg.by_path({"ids": "cat_items"}),
        )


@pytest.mark.parametrize(
    ("sizes", "error"),
    [([-1, 3], ValueError), ([1.9, 1], TypeError), ([True, 1], TypeError), ("ab", TypeError)],
)
def test_gather_sizes_are_non_negative_ints(sizes: Any, error: type) -> None:
    with pytest.raises(error, match="sizes"):
        tg.gather([torch.tensor(1.0), torch.tensor(3.0)], "cpu", tg.mean(), sizes=sizes)


def test_mean_weighted_by_sizes_adding_up_to_zero_is_an_error() -> None:
    with pytest.raises(tg.ShapeMismatchError, match=r"outputs: mean\(\).*add up to 0"):
        tg.gather([torch.tensor(1.0), torch.tensor(3.0)], "cpu", tg.mean(), sizes=[0, 0])


@pytest.mark.parametrize("layout", [None, tg.cat(), tg.stack()], ids=repr)
def test_an_unregistered_dataclass_output_says_register_dataclass(layout: Any) -> None:
    import dataclasses

    @dataclasses.dataclass
    class Out:
        loss: torch.Tensor

    with pytest.raises(tg.LeafTypeError) as info:
        tg.gather([Out(torch.ones(1)), Out(torch.ones(1))], "cpu", layout)
    assert "register_dataclass" in str(info.value) and "Out" in str(info.value)


def test_a_custom_rule_that_raises_keeps_its_type_and_names_path_and_rule() -> None:
    outs = [{"n": torch.tensor(1.0)}, {"n": torch.tensor(2.0)}]
    with pytest.raises(TypeError) as info:
        tg.gather(outs, "cpu", {"n": max})
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "outputs['n']" in notes and "'max'" in notes and "f(values, device)" in notes


@pytest.mark.parametrize("kind", ["sparse", "nested", "meta"])
def test_tensors_scatter_cannot_split_or_place_get_typed_errors(kind: Any) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype API
        x = {
            "sparse": lambda: torch.randn(4, 3).to_sparse(),
            "nested": lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]),
            "meta": lambda: torch.empty(4, 3, device="meta"),
        }[kind]()
    for _ in range(5):  # cold and through the compiled layer: never meta "shards"
        with pytest.raises(tg.LeafTypeError, match=r"inputs\['x'\]"):
            tg.scatter({"x": x, "y": torch.zeros(4)}, CPU2)


def _meta(*shape: int) -> torch.Tensor:
    return torch.ones(shape, device="meta")


# name -> (per-replica outputs, layout, dim, the path the error names)
META_GATHERS: dict[str, tuple[Any, Any, int, str]] = {
    "later_leaf": ([{"a": torch.ones(2), "b": _meta(2)}] * 2, None, 0, "outputs['b']"),
    "first_leaf": ([{"a": _meta(2), "b": torch.ones(2)}] * 2, None, 0, "outputs['a']"),
    "one_replica": (
        [{"a": torch.ones(2), "b": torch.ones(2)}, {"a": torch.ones(2), "b": _meta(2)}],
        None,
        0,
        "outputs['b']",
    ),
    "dim_1": ([{"a": torch.ones(2, 2), "b": _meta(2, 3)}] * 2, None, 1, "outputs['b']"),
    "zero_dim": ([{"n": torch.tensor(1.0), "m": _meta()}] * 2, None, 0, "outputs['m']"),
    "beside_a_string": ([{"a": torch.ones(1), "b": _meta(1), "s": "x"}] * 2, None, 0, "['b']"),
    "cat_rule": (
        [{"a": torch.ones(1), "b": _meta(1, 2)}] * 2,
        {"a": 0, "b": tg.cat(1)},
        0,
        "['b']",
    ),
    "mean": (
        [{"loss": _meta(), "s": "x"}] * 2,
        {"loss": tg.mean(), "s": tg.first()},
        0,
        "['loss']",
    ),
    "stack": ([{"h": torch.ones(1), "x": _meta(2)}] * 2, {"h": 0, "x": tg.stack()}, 0, "['x']"),
    "pad": ([{"h": torch.ones(1), "x": _meta(2)}] * 2, {"h": 0, "x": tg.pad()}, 0, "['x']"),
    "first_subtree": (
        [{"m": {"w": _meta(2), "k": 1}, "x": torch.ones(1)}] * 2,
        {"m": tg.first(), "x": 0},
        0,
        "outputs['m']['w'] (replica 0)",
    ),
    "cat_items": (
        [{"ids": [torch.ones(1)], "x": torch.ones(1)}, {"ids": [_meta(1)], "x": torch.ones(1)}],
        {"ids": tg.cat_items(), "x": 0},
        0,
        "outputs['ids'][0] (replica 1)",
    ),
}


@pytest.mark.parametrize("name", list(META_GATHERS))
def test_meta_tensors_gathered_onto_the_cpu_are_typed_errors(name: str) -> None:
    """A meta tensor has no data to gather: a LeafTypeError naming its path wherever it sits
    (gather sampled the first tensor position only: a later one came back on ``meta``, and at
    the first one torch's raw NotImplementedError came out), cold, through the compiled layer
    and on the reference path alike."""
    from treegather._caches import reference_only

    outs, layout, dim, path = META_GATHERS[name]
    messages = set()
    for attempt in range(5):
        ctx = reference_only() if attempt == 4 else contextlib.nullcontext()
        with ctx, pytest.raises(tg.LeafTypeError) as info:
            tg.gather(outs, "cpu", layout, dim=dim)
        message = str(info.value)
        assert path in message and "a meta tensor holds no data to gather onto cpu" in message
        assert "materialise it first" in message
        messages.add(message)
    assert len(messages) == 1, messages  # the same error, cold, compiled and reference


def test_meta_tensors_stay_meta_where_nothing_moves_them() -> None:
    """as_list() leaves values untouched, and the meta device is a target like any other."""
    outs = [{"a": _meta(2), "b": _meta(1, 3)}] * 2
    for _ in range(4):
        kept = tg.gather(outs, "cpu", {"a": tg.as_list(), "b": tg.as_list()})
        assert kept["a"][0] is outs[0]["a"] and kept["b"][1] is outs[1]["b"]
        on_meta = tg.gather(outs, "meta")
        assert on_meta["a"].is_meta and on_meta["a"].shape == (4,)
        assert on_meta["b"].is_meta and on_meta["b"].shape == (2, 3)
        moved = tg.gather([{"a": torch.ones(2)}] * 2, "meta")
        assert moved["a"].is_meta and moved["a"].shape == (4,)


def test_split_sizes_naming_fewer_shards_than_devices_use_fewer_devices() -> None:
    # Documented in split(): explicit sizes name the shards; the remaining devices get none.
    shards = tg.scatter(torch.arange(6), ["cpu"] * 3, tg.split(sizes=(2, 4)))
    assert shards.sizes == (2, 4) and len(shards) == 2


@pytest.mark.parametrize("dim", [True, 1.0, "0"])
def test_bad_dims_are_typed_errors(dim: Any) -> None:
    with pytest.raises(tg.ArgumentTypeError, match="dim"):
        tg.scatter(torch.zeros(2, 2), CPU2, dim=dim)
    with pytest.raises(tg.ArgumentTypeError, match="dim"):
        tg.gather([torch.zeros(2, 2)] * 2, "cpu", dim=dim)


# ------------------------------------------------ values whose repr raises or is huge


class ReprRaises:
    """A leaf or static field whose repr fails (a lazy proxy, a closed handle)."""

    def __repr__(self) -> str:
        raise RuntimeError("repr not available")


class KeyReprRaises:
    """A dict key whose repr fails (and so does its str)."""

    def __repr__(self) -> str:
        raise RuntimeError("key repr not available")

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeyReprRaises)


class HugeRepr:
    """A value whose repr is 10 million characters long."""

    def __repr__(self) -> str:
        return "H" * 10_000_000


@tg.register_dataclass(static=["meta"])
@dataclasses.dataclass
class WithMeta:
    x: Any
    meta: Any


KEY = KeyReprRaises()
SHOWN_KEY = f"<KeyReprRaises object at {id(KEY):#x}>"
ODD_CASES: dict[str, tuple[Any, type[Exception], str]] = {
    "scatter: batch sizes differ under the key": (
        lambda: tg.scatter({KEY: torch.zeros(4), "b": torch.zeros(3)}, CPU2),
        tg.BatchSizeError,
        f"4 at inputs[{SHOWN_KEY}]",
    ),
    "scatter: split() on the leaf": (
        lambda: tg.scatter({"o": ReprRaises(), "b": torch.zeros(4)}, CPU2, tg.by_path({"o": 0})),
        tg.LeafTypeError,
        "inputs['o']: split() needs a tensor, got ReprRaises <ReprRaises object at 0x",
    ),
    "scatter: a prefix layout lacks the key": (
        lambda: tg.scatter({KEY: torch.zeros(4), "a": torch.zeros(4)}, CPU2, {"a": 0}),
        tg.LayoutError,
        f"inputs: the layout lacks key(s) {SHOWN_KEY}",
    ),
    "scatter: the layout value": (
        lambda: tg.scatter({"a": torch.zeros(4)}, CPU2, {"a": ReprRaises()}),
        tg.LayoutError,
        "layout at inputs['a']: <ReprRaises object at 0x",
    ),
    "gather: a replica lacks the key": (
        lambda: tg.gather(
            [{KEY: torch.zeros(2), "a": torch.zeros(2)}, {"a": torch.zeros(2)}], "cpu"
        ),
        tg.StructureMismatchError,
        f"outputs: replica 1 lacks key(s) {SHOWN_KEY}",
    ),
    "gather: static fields differ": (
        lambda: tg.gather(
            [WithMeta(torch.zeros(2), ReprRaises())] * 1 + [WithMeta(torch.zeros(2), ReprRaises())],
            "cpu",
        ),
        tg.StructureMismatchError,
        "outputs: replica 1's static fields/metadata (<ReprRaises object at 0x",
    ),
    "gather: shapes differ under the key": (
        lambda: tg.gather([{KEY: torch.zeros(2, 3)}, {KEY: torch.zeros(2, 4)}], "cpu"),
        tg.ShapeMismatchError,
        f"outputs[{SHOWN_KEY}]: cat(dim=0) needs equal sizes",
    ),
    "gather: sizes": (
        lambda: tg.gather([torch.zeros(1)], "cpu", sizes=[ReprRaises()]),
        tg.ArgumentTypeError,
        "sizes[0] must be an int (the rows replica 0 got), got ReprRaises <ReprRaises object at",
    ),
    "scatter: a device": (
        lambda: tg.scatter(torch.zeros(4), [ReprRaises()]),
        tg.ArgumentTypeError,
        "not a device: <ReprRaises object at 0x",
    ),
}


@pytest.mark.parametrize("name", sorted(ODD_CASES))
def test_a_value_whose_repr_raises_leaves_the_error_typed(name: str) -> None:
    """A leaf, dict key, static field or argument whose repr raises is written
    ``<Foo object at 0x...>`` in the message: the error is the one about the user's problem,
    naming the path. Before, the repr's own RuntimeError replaced it."""
    call, error, fragment = ODD_CASES[name]
    for _ in range(2):  # cold, and with the structure seen before
        with pytest.raises(error) as info:
            call()
        assert fragment in str(info.value)


def test_explain_works_on_a_valid_tree_whose_reprs_raise_or_are_huge() -> None:
    tree = {KEY: torch.zeros(4), "o": ReprRaises(), "h": HugeRepr()}
    for layout in (None, tg.by_path({"*": "broadcast"}), {KEY: 0, "o": None, "h": None}):
        text = str(tg.explain(tree, layout, devices=CPU2))
        assert f"inputs[{SHOWN_KEY}]" in text and "<ReprRaises object at 0x" in text
        assert len(text) < 2000
    gathered = str(tg.explain(tree, way="gather"))
    assert f"outputs[{SHOWN_KEY}]" in gathered


def test_a_huge_repr_is_cut_in_messages() -> None:
    """A 10-million-character static field makes a message of a few hundred characters."""
    with pytest.raises(tg.StructureMismatchError) as info:
        tg.gather(
            [WithMeta(torch.zeros(2), HugeRepr()), WithMeta(torch.zeros(2), HugeRepr())], "cpu"
        )
    assert "static fields/metadata (HHHH" in str(info.value)
    assert len(str(info.value)) < 1000
