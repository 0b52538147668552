"""data_parallel, DataParallel and patch: equal to the unsplit model, leaf by leaf, with grads."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections import OrderedDict
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree
from torch import nn

import treegather as tg


@tg.register_dataclass
@dataclasses.dataclass
class Out:
    loss: torch.Tensor
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]


class ModelOutputLike(OrderedDict):  # type: ignore[type-arg]
    """Like transformers' ModelOutput: a dataclass that is an OrderedDict of its non-None fields."""

    def __init_subclass__(cls) -> None:
        torch_pytree.register_pytree_node(
            cls,
            lambda d: (list(d.values()), list(d.keys())),
            lambda values, keys: cls(**dict(zip(keys, values))),
        )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                self[f.name] = value


@dataclasses.dataclass
class CausalOut(ModelOutputLike):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class Model(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Linear(6, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
        h1 = torch.tanh(self.emb(x))
        logits = self.head(h1)
        loss = F.cross_entropy(logits, labels)
        hidden = (h1, logits.softmax(-1))
        if self.kind == "dict":
            return {
                "loss": loss,
                "out": {"logits": logits, "hidden": hidden},
                "name": "m",
                "aux": None,
            }
        if self.kind == "dataclass":
            return Out(loss, logits, hidden)
        return CausalOut(loss=loss, logits=logits, hidden_states=hidden)


KINDS = ["dict", "dataclass", "model_output"]
# What makes the gathered output equal model(x): the mean loss weighted by shard sizes, and the
# string kept once. Everything else uses the defaults (tensors cat along dim 0, None stays).
EXACT = {
    "dict": tg.by_path({"loss": tg.mean(), "name": "first"}),
    "dataclass": tg.by_path({"loss": tg.mean()}),
    "model_output": tg.by_path({"loss": tg.mean()}),
}


def _model(kind: str, device: str = "cpu") -> Model:
    torch.manual_seed(0)
    return Model(kind).to(device).eval()


def _batch(n: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 6, generator=g)
    labels = torch.randint(0, 4, (n,), generator=g)
    return x.to(device), labels.to(device)


def assert_tree_close(got: Any, expected: Any) -> None:
    got_leaves, got_spec = optree.tree_flatten(got, namespace=tg.NAMESPACE)
    exp_leaves, exp_spec = optree.tree_flatten(expected, namespace=tg.NAMESPACE)
    assert type(got) is type(expected)
    assert got_spec == exp_spec, f"{got_spec} != {exp_spec}"
    for a, b in zip(got_leaves, exp_leaves):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.shape == b.shape and a.device == b.device
            torch.testing.assert_close(a, b)
        else:
            assert a == b


def _loss(out: Any) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out.loss


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [5, 7])
def test_equals_unsplit_model_with_gradients(kind: str, k: int, n: int) -> None:
    model, ref = _model(kind), _model(kind)
    x, labels = _batch(n)
    out = tg.data_parallel(model, (x, labels), ["cpu"] * k, out_layout=EXACT[kind])
    expected = ref(x, labels)
    assert_tree_close(out, expected)
    _loss(out).backward()
    _loss(expected).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_default_gather_rules(kind: str) -> None:
    model = _model(kind)
    x, labels = _batch(7)
    out = tg.data_parallel(model, x, ["cpu"] * 3, module_kwargs={"labels": labels})
    expected = model(x, labels)
    shards = tg.scatter_kwargs((x, labels), None, ["cpu"] * 3)[0]
    per_shard = torch.stack([_loss(model(*s)) for s in shards])
    torch.testing.assert_close(_loss(out), per_shard)  # 0-dim losses become a vector
    if kind == "dict":
        assert out["name"] == ["m"] * 3 and out["aux"] is None
        torch.testing.assert_close(out["out"]["logits"], expected["out"]["logits"])


@pytest.mark.parametrize("kind", KINDS)
def test_one_device_gives_the_same_shapes_as_several(kind: str) -> None:
    model = _model(kind)
    x, labels = _batch(6)
    one, three = (tg.data_parallel(model, (x, labels), ["cpu"] * k) for k in (1, 3))
    if kind == "dict":  # a non-tensor leaf becomes the list of per-replica values
        assert (one.pop("name"), three.pop("name")) == (["m"], ["m"] * 3)
    leaves1, spec1 = optree.tree_flatten(one, namespace=tg.NAMESPACE)
    leaves3, spec3 = optree.tree_flatten(three, namespace=tg.NAMESPACE)
    assert spec1 == spec3
    for a, b in zip(leaves1, leaves3):
        assert a.ndim == b.ndim
        if a.ndim and a.shape[0] == 6:
            assert a.shape == b.shape


@pytest.mark.parametrize("backend", ["serial", "threads", "fork"])
def test_backends_and_plain_callables(backend: str) -> None:
    model = _model("dict")
    x, labels = _batch(9)
    out = tg.data_parallel(
        model,
        (x, labels),
        ["cpu"] * 4,
        out_layout=EXACT["dict"],
        backend=backend,  # type: ignore[arg-type]
    )
    assert_tree_close(out, model(x, labels))
    total = tg.data_parallel(
        lambda t: t.sum(0), torch.ones(10, 2), ["cpu"] * 3, out_layout=tg.sum()
    )
    assert total.tolist() == [10.0, 10.0]
    assert tg.data_parallel(lambda: torch.ones(2), (), ["cpu"] * 3).tolist() == [1.0, 1.0]


def test_in_layout_and_output_device() -> None:
    def fn(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x @ table

    table = torch.randn(3, 2)
    x = torch.randn(5, 3)
    out = tg.data_parallel(
        fn, (x, table), ["cpu"] * 2, in_layout=tg.by_path({"1": tg.broadcast()}), output_device=-1
    )
    torch.testing.assert_close(out, x @ table)


# -- a single input is addressed as passed (issue 19) ------------------------------------------


def _named_batch() -> dict[str, Any]:
    return {"x": torch.arange(12.0).reshape(6, 2), "names": list("abcdef"), "lr": 0.5}


def _rows(batch: dict[str, Any], labels: torch.Tensor | None = None) -> dict[str, Any]:
    out = {"x": batch["x"] * batch["lr"], "names": [n.upper() for n in batch["names"]]}
    if labels is not None:
        out["labels"] = labels + 1
    return out


ROWS_OUT = {"x": 0, "names": tg.cat_items()}


def test_a_single_input_layout_is_written_as_for_scatter() -> None:
    batch = _named_batch()
    layout = tg.by_path({"names": tg.split_items()})
    shards = tg.scatter(batch, ["cpu"] * 3, layout)  # the same layout works in scatter ...
    assert [s["names"] for s in shards] == [["a", "b"], ["c", "d"], ["e", "f"]]
    out = tg.data_parallel(_rows, batch, ["cpu"] * 3, in_layout=layout, out_layout=ROWS_OUT)
    assert out["names"] == list("ABCDEF")  # ... and in data_parallel(fn, batch)
    torch.testing.assert_close(out["x"], batch["x"] * 0.5)
    # a prefix tree of the input, as in scatter(batch, devices, layout)
    prefix = {"x": 0, "names": tg.split_items(), "lr": None}
    out = tg.data_parallel(_rows, batch, ["cpu"] * 3, in_layout=prefix, out_layout=ROWS_OUT)
    assert out["names"] == list("ABCDEF")
    # a single rule is the input's: split_items() takes a list input whole, cut per sample
    tokens = [torch.arange(n) for n in (3, 1, 2, 4)]
    lens = tg.data_parallel(
        lambda ts: torch.tensor([len(t) for t in ts]),
        tokens,
        ["cpu"] * 2,
        in_layout=tg.split_items(),
    )
    assert lens.tolist() == [3, 1, 2, 4]


def test_a_tuple_keeps_positional_paths_and_keywords_keep_their_names() -> None:
    batch, labels = _named_batch(), torch.arange(6)
    layout = tg.by_path({"0.names": tg.split_items(), "labels": tg.split()})
    out = tg.data_parallel(
        _rows,
        (batch,),
        ["cpu"] * 2,
        module_kwargs={"labels": labels},
        in_layout=layout,
        out_layout=ROWS_OUT | {"labels": 0},
    )
    assert out["names"] == list("ABCDEF") and out["labels"].tolist() == list(range(1, 7))
    # a single input next to module_kwargs: the input's keys and the keyword names
    single = tg.by_path({"names": tg.split_items(), "labels": tg.split()})
    again = tg.data_parallel(
        _rows,
        batch,
        ["cpu"] * 2,
        module_kwargs={"labels": labels},
        in_layout=single,
        out_layout=ROWS_OUT | {"labels": 0},
    )
    assert again["names"] == out["names"] and torch.equal(again["labels"], out["labels"])
    # a prefix tree of the single input: the keyword arguments keep their default rules
    prefix = {"x": 0, "names": tg.split_items(), "lr": None}
    third = tg.data_parallel(
        _rows,
        batch,
        ["cpu"] * 2,
        module_kwargs={"labels": labels},
        in_layout=prefix,
        out_layout=ROWS_OUT | {"labels": 0},
    )
    assert torch.equal(third["labels"], out["labels"])


def test_a_single_input_layout_error_names_paths_as_written() -> None:
    batch = _named_batch()
    with pytest.raises(tg.LayoutError) as info:
        tg.data_parallel(_rows, batch, ["cpu"] * 2, in_layout=tg.by_path({"nmes": "split_items"}))
    assert "by_path pattern 'nmes' matches nothing; close paths: names," in str(info.value)
    with pytest.raises(tg.LeafTypeError, match=r"^inputs\['lr'\]: split\(\) needs a tensor"):
        tg.data_parallel(_rows, batch, ["cpu"] * 2, in_layout=tg.by_path({"lr": 0}))
    with pytest.raises(tg.LeafTypeError, match=r"kwargs\['labels'\]: split\(\) needs a tensor"):
        tg.data_parallel(
            _rows,
            batch,
            ["cpu"] * 2,
            module_kwargs={"labels": "no"},
            in_layout=tg.by_path({"names": "split_items", "labels": 0}),
        )
    # a layout of (args, kwargs) for a single input: the message says how to write either
    with pytest.raises(tg.LayoutError) as info:
        tg.data_parallel(_rows, batch, ["cpu"] * 2, in_layout=(({"names": "split_items"},), {}))
    msg = str(info.value)
    assert "the layout is not a prefix of the structure of inputs:" in msg
    assert "inputs: the layout has a tuple where the data has a dict" in msg
    assert "pass the input as a tuple: data_parallel(fn, (batch,), ...)" in msg


def test_a_name_of_the_input_and_of_a_keyword_is_a_layout_error() -> None:
    batch = _named_batch()
    labels = {"names": list("uvwxyz")}  # a keyword named like a key of the input
    calls: list[Any] = []

    def fn(batch: Any, names: Any = None) -> Any:
        calls.append(batch)
        return batch["x"]

    layout = tg.by_path({"names": tg.split_items(), "typo": 0})
    with pytest.raises(tg.LayoutError) as info:
        tg.data_parallel(fn, batch, ["cpu"] * 2, module_kwargs=labels, in_layout=layout)
    msg = str(info.value)
    assert msg.startswith("2 problems:")
    assert "by_path pattern 'names' could mean inputs['names'] or kwargs['names']" in msg
    assert "by_path pattern 'typo' matches nothing" in msg
    assert "pass the input as a tuple, data_parallel(fn, (batch,), ...)" in msg
    assert calls == []  # raised before anything ran
    # wildcards mean both on purpose; a tuple input disambiguates
    every = tg.by_path({"nam*": tg.split_items()})
    tg.data_parallel(fn, batch, ["cpu"] * 2, module_kwargs=labels, in_layout=every)
    split = tg.by_path({"0.names": tg.split_items(), "names": tg.split_items()})
    tg.data_parallel(fn, (batch,), ["cpu"] * 2, module_kwargs=labels, in_layout=split)


def test_single_input_layouts_resolve_alike_in_the_reference_and_compiled_paths() -> None:
    from treegather._caches import reference_only

    batch, labels = _named_batch(), torch.arange(6)
    layouts = [
        tg.by_path({"names": tg.split_items()}),
        tg.by_path({"names": tg.split_items(), "labels": tg.broadcast()}),
        {"x": 0, "names": tg.split_items(), "lr": None},
        tg.by_path({"nmes": tg.split_items()}),
        tg.by_path({"lr": 0}),
    ]
    for layout in layouts:
        for kwargs in (None, {"labels": labels}):
            results = []
            for mode in ("compiled", "compiled", "compiled", "reference"):
                try:
                    with reference_only() if mode == "reference" else contextlib.nullcontext():
                        results.append(
                            repr(
                                tg.data_parallel(
                                    _rows,
                                    batch,
                                    ["cpu"] * 2,
                                    module_kwargs=kwargs,
                                    in_layout=layout,
                                    out_layout=tg.by_path({"names": tg.cat_items()}),
                                )
                            )
                        )
                except (tg.LayoutError, tg.LeafTypeError) as exc:
                    results.append(f"{type(exc).__name__}: {exc}")
            assert len(set(results)) == 1, results


def test_module_on_another_device_is_rejected() -> None:
    model = Model("dict").to("meta")
    with pytest.raises(RuntimeError, match=r"parameter 'emb.weight' is on meta"):
        tg.data_parallel(model, _batch(4), ["cpu"] * 2)


# -- DataParallel and patch ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 3])
def test_data_parallel_module_matches_function(kind: str, k: int) -> None:
    model = _model(kind)
    x, labels = _batch(7)
    dp = tg.DataParallel(model, ["cpu"] * k, out_layout=EXACT[kind])
    assert isinstance(dp, nn.DataParallel)
    assert dp.device_ids == [torch.device("cpu")] * k
    expected = tg.data_parallel(model, (x, labels), ["cpu"] * k, out_layout=EXACT[kind])
    assert_tree_close(dp(x, labels=labels), expected)
    _loss(dp(x, labels)).backward()
    assert model.emb.weight.grad is not None


def test_state_dict_keys_equal_torch() -> None:
    model = _model("dict")
    ours = tg.DataParallel(model, ["cpu"] * 2)
    theirs = nn.DataParallel(model)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert next(iter(ours.state_dict())) == "module.emb.weight"
    copy.deepcopy(ours).load_state_dict(theirs.state_dict())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_default_device_ids_without_cuda_is_a_plain_call() -> None:
    model = _model("dict")
    x, labels = _batch(5)
    dp = tg.DataParallel(model)
    assert dp.device_ids == []
    assert_tree_close(dp(x, labels), model(x, labels))


@pytest.mark.parametrize("kind", KINDS)
def test_patch_gives_the_same_results(kind: str) -> None:
    model = _model(kind)
    x, labels = _batch(7)
    dp = tg.patch(nn.DataParallel(model), out_layout=EXACT[kind])
    assert isinstance(dp, nn.DataParallel)
    args, kwargs = dp.scatter((x,), {"labels": labels}, ["cpu"] * 3)
    assert [a[0].shape[0] for a in args] == [3, 2, 2]
    outputs = [model(*a, **kw) for a, kw in zip(args, kwargs)]
    expected = tg.data_parallel(
        model, x, ["cpu"] * 3, module_kwargs={"labels": labels}, out_layout=EXACT[kind]
    )
    assert_tree_close(dp.gather(outputs, "cpu"), expected)
    if not torch.cuda.is_available():  # torch's forward is then a plain call
        assert_tree_close(dp(x, labels), model(x, labels))
    with pytest.raises(TypeError, match=r"expects a torch\.nn\.DataParallel"):
        tg.patch(model)  # type: ignore[type-var]


# -- the same equivalences on every device set (CPU always, CUDA when present) ------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_equivalences_on_each_device_set(devices: list[str], kind: str) -> None:
    model, ref = _model(kind, devices[0]), _model(kind, devices[0])
    x, labels = _batch(11, devices[0])
    out = tg.data_parallel(model, (x, labels), devices, out_layout=EXACT[kind])
    expected = ref(x, labels)
    assert_tree_close(out, expected)
    dp_out = tg.DataParallel(model, devices, out_layout=EXACT[kind])(x, labels)
    assert_tree_close(dp_out, expected)
    _loss(out).backward()
    _loss(expected).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_patch_on_cuda_runs_torch_forward_with_treegather_steps(kind: str) -> None:
    model = _model(kind, "cuda:0")
    x, labels = _batch(11, "cuda:0")
    dp = tg.patch(nn.DataParallel(model), out_layout=EXACT[kind])
    if len(dp.device_ids) == 1:  # torch's forward: one device is a plain call, no gather
        assert_tree_close(dp(x, labels), model(x, labels))
    else:
        expected = tg.data_parallel(model, (x, labels), dp.device_ids, out_layout=EXACT[kind])
        assert_tree_close(dp(x, labels), expected)


def test_fewer_rows_than_devices_uses_fewer_replicas() -> None:
    model = _model("dict")
    x, labels = _batch(2)
    calls: list[int] = []
    hook = model.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    out = tg.data_parallel(model, (x, labels), ["cpu"] * 4, out_layout=EXACT["dict"])
    hook.remove()
    assert sorted(calls) == [1, 1]
    assert_tree_close(out, model(x, labels))


def test_batchnorm_statistics_follow_replica_zero_as_in_torch() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).train()
    ref = copy.deepcopy(net)
    x = torch.randn(8, 3)
    tg.DataParallel(net, ["cpu"] * 2, backend="threads")(x)
    ref(x[:4])  # replica 0's shard
    torch.testing.assert_close(net[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(net[1].running_var, ref[1].running_var)


def test_overridden_scatter_may_return_plain_lists_as_torch_allows() -> None:
    # torch's API lets a subclass's scatter return per-device sequences; kwargs may be None.
    class Doubler(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"y": x * 2}

    class ManualScatter(tg.DataParallel):
        def scatter(self, inputs: Any, kwargs: Any, device_ids: Any) -> Any:
            x = inputs[0]
            return [(x[:3],), (x[3:],)], None

    dp = ManualScatter(Doubler(), device_ids=["cpu", "cpu"])
    out = dp(torch.arange(5.0))
    assert torch.equal(out["y"], torch.arange(5.0) * 2)


# -------------------------------------------------------------- a dict batch for a kwargs model


class KwargsModel(nn.Module):
    """The calling convention of every Hugging Face model: ``model(**batch)``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        hidden = self.emb(input_ids)
        if attention_mask is not None:
            hidden = hidden * attention_mask.unsqueeze(-1)
        return {"logits": hidden.sum(-1)}


def _token_batch() -> dict[str, torch.Tensor]:
    ids = torch.arange(12).reshape(6, 2) % 10
    return {"input_ids": ids, "attention_mask": torch.ones(6, 2)}


def test_dict_batch_for_a_kwargs_model_hints_module_kwargs_and_reports_once() -> None:
    model, batch = KwargsModel(), _token_batch()
    with pytest.raises(Exception) as info:
        tg.data_parallel(model, batch, ["cpu"] * 3)
    err = info.value
    assert not hasattr(err, "exceptions")  # no group: three identical failures, reported once
    assert str(err).startswith("in replicas 0, 1, 2 (devices cpu, cpu, cpu): ")
    assert err.__notes__[-1] == (  # type: ignore[attr-defined]
        "Hint: inputs is a dict whose keys name parameters of KwargsModel.forward "
        "(input_ids, attention_mask) but it was passed as one positional argument; to call "
        "KwargsModel.forward(**batch), pass it as module_kwargs: "
        "data_parallel(model, (), devices, module_kwargs=batch)"
    )
    out = tg.data_parallel(model, (), ["cpu"] * 3, module_kwargs=batch)  # the hinted fix
    torch.testing.assert_close(out["logits"], model(**batch)["logits"])


def test_no_module_kwargs_hint_where_it_does_not_apply() -> None:
    def fails(batch: Any) -> Any:
        raise ValueError("broken model")

    for fn, inputs, kwargs in [
        (fails, {"x": torch.ones(4)}, None),  # keys name no parameter
        (KwargsModel(), (torch.ones(4, 2),), {"oops": torch.ones(4)}),  # kwargs given
    ]:
        with pytest.raises(Exception) as info:
            tg.data_parallel(fn, inputs, ["cpu"] * 2, module_kwargs=kwargs)
        assert not any("module_kwargs" in n for n in getattr(info.value, "__notes__", []))


def test_dataparallel_with_a_dict_batch_for_a_keyword_only_forward_hints_keywords() -> None:
    class KeywordsOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, *, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
            return self.lin(x)

    model, batch = KeywordsOnly(), {"x": torch.ones(4, 2), "y": torch.zeros(4)}
    with pytest.raises(TypeError) as info:
        tg.DataParallel(model, ["cpu"] * 2)(batch)
    assert info.value.__notes__[-1] == (  # type: ignore[attr-defined]
        "Hint: dp(batch) got a dict whose keys name parameters of KeywordsOnly.forward (x, y) "
        "as its one positional argument; to call KeywordsOnly.forward(**batch), pass its items "
        "as keywords: dp(**batch)"
    )
    with pytest.raises(TypeError) as info:  # data_parallel gives its own hint for the same call
        tg.data_parallel(model, batch, ["cpu"] * 2)
    assert "module_kwargs=batch" in info.value.__notes__[-1]  # type: ignore[attr-defined]
    out = tg.DataParallel(model, ["cpu"] * 2)(**batch)  # the hinted fix
    torch.testing.assert_close(out, model(**batch))


# ------------------------------------------------------------------ weights from the data


class TokenLoss(nn.Module):
    """A token loss over the labels that are not -100, called as ``model(**batch)`` with a
    keyword-only forward (like a Hugging Face model's loss, which averages over tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 5)

    def forward(self, *, x: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.proj(x)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def _tokens(labels: torch.Tensor, **_: Any) -> torch.Tensor:
    return (labels != -100).sum()


def _padded_batch(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """7 rows of 4 tokens, uneven padding; on 3 devices the last shard has no token at all."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 5, (7, 4), generator=g)
    for row, keep in enumerate([4, 1, 3, 2, 4, 0, 0]):
        labels[row, keep:] = -100
    return {"x": torch.randn(7, 4, 3, generator=g, dtype=dtype), "labels": labels}


WEIGHTED = tg.by_path({"loss": tg.mean(weight=_tokens)})


class _CPUDataParallel(nn.DataParallel):  # type: ignore[type-arg]
    """torch's DataParallel with a parallel_apply that runs on the CPU (torch's needs CUDA)."""

    def parallel_apply(self, replicas: Any, inputs: Any, kwargs: Any) -> list[Any]:
        return tg.parallel_apply(replicas, inputs, kwargs)


def _manual_patched_step(dp: nn.DataParallel, batch: dict[str, Any], devices: list[str]) -> Any:
    """What torch's DataParallel.forward does with several devices, on the CPU (where its own
    forward is a plain call): scatter, replicate, parallel_apply, gather."""
    args, kwargs = dp.scatter((), batch, devices)
    replicas = dp.replicate(dp.module, devices[: len(args)])
    return dp.gather(dp.parallel_apply(replicas, args, kwargs), "cpu")


@pytest.mark.parametrize("entry", ["data_parallel", "DataParallel", "patch"])
def test_a_mean_weighted_by_the_data_gives_the_one_device_token_loss(entry: str) -> None:
    from treegather._caches import reference_only

    torch.manual_seed(0)
    model, ref = TokenLoss(), TokenLoss()
    ref.load_state_dict(model.state_dict())
    batch = _padded_batch()
    expected = ref(**batch)
    expected["loss"].backward()
    devices = ["cpu"] * 3
    rows = tg.by_path({"loss": "mean"})
    by_rows = tg.data_parallel(model, (), devices, module_kwargs=batch, out_layout=rows)
    assert torch.isnan(by_rows["loss"])  # mean() by rows: the shard without tokens is NaN
    for reference in (False, True, False, False):  # cold, the reference path, seen, compiled
        model.zero_grad()
        with reference_only() if reference else contextlib.nullcontext():
            if entry == "data_parallel":
                out = tg.data_parallel(model, (), devices, module_kwargs=batch, out_layout=WEIGHTED)
            elif entry == "DataParallel":
                out = tg.DataParallel(model, devices, out_layout=WEIGHTED)(**batch)
            else:
                dp = tg.patch(_CPUDataParallel(model), out_layout=WEIGHTED)
                out = _manual_patched_step(dp, batch, devices)
        # the last shard counts no token (its loss is NaN) and takes no part
        assert torch.isfinite(out["loss"])
        torch.testing.assert_close(out["loss"], expected["loss"], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out["logits"], expected["logits"])
        out["loss"].backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_the_weight_gets_each_shards_call_as_the_replica_was_called() -> None:
    calls: list[tuple[Any, ...]] = []

    def weight(*args: Any, **kwargs: Any) -> int:
        calls.append((tuple(a.shape[0] for a in args), sorted(kwargs)))
        return len(args[0])

    def fn(x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return x.mean() * scale

    x = torch.arange(7.0)
    out = tg.data_parallel(
        fn, x, ["cpu"] * 3, module_kwargs={"scale": 2.0}, out_layout=tg.mean(weight=weight)
    )
    assert out.item() == pytest.approx(x.mean().item() * 2)
    assert calls == [((3,), ["scale"]), ((2,), ["scale"]), ((2,), ["scale"])]
    calls.clear()
    tg.data_parallel(fn, (x,), ["cpu"] * 2, out_layout=tg.mean(weight=weight))  # positional
    assert calls == [((4,), []), ((3,), [])]


def test_weights_from_the_data_accumulate_wide_and_every_zero_count_is_nan() -> None:
    # float16 losses over 4096 tokens each: weighted in float32, 100.0, not inf
    x = torch.full((8192,), 100.0, dtype=torch.float16)
    out = tg.data_parallel(
        torch.mean, x, ["cpu"] * 2, out_layout=tg.mean(weight=lambda t: t.numel())
    )
    assert out.dtype == torch.float16 and out.item() == 100.0
    # no shard counts anything: the mean of no items (as one device's loss over no tokens)
    batch = _padded_batch()
    batch["labels"] = torch.full_like(batch["labels"], -100)
    model = TokenLoss()
    out = tg.data_parallel(model, (), ["cpu"] * 3, module_kwargs=batch, out_layout=WEIGHTED)
    assert torch.isnan(out["loss"]) and torch.isnan(model(**batch)["loss"])
    out["loss"].backward()  # with no gradient
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    # Python numbers: exact for ints
    numbers = tg.data_parallel(
        lambda x: int(x.sum()),
        torch.arange(6),
        ["cpu"] * 2,
        out_layout=tg.mean(weight=lambda x: int(x[0] > 0)),
    )
    assert numbers == 12.0  # shard 0 (0 + 1 + 2) counts 0: only shard 1's 12


def test_weight_errors_are_typed_and_name_the_path() -> None:
    model, batch = TokenLoss(), _padded_batch()

    def run(weight: Any) -> None:
        tg.data_parallel(
            model,
            (),
            ["cpu"] * 2,
            module_kwargs=batch,
            out_layout=tg.by_path({"loss": tg.mean(weight=weight)}),
        )

    with pytest.raises(
        tg.ArgumentTypeError,
        match=(
            r"^outputs\['loss'\]: mean\(weight=<lambda>\): the weight of replica 0 must be a "
            r"number >= 0 \(an int, a float or a 0-dim tensor, e\.g\. \(labels != -100\)\.sum\(\) "
            r"or class_weight\[labels\]\.sum\(\)\), got complex \(1\+1j\)$"
        ),
    ):
        run(lambda **_: 1 + 1j)
    for bad in (
        lambda **_: torch.ones(2, dtype=torch.long),
        lambda **_: torch.tensor(True),
        lambda **_: torch.tensor(1j),
        lambda **_: True,
        lambda **_: None,
        lambda **_: "3",
    ):
        with pytest.raises(tg.ArgumentTypeError, match=r"the weight of replica 0 must be a number"):
            run(bad)
    for value, shown in ((-1, "-1"), (-0.5, "-0.5"), (math.nan, "nan"), (math.inf, "inf")):
        with pytest.raises(
            tg.BatchSizeError,  # (a WeightError, which is one)
            match=r"^outputs\['loss'\]: mean\(weight=<lambda>\): the "
            rf"weight of replica 0 is {shown}, and a weight is a finite number >= 0$",
        ) as info:
            run(lambda **_: value)  # noqa: B023  (run at once)
        assert type(info.value) is tg.WeightError
    with pytest.raises(tg.ArgumentTypeError, match=r"mean\(weight=\.\.\.\) takes a callable"):
        tg.mean(weight=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tg.mean(_tokens)  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize("entry", ["data_parallel", "DataParallel"])
def test_a_weight_that_fails_is_a_weight_error_naming_path_rule_and_cause(entry: str) -> None:
    from treegather._caches import reference_only

    model, batch = TokenLoss(), _padded_batch()

    def no_keywords(labels: torch.Tensor) -> torch.Tensor:  # the shard's call also has x=
        return (labels != -100).sum()

    def divides(labels: torch.Tensor, **_: Any) -> int:
        return int((labels != -100).sum()) // 0

    call = "0 positional argument(s) and keyword(s) 'x', 'labels'"
    for weight, cause, text in (
        (no_keywords, TypeError, f"no_keywords does not take replica 0's call, which has {call} "),
        (
            divides,
            ZeroDivisionError,
            "divides raised ZeroDivisionError: integer division or modulo by zero on replica 0's "
            f"call ({call})",
        ),
    ):
        layout = tg.by_path({"loss": tg.mean(weight=weight)})
        messages = set()
        for reference in (True, False, False, False):  # the plain path, cold, seen, compiled
            with reference_only() if reference else contextlib.nullcontext():
                with pytest.raises(tg.WeightError) as info:
                    if entry == "data_parallel":
                        tg.data_parallel(
                            model, (), ["cpu"] * 2, module_kwargs=batch, out_layout=layout
                        )
                    else:
                        tg.DataParallel(model, ["cpu"] * 2, out_layout=layout)(**batch)
            assert isinstance(info.value, tg.TreegatherError)
            assert type(info.value.__cause__) is cause
            messages.add(str(info.value))
        (message,) = messages
        assert message.startswith(f"outputs['loss']: mean(weight={weight.__name__}): {text}")
        hint = "take what it does not read as **_, e.g. lambda labels, **_:"
        assert (hint in message) is (weight is no_keywords)


class ClassWeightedLoss(nn.Module):
    """A class-weighted cross entropy (mean reduction: the sum of each target's class weight
    times its loss, over the sum of the targets' class weights; -100 ignored)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.loss_fn = nn.CrossEntropyLoss(weight=weight)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.proj(x)
        return {"loss": self.loss_fn(logits, labels), "logits": logits}


@pytest.mark.parametrize("entry", ["data_parallel", "DataParallel"])
@pytest.mark.parametrize("k", [2, 3])
def test_a_class_weighted_loss_weighted_by_its_class_weights_is_the_one_device_loss(
    entry: str, k: int
) -> None:
    from treegather._caches import reference_only

    torch.manual_seed(0)
    w = torch.tensor([0.0, 1.0, 2.5, 0.5])  # class 0 weighs nothing
    model, ref = ClassWeightedLoss(w), ClassWeightedLoss(w)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(7, 3)
    labels = torch.tensor([1, 2, -100, 3, 2, 0, -100])  # on 3 devices the last shard weighs 0
    expected = ref(x, labels)
    expected["loss"].backward()

    def weight(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_fn.weight[labels[labels != -100]].sum()  # a float, not a count

    layout = tg.by_path({"loss": tg.mean(weight=weight)})
    devices = ["cpu"] * k
    by_rows = tg.data_parallel(model, (x, labels), devices, out_layout=tg.by_path({"loss": "mean"}))
    assert not torch.allclose(by_rows["loss"], expected["loss"])  # rows are not the weights
    for reference in (True, False, False, False):  # the plain path, cold, seen, compiled
        model.zero_grad()
        with reference_only() if reference else contextlib.nullcontext():
            if entry == "data_parallel":
                out = tg.data_parallel(model, (x, labels), devices, out_layout=layout)
            else:
                out = tg.DataParallel(model, devices, out_layout=layout)(x, labels)
        assert torch.isfinite(out["loss"])
        torch.testing.assert_close(out["loss"], expected["loss"], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out["logits"], expected["logits"])
        out["loss"].backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_a_gather_without_the_calls_says_where_the_weights_come_from() -> None:
    outs = [{"loss": torch.tensor(1.0)}, {"loss": torch.tensor(2.0)}]
    with pytest.raises(tg.LayoutError) as info:
        tg.gather(outs, "cpu", WEIGHTED)
    assert str(info.value) == (
        "outputs['loss']: mean(weight=_tokens) weighs each replica by what _tokens counts in its "
        "inputs, and this gather has none: data_parallel, DataParallel and patch pass each "
        "shard's call; elsewhere gather with mean() and sizes=[each replica's count] "
        "(treegather.distributed: each rank's count as sizes=)"
    )
    # a patched module's gather of a plain list (no parallel_apply outputs) has no calls either
    dp = tg.patch(nn.DataParallel(TokenLoss()), out_layout=WEIGHTED)
    with pytest.raises(tg.LayoutError, match="this gather has none"):
        dp.gather(outs, "cpu")
    assert tg.gather(outs, "cpu", {"loss": tg.mean()}, sizes=[3, 1])["loss"].item() == 1.25


def test_explain_shows_the_weight() -> None:
    out = {"loss": torch.tensor(0.5), "logits": torch.zeros(2, 4, 5)}
    explained = tg.explain(out, WEIGHTED, ["cpu"] * 3, "gather")
    row = explained["outputs['loss']"]
    assert row.rule == "mean(weight=_tokens)"
    assert (
        row.result == "Tensor() float32 (weighted by _tokens(*args, **kwargs) of each shard's call)"
    )
    assert "mean(weight=_tokens)" in str(explained)
