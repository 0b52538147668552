"""gather: defaults, every rule, and torch's gather problems (the issue's "Why" list) one by one."""

from __future__ import annotations

import contextlib
from typing import Any

import optree
import pytest
import torch
from corpus import CASE_IDS, CASES, CausalLMOutput, Point, Sample, assert_tree_equal

import treegather as tg

CPU2 = ["cpu", "cpu"]


# ------------------------------------------------------------------------------ defaults


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_default_gather_cats_tensors_and_lists_everything_else(
    case: Any, devices: list[str]
) -> None:
    shards = tg.scatter(case.tree, devices)
    out = tg.gather(shards, "cpu")
    k = len(shards)
    _, spec = tg._tree.flatten(case.tree)
    orig_leaves = tg._tree.flatten(case.tree)[0]
    out_leaves = spec.flatten_up_to(out)
    for got, orig in zip(out_leaves, orig_leaves):
        if isinstance(orig, torch.Tensor) and orig.dim() > 0:
            assert_tree_equal(got, orig)
        elif isinstance(orig, torch.Tensor):  # 0-dim: broadcast, then the vector of them
            assert_tree_equal(got, orig.expand(k).clone())
        else:
            assert got == [orig] * k


def test_none_stays_none() -> None:
    assert tg.gather([None, None], "cpu") is None
    out = tg.gather([{"a": None, "b": (None,)}] * 3, "cpu")
    assert out == {"a": None, "b": (None,)}


def test_empty_containers_stay_empty() -> None:
    assert tg.gather([{}, {}], "cpu") == {}
    assert tg.gather([(), ()], "cpu") == ()
    assert tg.gather([[], []], "cpu") == []


def test_zero_dim_tensors_become_a_vector() -> None:
    out = tg.gather([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)], "cpu")
    assert out.tolist() == [1.0, 2.0, 3.0]


def test_one_replica() -> None:
    out = tg.gather([{"x": torch.ones(2, 2), "s": "a"}], "cpu")
    assert out["x"].shape == (2, 2) and out["s"] == ["a"]


# ------------------------------------------------------------ torch's gather, item by item


def test_five_rows_on_four_devices_use_four_replicas_and_gather_back() -> None:
    # torch's scatter uses chunk: 5 rows on 4 devices make 3 replicas. (More in test_scatter.)
    x = torch.arange(5.0).reshape(5, 1)
    shards = tg.scatter({"x": x}, ["cpu"] * 4)
    assert len(shards) == 4 and shards.sizes == (2, 1, 1, 1)
    assert torch.equal(tg.gather(shards, "cpu")["x"], x)


def test_uneven_batch_sizes_are_refused_not_truncated() -> None:
    # torch's scatter zips per-input chunks without strict=True and silently drops the rest.
    with pytest.raises(tg.BatchSizeError, match=r"5 at inputs\['a'\]; 4 at inputs\['b'\]"):
        tg.scatter({"a": torch.zeros(5), "b": torch.zeros(4)}, ["cpu"] * 4)


def test_cpu_tensors_gather() -> None:
    # torch.nn.parallel.gather refuses CPU tensors (it is written for CUDA only).
    out = tg.gather([torch.ones(2, 3), torch.zeros(1, 3)], "cpu")
    assert out.device == torch.device("cpu")
    assert out.shape == (3, 3)
    assert tg.gather([torch.ones(1)], -1).device == torch.device("cpu")


def test_strings_stay_strings() -> None:
    # torch's gather turns strings into '<map object at ...>'.
    out = tg.gather([{"name": "a"}, {"name": "b"}], "cpu")
    assert out == {"name": ["a", "b"]}
    assert all(isinstance(s, str) for s in out["name"])
    assert tg.gather(["x", "x"], "cpu", tg.first()) == "x"
    assert "map object" not in repr(tg.gather(["a", "b"], "cpu"))


def test_ints_and_floats_gather() -> None:
    # torch's gather raises on ints and floats.
    assert tg.gather([{"n": 1, "f": 0.5}, {"n": 2, "f": 1.5}], "cpu") == {
        "n": [1, 2],
        "f": [0.5, 1.5],
    }
    assert tg.gather([1, 2], "cpu", tg.sum()) == 3
    assert tg.gather([1, 2], "cpu", tg.mean()) == 1.5
    assert tg.gather([1, 4], "cpu", tg.mean(), sizes=[2, 1]) == 2.0
    assert tg.gather([0.5, 0.5], "cpu", tg.first(check=True)) == 0.5


def test_registered_dataclasses_gather_whole() -> None:
    # torch's gather raises on dataclasses.
    outs = [Sample(image=torch.ones(1, 2), label=torch.tensor(r)) for r in range(3)]
    out = tg.gather(outs, "cpu")
    assert type(out) is Sample
    assert out.image.shape == (3, 2) and out.label.tolist() == [0, 1, 2]
    lm = [CausalLMOutput(loss=torch.tensor(1.0 + r), logits=torch.ones(2, 4)) for r in range(2)]
    out = tg.gather(lm, "cpu", tg.by_path({"loss": "mean"}), sizes=[2, 2])
    assert type(out) is CausalLMOutput and list(out.keys()) == ["loss", "logits"]
    assert out.loss.item() == 1.5 and out["logits"].shape == (4, 4)


def test_none_in_one_replica_and_a_tensor_in_another_is_an_error() -> None:
    # torch lets replica 0 decide: gather([None, t]) silently drops t.
    with pytest.raises(tg.StructureMismatchError) as info:
        tg.gather([[None, torch.ones(1)], [torch.ones(1), torch.ones(1)]], "cpu")
    msg = str(info.value)
    assert "outputs[0]: replica 0 has None, replica 1 has Tensor(shape=(1,)" in msg
    with pytest.raises(tg.StructureMismatchError, match=r"outputs\['aux'\]: replica 0 has Tensor"):
        tg.gather([{"aux": torch.ones(1)}, {"aux": None}], "cpu")
    with pytest.raises(
        tg.StructureMismatchError, match="outputs: replica 0 has None, replica 1 has"
    ):
        tg.gather([None, torch.ones(1)], "cpu")


def test_a_missing_key_and_different_lengths_are_errors() -> None:
    with pytest.raises(tg.StructureMismatchError, match=r"outputs: replica 1 lacks key\(s\) 'b'"):
        tg.gather([{"a": 1, "b": 2}, {"a": 1}], "cpu")
    with pytest.raises(
        tg.StructureMismatchError, match=r"outputs\['h'\]: replica 0 has a list of 1"
    ):
        tg.gather([{"h": [torch.ones(1)]}, {"h": [torch.ones(1), torch.ones(1)]}], "cpu")


@pytest.mark.parametrize(
    ("other", "described"),
    [
        ({"x": 1}, "a dict of 1 item(s)"),
        ([1], "a list of 1 item(s)"),
        ((1,), "a tuple of 1 item(s)"),
    ],
    ids=["dict", "list", "tuple"],
)
def test_a_tensor_in_one_replica_and_a_container_in_another_is_an_error(
    other: Any, described: str
) -> None:
    with pytest.raises(tg.StructureMismatchError) as info:
        tg.gather([{"a": torch.ones(1)}, {"a": other}], "cpu")
    assert str(info.value).startswith(
        "outputs['a']: replica 0 has Tensor(shape=(1,), dtype=torch.float32, device=cpu), "
        f"replica 1 has {described}"
    )


def test_mean_is_weighted_by_shard_sizes() -> None:
    torch.manual_seed(0)
    x = torch.randn(10, 4, dtype=torch.float64)
    shards = tg.scatter(x, ["cpu"] * 3)
    assert shards.sizes == (4, 3, 3)
    means = [s.mean() for s in shards]
    weighted = tg.gather(means, "cpu", tg.mean(), sizes=shards.sizes)
    assert torch.allclose(weighted, x.mean(), rtol=0, atol=1e-12)
    unweighted = tg.gather(means, "cpu", tg.mean())
    assert torch.allclose(unweighted, torch.stack(means).mean())
    assert not torch.allclose(unweighted, x.mean())


@pytest.mark.parametrize("reference", [False, True], ids=["compiled", "reference"])
def test_weighted_mean_accumulates_wide_and_keeps_the_dtype(reference: bool) -> None:
    """A float16 loss of 100.0 over two shards of 4096 rows is 100.0 (loss x rows was computed
    in float16: inf), bfloat16 and float32 alike; the result keeps the input's dtype, and its
    gradients are each replica's share of the rows."""
    from treegather._caches import reference_only

    ctx = reference_only() if reference else contextlib.nullcontext()
    with ctx:
        for _ in range(3):  # cold, then a structure seen before
            for dtype, value in (
                (torch.float16, 100.0),
                (torch.bfloat16, 3.0e38),
                (torch.float32, 1.0e35),
            ):
                losses = [torch.tensor(value, dtype=dtype), torch.tensor(value, dtype=dtype)]
                out = tg.gather(losses, "cpu", tg.mean(), sizes=[4096, 4096])
                assert out.dtype == dtype and torch.isfinite(out), (dtype, out)
                assert out.item() == torch.tensor(value, dtype=dtype).item()
                named = tg.gather([{"loss": v} for v in losses], "cpu", "mean", sizes=[8192, 1])
                assert named["loss"].dtype == dtype and torch.isfinite(named["loss"])
        # Uneven shards: the full-batch mean, to float16's rounding.
        rows = [3000, 5000, 192]
        values = [
            torch.tensor(v, dtype=torch.float16, requires_grad=True) for v in (60.0, 61.5, 99)
        ]
        out = tg.gather(values, "cpu", tg.mean(), sizes=rows)
        exact = sum(v.item() * n for v, n in zip(values, rows)) / sum(rows)
        assert out.dtype == torch.float16
        assert out.item() == torch.tensor(exact, dtype=torch.float16).item()
        out.backward()
        for v, n in zip(values, rows):
            assert v.grad is not None and v.grad.dtype == torch.float16
            assert v.grad.item() == torch.tensor(n / sum(rows), dtype=torch.float16).item()


def test_weighted_mean_of_losses_is_the_definition_bit_for_bit() -> None:
    """The fast weighted mean of one loss per replica (0-dim float32/float64, no share of 0:
    each times its share, added in order) gives the definition's value and gradients bit for
    bit: 400 seeded cases of 1-8 replicas (from 5 on, the definition itself),
    magnitudes from 1e-30 to float32's largest."""
    import random

    from treegather._caches import reference_only

    rng = random.Random(0)
    for case in range(400):
        k = rng.randint(1, 8)
        dtype = rng.choice((torch.float32, torch.float64))
        top = torch.finfo(torch.float32).max
        big = case % 10 == 0  # (near the largest float32: where a wider sum would differ)
        raw = [
            top * rng.uniform(0.5, 1.0) if big else rng.gauss(0, 1) * 10 ** rng.uniform(-30, 30)
            for _ in range(k)
        ]
        sizes = [rng.randint(1, 4096) for _ in range(k)]
        got = []
        for ctx in (contextlib.nullcontext(), reference_only()):
            values = [torch.tensor(v, dtype=dtype, requires_grad=True) for v in raw]
            with ctx:
                out = tg.gather(values, "cpu", tg.mean(), sizes=sizes)
            out.backward()
            got.append((out.detach(), [v.grad for v in values], out.grad_fn.name()))
        (fast, fast_grads, fast_fn), (ref, ref_grads, ref_fn) = got
        assert (fast_fn, ref_fn) == (  # (which path each took)
            {1: "MulBackward0", 2: "AddBackward0", 3: "AddBackward0", 4: "AddBackward0"}.get(
                k, "SumBackward1"
            ),
            "SumBackward1",
        ), (k, fast_fn, ref_fn)
        assert fast.dtype == ref.dtype == dtype
        assert torch.equal(fast, ref) or (fast.isnan() and ref.isnan()), (case, fast, ref)
        for a, b in zip(fast_grads, ref_grads):
            assert a is not None and b is not None and torch.equal(a, b), (case, a, b)


def test_weighted_mean_in_data_parallel_does_not_overflow_in_float16() -> None:
    """``out_layout={"loss": tg.mean()}`` on a float16 loss over two shards of 4096 rows gives
    what one device gives."""
    x = torch.full((8192, 2), 100.0, dtype=torch.float16)

    def loss(batch: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": batch.mean()}

    one = tg.data_parallel(loss, x, ["cpu"], out_layout={"loss": tg.mean()})
    two = tg.data_parallel(loss, x, ["cpu"] * 2, out_layout={"loss": tg.mean()})
    assert one["loss"].item() == two["loss"].item() == 100.0
    assert two["loss"].dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_a_replica_of_zero_rows_takes_no_part_in_the_mean(dtype: torch.dtype) -> None:
    """The loss of a shard with no rows is torch's mean of an empty batch (NaN); weighted by 0
    it takes no part in the mean, and gets a zero gradient, not a NaN one."""
    p = torch.tensor([2.0], dtype=dtype, requires_grad=True)
    full = (p * torch.ones(3, dtype=dtype)).mean()
    empty = (p * torch.ones(0, dtype=dtype)).mean()
    assert torch.isnan(empty)
    other = (3 * p * torch.ones(5, dtype=dtype)).mean()
    out = tg.gather([full, empty, other], "cpu", tg.mean(), sizes=[3, 0, 5])
    assert out.dtype == dtype
    torch.testing.assert_close(out, ((2.0 * 3 + 6.0 * 5) / 8 * torch.ones((), dtype=dtype)))
    out.backward()
    assert p.grad is not None and torch.isfinite(p.grad).all()
    torch.testing.assert_close(p.grad, torch.tensor([(3 + 3 * 5) / 8], dtype=dtype))
    # Leaf tensors, a tree, and elementwise over a vector of per-replica means.
    kept = tg.gather(
        [{"m": torch.tensor([1.0, 2.0])}, {"m": torch.full((2,), float("nan"))}],
        "cpu",
        {"m": tg.mean()},
        sizes=[7, 0],
    )
    assert kept["m"].tolist() == [1.0, 2.0]
    # Python numbers too.
    assert tg.gather([1.5, float("nan"), 3.0], "cpu", tg.mean(), sizes=[1, 0, 1]) == 2.25
    assert tg.gather([4, 7], "cpu", tg.mean(), sizes=[2, 0]) == 4.0


def test_mean_of_integer_tensors_is_floating_point() -> None:
    out = tg.gather([torch.tensor(1), torch.tensor(2)], "cpu", tg.mean())
    assert out.dtype == torch.get_default_dtype() and out.item() == 1.5
    assert tg.gather([torch.tensor(1), torch.tensor(2)], "cpu", tg.sum()).dtype == torch.int64


def test_gradients_flow_back_to_every_replica() -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 3, requires_grad=True)
    w = torch.randn(3, 2, requires_grad=True)
    shards = tg.scatter({"x": x, "w": w}, ["cpu"] * 3, tg.by_path({"w": "broadcast"}))
    replica_out = []
    for s in shards:
        y = s["x"] @ s["w"]
        y.retain_grad()
        replica_out.append({"y": y, "loss": (y**2).mean()})
    out = tg.gather(replica_out, "cpu", tg.by_path({"loss": "mean"}), sizes=shards.sizes)
    (out["y"].sum() + out["loss"]).backward()
    assert all(r["y"].grad is not None for r in replica_out)
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    y = x @ w
    (y.sum() + (y**2).mean()).backward()
    assert torch.allclose(gx, x.grad, atol=1e-6)
    assert torch.allclose(gw, w.grad, atol=1e-6)


@pytest.mark.parametrize(
    "rule", [tg.cat(), tg.stack(), tg.sum(), tg.mean(), tg.pad(), tg.first(), tg.pad(lengths=True)]
)
def test_every_tensor_rule_is_differentiable(rule: Any) -> None:
    xs = [torch.randn(2, 3, requires_grad=True) for _ in range(3)]
    out = tg.gather(xs, "cpu", rule)
    (out.data if isinstance(out, tg.Padded) else out).sum().backward()
    if isinstance(rule, tg.first().__class__):
        assert xs[0].grad is not None
    else:
        assert all(x.grad is not None for x in xs)


def test_batch_smaller_than_the_device_count_round_trips() -> None:
    x = torch.arange(3.0).reshape(3, 1)
    shards = tg.scatter({"x": x}, ["cpu"] * 8)
    assert len(shards) == 3
    out = tg.gather([{"y": s["x"] * 2} for s in shards], "cpu")
    assert out["y"].tolist() == [[0.0], [2.0], [4.0]]


def test_scatter_kwargs_then_gather() -> None:
    args = ({"ids": torch.arange(6)},)
    kwargs = {"labels": torch.arange(6) * 10, "tag": "t"}
    a, kw = tg.scatter_kwargs(args, kwargs, ["cpu"] * 4, tg.by_path({"0.ids": 0, "labels": 0}))
    outs = [{"s": x[0]["ids"] + k["labels"], "tag": k["tag"]} for x, k in zip(a, kw)]
    out = tg.gather(outs, -1, tg.by_path({"tag": "first"}), sizes=a.sizes)
    assert list(out) == ["s", "tag"] and out["tag"] == "t"
    assert out["s"].tolist() == [11 * i for i in range(6)]


# ------------------------------------------------------------------------------- the rules


def test_cat_along_another_dim() -> None:
    out = tg.gather([torch.ones(2, 1), torch.zeros(2, 2)], "cpu", tg.cat(1))
    assert out.tolist() == [[1, 0, 0], [1, 0, 0]]
    assert tg.gather([torch.ones(2, 1), torch.zeros(2, 2)], "cpu", dim=1).shape == (2, 3)
    assert tg.gather([torch.ones(2, 1), torch.zeros(2, 2)], "cpu", dim=-1).shape == (2, 3)


def test_stack() -> None:
    out = tg.gather([torch.ones(2), torch.zeros(2)], "cpu", tg.stack(1))
    assert out.tolist() == [[1, 0], [1, 0]]


def test_sum_and_mean_of_tensors() -> None:
    xs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])]
    assert tg.gather(xs, "cpu", tg.sum()).tolist() == [4.0, 8.0]
    assert tg.gather(xs, "cpu", tg.mean()).tolist() == [2.0, 4.0]
    assert tg.gather(xs, "cpu", tg.mean(), sizes=[3, 1]).tolist() == [1.5, 3.0]


def test_pad_pads_other_dims_to_the_largest_replica() -> None:
    xs = [torch.ones(1, 2), torch.ones(2, 3) * 2]
    out = tg.gather(xs, "cpu", tg.pad(fill=-1))
    assert out.tolist() == [[1, 1, -1], [2, 2, 2], [2, 2, 2]]
    padded = tg.gather(xs, "cpu", tg.pad(lengths=True))
    assert isinstance(padded, tg.Padded)
    assert padded.data.shape == (3, 3)
    assert padded.lengths.dtype == torch.long
    assert padded.lengths.tolist() == [[1, 2], [2, 3]]
    out = tg.gather([torch.ones(2, 1), torch.ones(1, 2)], "cpu", tg.pad(dim=1))
    assert out.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_as_list_keeps_per_replica_values() -> None:
    xs = [torch.ones(1), torch.zeros(2)]
    out = tg.gather(xs, "cpu", tg.as_list())
    assert isinstance(out, list) and out[0] is xs[0] and out[1] is xs[1]


def test_first_and_first_check() -> None:
    xs = [torch.ones(2), torch.ones(2)]
    assert torch.equal(tg.gather(xs, "cpu", tg.first(check=True)), torch.ones(2))
    assert torch.equal(tg.gather([torch.ones(2), torch.zeros(2)], "cpu", tg.first()), torch.ones(2))
    with pytest.raises(tg.ShapeMismatchError, match="first\\(check=True\\): replica 1 differs"):
        tg.gather([torch.ones(2), torch.zeros(2)], "cpu", tg.first(check=True))
    with pytest.raises(tg.ShapeMismatchError, match="replica 2 differs"):
        tg.gather([{"a": 1}, {"a": 1}, {"a": 2}], "cpu", tg.by_path({"a": tg.first(check=True)}))


class _Elementwise:
    """An array-like without numpy: ``==`` is elementwise, and its truth value is ambiguous."""

    def __init__(self, values: list[int]) -> None:
        self.values = values
        self.shape = (len(values),)
        self.ndim = 1

    def __eq__(self, other: object) -> Any:
        assert isinstance(other, _Elementwise)
        return _Elementwise([int(a == b) for a, b in zip(self.values, other.values)])

    def __bool__(self) -> bool:
        raise ValueError("The truth value of an array with more than one element is ambiguous")

    def all(self) -> bool:
        return all(self.values)


def test_first_check_compares_arrays_as_arrays() -> None:
    """first(check=True) on array leaves (numpy, or any array-like whose ``==`` is elementwise):
    equal arrays pass, different values or shapes are the ShapeMismatchError, never numpy's
    "truth value of an array is ambiguous"."""
    check = tg.first(check=True)
    same = [{"a": _Elementwise([1, 2])}, {"a": _Elementwise([1, 2])}]
    assert tg.gather(same, "cpu", check)["a"] is same[0]["a"]
    with pytest.raises(tg.ShapeMismatchError, match="replica 1 differs from replica 0"):
        tg.gather([{"a": _Elementwise([1, 2])}, {"a": _Elementwise([1, 3])}], "cpu", check)
    np = pytest.importorskip("numpy")
    arrays = [{"a": np.arange(3.0), "b": np.ones((2, 2))} for _ in range(3)]
    out = tg.gather(arrays, "cpu", check)
    assert out["a"] is arrays[0]["a"] and out["b"] is arrays[0]["b"]
    assert tg.gather([np.array(3), np.array(3)], "cpu", check) == 3  # 0-dim arrays
    for other in (np.zeros(3), np.arange(4.0), np.arange(3.0)[None]):  # values, shapes
        with pytest.raises(tg.ShapeMismatchError, match="replica 2 differs from replica 0"):
            tg.gather([arrays[0], arrays[1], {"a": other, "b": np.ones((2, 2))}], "cpu", check)
    with pytest.raises(tg.ShapeMismatchError, match=r"replica 1 differs"):
        tg.gather([{"a": np.arange(2)}, {"a": [0, 1]}], "cpu", tg.by_path({"a": check}))


def test_cat_items_is_the_inverse_of_split_items() -> None:
    assert tg.gather([["a", "b"], ["c"]], "cpu", tg.cat_items()) == ["a", "b", "c"]
    assert tg.gather([("a",), ("b", "c")], "cpu", tg.cat_items()) == ("a", "b", "c")
    tree = {"x": torch.arange(5), "words": list("abcde")}
    shards = tg.scatter(tree, ["cpu"] * 3, tg.by_path({"words": "split_items"}))
    out = tg.gather(shards, "cpu", tg.by_path({"words": "cat_items"}))
    assert out["words"] == list("abcde") and out["x"].tolist() == list(range(5))


def test_cat_items_needs_sequences() -> None:
    with pytest.raises(tg.LeafTypeError, match="cat_items\\(\\) needs a list or tuple"):
        tg.gather(["ab", "c"], "cpu", tg.cat_items())


def test_custom_callable_gets_the_values_and_the_device() -> None:
    calls: list[Any] = []

    def count(values: list[Any], device: torch.device) -> int:
        calls.append((list(values), device))
        return len(values)

    out = tg.gather(
        [{"n": 1, "x": torch.ones(1)}, {"n": 2, "x": torch.ones(1)}],
        "cpu",
        tg.by_path({"n": count}),
    )
    assert out["n"] == 2
    assert calls == [([1, 2], torch.device("cpu"))]


@pytest.mark.parametrize("exc", [ValueError, TypeError, RuntimeError, IndexError, KeyError])
def test_an_error_raised_by_a_custom_rule_keeps_its_type(exc: type) -> None:
    def refuse(values: list[Any], device: torch.device) -> Any:
        raise exc("my rule refuses")

    with pytest.raises(exc, match="my rule refuses"):
        tg.gather([{"m": 1, "t": torch.ones(1)}] * 2, "cpu", tg.by_path({"m": refuse}))


def test_namedtuple_outputs() -> None:
    out = tg.gather([Point(torch.ones(1), "a"), Point(torch.ones(1), "b")], "cpu")
    assert type(out) is Point and out.y == ["a", "b"] and out.x.shape == (2,)


# ---------------------------------------------------------------------------- bad arguments


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one replica"):
        tg.gather([], "cpu")
    with pytest.raises(TypeError, match="one output tree per replica"):
        tg.gather({"a": torch.ones(1)}, "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="one output tree per replica"):
        tg.gather("ab", "cpu")
    with pytest.raises(ValueError, match=r"2 sizes for 3 replicas"):
        tg.gather([torch.ones(1)] * 3, "cpu", sizes=[1, 2])


@pytest.mark.cuda
def test_gather_to_cuda_and_back() -> None:
    outs = [torch.ones(1, 2, device="cuda"), torch.ones(1, 2)]
    assert tg.gather(outs, 0).device.type == "cuda"
    assert tg.gather(outs, -1).device.type == "cpu"


def test_cached_fast_path_survives_a_leaf_changing_type_between_calls() -> None:
    # The hot path learns per structure that every leaf concatenates; a later call with the
    # same structure but a string (or a 0-dim tensor) in a leaf must still be gathered right.
    outs = [{"a": torch.ones(2), "b": torch.ones(2)}, {"a": torch.ones(1), "b": torch.ones(1)}]
    for _ in range(3):
        assert tg.gather(outs, "cpu")["a"].shape == (3,)
    mixed = [{"a": "x", "b": torch.ones(2)}, {"a": "y", "b": torch.ones(1)}]
    assert tg.gather(mixed, "cpu")["a"] == ["x", "y"]
    scalars = [
        {"a": torch.tensor(1.0), "b": torch.ones(2)},
        {"a": torch.tensor(2.0), "b": torch.ones(1)},
    ]
    assert tg.gather(scalars, "cpu")["a"].tolist() == [1.0, 2.0]
    assert tg.gather(outs, "cpu")["b"].shape == (3,)


@pytest.mark.parametrize(
    "replacement",
    [{"x": torch.ones(1)}, (torch.ones(1), torch.ones(1)), [torch.ones(1)], None],
    ids=["dict", "tuple", "list", "none"],
)
def test_cached_fast_path_is_not_fooled_by_a_subtree_where_a_leaf_was(replacement: Any) -> None:
    # The hot path flattens against the structure seen last, and flatten_up_to lets a subtree
    # (or None) stand where that structure had a leaf; torch.cat refusing it is the only check
    # there, so every kind of stand-in is tried: in all replicas (a new, consistent structure:
    # gathered right) and in one replica only (a mismatch: an error naming the path).
    def outs(a0: Any, a1: Any) -> list[dict[str, Any]]:
        return [{"a": a0, "b": torch.ones(2)}, {"a": a1, "b": torch.ones(1)}]

    plain = outs(torch.ones(2), torch.ones(1))
    for _ in range(3):
        assert tg.gather(plain, "cpu")["a"].shape == (3,)
    both = tg.gather(outs(replacement, replacement), "cpu")
    doubled = optree.tree_map(lambda t: torch.cat([t, t]), replacement, none_is_leaf=False)
    assert_tree_equal(both, {"a": doubled, "b": torch.ones(3)})
    for _ in range(3):  # again once the structure is cached, then back to the first one
        with pytest.raises(tg.StructureMismatchError, match=r"outputs\['a'\]"):
            tg.gather(outs(replacement, torch.ones(1)), "cpu")
        with pytest.raises(tg.StructureMismatchError, match=r"outputs\['a'\]"):
            tg.gather(outs(torch.ones(2), replacement), "cpu")
        assert tg.gather(plain, "cpu")["a"].shape == (3,)
