"""torch.compile'd models in data_parallel, DataParallel and replicate (issue 12).

Compiled replicas share the compiled code (counted with dynamo's ``CompileCounter`` backend, or
with ``aot_eager`` to trace the backward too); outputs and gradients equal the eager model's on
``["cpu"] * k``, k = 1..4. One test runs the default (inductor) backend end to end.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

import treegather as tg


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pair() -> tuple[Net, Net]:
    torch.manual_seed(0)
    net = Net()
    return net, copy.deepcopy(net)


def _compiled(form: str, net: Net, backend: Any) -> Any:
    """The three supported forms; returns what is passed to treegather."""
    if form == "in_place":
        net.compile(backend=backend)
        return net
    return torch.compile(net, backend=backend)


def _step(form: str, model: Any, x: torch.Tensor, k: int) -> torch.Tensor:
    devices = ["cpu"] * k
    if form == "DataParallel":
        return tg.DataParallel(model, devices, backend="serial")(x)  # type: ignore[no-any-return]
    return tg.data_parallel(model, x, devices, backend="serial")  # type: ignore[no-any-return]


FORMS = ["torch_compile", "DataParallel", "in_place"]


@pytest.mark.parametrize("form", FORMS)
def test_outputs_and_gradients_equal_the_eager_model(form: str) -> None:
    net, ref = _pair()
    model = _compiled(form, net, CompileCounterWithBackend("aot_eager"))
    x = torch.randn(8, 4)
    for k in (1, 2, 3, 4):  # one compiled model for every k: its code is shared
        net.zero_grad()
        ref.zero_grad()
        out = _step(form, model, x, k)
        expected = ref(x)
        torch.testing.assert_close(out, expected)
        (out**2).sum().backward()
        (expected**2).sum().backward()
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, msg=f"{name}, k={k}")


@pytest.mark.parametrize("form", FORMS)
def test_replicas_share_the_compiled_code_and_a_second_step_recompiles_nothing(
    form: str,
) -> None:
    net, _ = _pair()
    counter = CompileCounter()
    model = _compiled(form, net, counter)
    x = torch.randn(8, 4)
    _step(form, model, x, 4).sum().backward()
    assert counter.frame_count == 1  # four replicas, shards of 2 rows: compiled once, not 4x
    for _ in range(3):
        _step(form, model, x, 4).sum().backward()
    assert counter.frame_count == 1
    _step(form, model, torch.randn(7, 4), 3).sum().backward()  # shards of 3, 2, 2 rows
    frames = counter.frame_count
    assert frames <= 3  # new sizes: at most a static and a dynamic-shape graph
    for _ in range(2):
        _step(form, model, torch.randn(7, 4), 3).sum().backward()
        _step(form, model, x, 4).sum().backward()
    assert counter.frame_count == frames


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compiled_function_calling_data_parallel_runs_it_eagerly() -> None:
    net, ref = _pair()

    @torch.compile(backend="eager")
    def loss(x: torch.Tensor) -> torch.Tensor:
        return tg.data_parallel(net, x * 2, ["cpu"] * 2, backend="serial").pow(2).mean()

    x = torch.randn(6, 4)
    torch.testing.assert_close(loss(x), ref(x * 2).pow(2).mean())
    loss(x).backward()
    assert net.a.weight.grad is not None

    @torch.compile(backend="eager", fullgraph=True)
    def strict(x: torch.Tensor) -> torch.Tensor:
        return tg.data_parallel(net, x, ["cpu"] * 2)  # type: ignore[no-any-return]

    with pytest.raises(Exception, match=r"pass torch\.compile\(model\) to data_parallel"):
        strict(x)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's own torch.jit imports
def test_default_inductor_backend_end_to_end() -> None:
    net, ref = _pair()
    compiled = torch.compile(net)
    x = torch.randn(6, 4)
    for _ in range(2):
        net.zero_grad()
        out = tg.data_parallel(compiled, x, ["cpu"] * 2)
        out.sum().backward()
    torch.testing.assert_close(out, ref(x))
    ref(x).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


# torch's own warning: dynamo reads .grad of the compiled submodule's (non-leaf) input tensor
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compiled_submodule_and_replicas_on_their_own() -> None:
    torch.manual_seed(0)
    inner = Net()
    outer = nn.Sequential(nn.Linear(4, 4), torch.compile(inner, backend="eager"))
    plain = nn.Sequential(copy.deepcopy(outer[0]), copy.deepcopy(inner))
    x = torch.randn(6, 4)
    replicas = tg.replicate(outer, ["cpu"] * 3)
    for r in replicas:
        assert r[1]._orig_mod is not inner
        torch.testing.assert_close(r(x), plain(x))
