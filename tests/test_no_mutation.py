"""Nothing of the caller's module is ever changed: after success, a replica failing, replication failing.

One corpus of modules (plain, BatchNorm, buffers and hooks, TorchScript, a tiny Hugging Face
model, ``torch.compile(m)``, ``m.compile()``) through every entry point that touches a module:
``replicate``, ``data_parallel``, ``DataParallel`` and ``patch`` (issue 12).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from module_state import assert_unchanged, snapshot
from torch import nn

import treegather as tg
import treegather._parallel.shells as replicate_module

Case = tuple[nn.Module, tuple[Any, ...], dict[str, Any], tuple[Any, ...], dict[str, Any]]


class Buffered(nn.Module):
    """Persistent and non-persistent buffers, forward hooks and a state_dict hook."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("scale", torch.full((3,), 2.0))
        self.register_buffer("offset", torch.zeros(3), persistent=False)
        self.register_forward_pre_hook(lambda m, args: (args[0] * 1.0,))
        self.lin.register_forward_hook(lambda m, args, out: out + 1)
        self._register_state_dict_hook(lambda m, sd, prefix, meta: sd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.offset


class Net(nn.Module):
    """A user-defined class: ``m.compile()`` compiles its forward (an ``nn.Sequential``'s is skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _x(shape: tuple[int, ...] = (6, 4)) -> tuple[Any, ...]:
    return (torch.randn(*shape),)


def _sequential() -> Case:
    return _mlp(), _x(), {}, _x((6, 5)), {}


def _batchnorm() -> Case:
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5)).train(), _x(), {}, _x((6, 5)), {}


def _buffered() -> Case:
    return Buffered(), _x(), {}, _x((6, 5)), {}


def _torchscript() -> Case:
    return torch.jit.script(_mlp()), _x(), {}, _x((6, 5)), {}


def _hf_bert() -> Case:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        vocab_size=100,
    )
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 100, (6, 5))
    return model, (), {"input_ids": ids}, (), {"input_ids": torch.full((6, 5), 1000)}


def _compiled() -> Case:
    return torch.compile(_mlp(), backend="eager"), _x(), {}, _x((6, 5)), {}


def _compiled_in_place() -> Case:
    net = Net()
    net.compile(backend="eager")
    return net, _x(), {}, _x((6, 5)), {}


CORPUS: dict[str, Callable[[], Case]] = {
    "sequential": _sequential,
    "batchnorm": _batchnorm,
    "buffers_and_hooks": _buffered,
    "torchscript": _torchscript,
    "hf_bert": _hf_bert,
    "torch_compile": _compiled,
    "compile_in_place": _compiled_in_place,
}


def _run(entry: str, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    devices = ["cpu"] * 2
    if entry == "replicate":
        replicas = tg.replicate(model, devices)
        return tg.parallel_apply(replicas, [args] * 2, [kwargs] * 2, backend="serial")
    if entry == "data_parallel":
        return tg.data_parallel(model, args, devices, module_kwargs=kwargs, backend="serial")
    if entry == "DataParallel":
        return tg.DataParallel(model, devices, backend="serial")(*args, **kwargs)
    return tg.patch(nn.DataParallel(model))(*args, **kwargs)  # torch's forward: a plain call


ENTRIES = ["replicate", "data_parallel", "DataParallel", "patch"]
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.jit.*:DeprecationWarning"),
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="CPU modules; nn.DataParallel would want CUDA"
    ),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()  # every compiled module here starts from an empty code cache
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", list(CORPUS))
def test_success_leaves_the_module_unchanged(name: str, entry: str) -> None:
    torch.manual_seed(0)
    model, args, kwargs, _, _ = CORPUS[name]()
    before = snapshot(model)
    for _ in range(2):  # the second step reuses the kept replicas
        _run(entry, model, args, kwargs)
    assert_unchanged(model, before, allow_bn_update=True)
    model.state_dict()  # still savable (a compiled model's raised RecursionError)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", list(CORPUS))
def test_replica_failure_leaves_the_module_unchanged(name: str, entry: str) -> None:
    torch.manual_seed(0)
    model, _, _, bad_args, bad_kwargs = CORPUS[name]()
    before = snapshot(model)
    with pytest.raises(BaseException):  # noqa: B017 - any failure of the replicas' forward
        _run(entry, model, bad_args, bad_kwargs)
    assert_unchanged(model, before)


@pytest.mark.parametrize("entry", ["replicate", "data_parallel", "DataParallel"])
@pytest.mark.parametrize("name", list(CORPUS))
def test_replication_failure_leaves_the_module_unchanged(
    name: str, entry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model, args, kwargs, _, _ = CORPUS[name]()
    before = snapshot(model)
    n_params = len(list(model.parameters()))
    real = replicate_module.param_copies
    calls: list[int] = []

    def failing(t: torch.Tensor, devs: Any, detach: bool) -> list[torch.Tensor]:
        calls.append(1)
        if len(calls) == n_params:  # the last parameter: every shell exists by now
            raise MemoryError("simulated: out of memory while copying a parameter")
        return real(t, devs, detach)

    monkeypatch.setattr(replicate_module, "param_copies", failing)
    with pytest.raises(MemoryError, match="simulated"):
        _run(entry, model, args, kwargs)
    assert_unchanged(model, before)


@pytest.mark.parametrize("name", list(CORPUS))
def test_patched_torch_data_parallel_replicates_without_mutation(name: str) -> None:
    # torch's forward replicates with dp.replicate on CUDA; patch makes it treegather's.
    torch.manual_seed(0)
    model, args, kwargs, _, _ = CORPUS[name]()
    before = snapshot(model)
    replicas = tg.patch(nn.DataParallel(model)).replicate(model, ["cpu"] * 2)
    tg.parallel_apply(replicas, [args] * 2, [kwargs] * 2, backend="serial")
    assert_unchanged(model, before, allow_bn_update=True)


@pytest.mark.parametrize("entry", ["data_parallel", "DataParallel", "replicate"])
def test_the_issue_table(entry: str) -> None:
    m = _mlp()
    cm = torch.compile(m, backend="eager")
    x = torch.randn(6, 4)
    out = _run(entry, cm, (x,), {})
    if entry == "replicate":
        out = torch.cat(out)
        torch.testing.assert_close(out, torch.cat([m(x), m(x)]))
    else:
        torch.testing.assert_close(out, m(x))
    assert list(m.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


# -- run-time state stays beside the caller's objects, never on them --------------------------------


def test_a_patched_module_keeps_nothing_of_a_step_on_itself() -> None:
    model = nn.Linear(3, 2)
    dp = tg.patch(nn.DataParallel(model), out_layout=tg.mean())
    before = dict(vars(dp))
    args, kwargs = dp.scatter((torch.ones(5, 3),), {}, ["cpu"] * 2)
    outputs = [model(*a, **kw).sum() for a, kw in zip(args, kwargs)]
    # the plain list of outputs is still weighted by the scatter's sizes (3 and 2 rows)
    assert torch.allclose(dp.gather(outputs, "cpu"), (3 * outputs[0] + 2 * outputs[1]) / 5)
    assert vars(dp).keys() == before.keys()
    assert all(vars(dp)[k] is v for k, v in before.items())


def test_the_fork_fan_out_writes_nothing_on_the_modules_it_forks() -> None:
    scripted = torch.jit.script(nn.Linear(3, 2))
    replicas = [scripted._replicate_for_data_parallel() for _ in range(2)]  # no concrete type
    assert not any(hasattr(r, "_concrete_type") for r in replicas)
    outs = tg.parallel_apply(replicas, [torch.ones(2, 3), torch.ones(1, 3)], backend="fork")
    assert [tuple(o.shape) for o in outs] == [(2, 2), (1, 2)]
    assert torch.allclose(outs[1], scripted(torch.ones(1, 3)))
    assert not any(hasattr(r, "_concrete_type") for r in replicas)
