"""replicate: modules (eager and TorchScript) and tensor trees, on repeated CPU and CUDA devices."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import treegather as tg


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.bn = nn.BatchNorm1d(5)
        self.head = nn.Linear(5, 3)
        self.unused: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.lin(x))))


def _net(device: str) -> Net:
    torch.manual_seed(0)
    return Net().to(device)


def test_module_replicas_compute_the_same_and_reduce_gradients(devices: list[str]) -> None:
    net = _net(devices[0])
    ref = _net(devices[0])
    x = torch.randn(6, 4, device=devices[0])
    replicas = tg.replicate(net, devices)
    assert len(replicas) == len(devices)
    outs = [r(x.to(d)) for r, d in zip(replicas, devices)]
    for out, d in zip(outs, devices):
        assert out.device == torch.device(d)
        torch.testing.assert_close(out.to(devices[0]), ref(x))
    sum((o.to(devices[0]) ** 2).sum() for o in outs).backward()
    (len(devices) * (ref(x) ** 2).sum()).backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_replicas_expose_their_parameters_and_keep_none_slots() -> None:
    # Issue 19: replicas have parameters (torch's replicas expose none, so transformers'
    # next(self.parameters()) raised StopIteration); on the source's device, its own.
    net = _net("cpu")
    r = tg.replicate(net, ["cpu"] * 2)[1]
    assert [n for n, _ in r.named_parameters()] == [n for n, _ in net.named_parameters()]
    assert all(p is q for p, q in zip(r.parameters(), net.parameters()))
    assert [n for n, _ in r.named_buffers()] == [n for n, _ in net.named_buffers()]
    assert r.unused is None
    assert isinstance(r.head, nn.Linear) and r.head is not net.head


def test_buffers_shared_by_replica_zero_only(devices: list[str]) -> None:
    net = _net(devices[0]).train()
    replicas = tg.replicate(net, devices)
    src = net.bn.running_mean
    assert replicas[0].bn.running_mean.data_ptr() == src.data_ptr()
    for r in replicas[1:]:
        assert r.bn.running_mean.data_ptr() != src.data_ptr()
    xs = [torch.randn(8, 4, device=devices[0]) + i for i in range(len(devices))]
    expected = _net(devices[0]).train()
    expected(xs[0])
    tg.parallel_apply(replicas, [x.to(d) for x, d in zip(xs, devices)], backend="threads")
    torch.testing.assert_close(net.bn.running_mean, expected.bn.running_mean)
    assert int(net.bn.num_batches_tracked) == 1


def test_detach_gives_copies_without_grad(devices: list[str]) -> None:
    net = _net(devices[0])
    for r in tg.replicate(net, devices, detach=True):
        assert not r.lin.weight.requires_grad
        assert r.lin.weight.grad_fn is None


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchscript_module(devices: list[str]) -> None:
    net = _net(devices[0]).eval()
    scripted = torch.jit.script(net)
    x = torch.randn(3, 4, device=devices[0])
    replicas = tg.replicate(scripted, devices)
    outs = [r(x.to(d)) for r, d in zip(replicas, devices)]
    for out in outs:
        torch.testing.assert_close(out.to(devices[0]), net(x))
    sum(o.to(devices[0]).sum() for o in outs).backward()
    assert scripted.head.weight.grad is not None
    torch.testing.assert_close(
        scripted.head.weight.grad,
        len(devices) * torch.autograd.grad(net(x).sum(), net.head.weight)[0],
    )


def test_tree_of_parameters_for_functional_call(devices: list[str]) -> None:
    net = _net(devices[0]).eval()
    params = dict(net.named_parameters())
    trees = tg.replicate({"params": params, "tag": "v1", "none": None}, devices)
    x = torch.randn(5, 4, device=devices[0])
    total = 0.0
    for tree, d in zip(trees, devices):
        assert tree["tag"] == "v1" and tree["none"] is None
        assert all(t.device == torch.device(d) for t in tree["params"].values())
        out = torch.func.functional_call(net, tree["params"], (x.to(d),))
        total = total + out.sum().to(devices[0])
    assert isinstance(total, torch.Tensor)
    total.backward()
    ref = torch.autograd.grad(net(x).sum(), net.lin.weight)[0]
    assert net.lin.weight.grad is not None
    torch.testing.assert_close(net.lin.weight.grad, len(devices) * ref)


def test_tree_detach_and_empty_devices() -> None:
    w = torch.ones(2, requires_grad=True)
    assert [t[0].requires_grad for t in tg.replicate((w,), ["cpu"] * 2, detach=True)] == [False] * 2
    with pytest.raises(ValueError, match="at least one device"):
        tg.replicate(w, [])


@pytest.mark.cuda
def test_distinct_cuda_devices_use_torch_broadcast() -> None:
    n = torch.cuda.device_count()
    net = _net("cuda:0")
    replicas = tg.replicate(net, [f"cuda:{i}" for i in range(n)])
    assert [r.lin.weight.device.index for r in replicas] == list(range(n))
    assert replicas[0].bn.running_mean.data_ptr() == net.bn.running_mean.data_ptr()


def test_sparse_embedding_gradients(devices: list[str]) -> None:
    # torch's test_data_parallel_sparse, ported: sparse gradients reach the source parameter.
    torch.manual_seed(0)
    emb = nn.Embedding(10, 5, sparse=True).to(devices[0])
    i = torch.randint(10, (20, 5), device=devices[0])
    expected_out = emb(i)
    expected_out.sum().backward()
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse
    expected_grad = emb.weight.grad.to_dense()
    for run in (
        lambda: tg.data_parallel(emb, i, devices),
        lambda: tg.DataParallel(emb, devices)(i),
    ):
        emb.zero_grad()
        out = run()
        out.sum().backward()
        assert out.device == torch.device(devices[0])
        torch.testing.assert_close(out, expected_out)
        torch.testing.assert_close(emb.weight.grad.to_dense(), expected_grad)
    emb.zero_grad()
    replicas = tg.replicate(emb, devices)
    sum(r(i.to(d)).sum().to(devices[0]) for r, d in zip(replicas, devices)).backward()
    torch.testing.assert_close(emb.weight.grad.to_dense(), len(devices) * expected_grad)


def test_same_device_replicas_use_the_source_parameters() -> None:
    net = _net("cpu")
    for r in tg.replicate(net, ["cpu"] * 2):
        assert r.lin.weight is net.lin.weight
    for r in tg.replicate(net, ["cpu"] * 2, detach=True):
        assert r.lin.weight is not net.lin.weight and not r.lin.weight.requires_grad


def test_replicas_made_by_torch_replicate_get_their_own_tables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On distinct CUDA devices torch's replicate builds fresh replicas (its replicas share the
    source's hook tables and expose no parameters); treegather gives them tables and parameters
    of their own. Without CUDA, torch's broadcast is stood in for by copies on the CPU."""
    import importlib

    import treegather._parallel.shells as rep

    torch_replicate = importlib.import_module("torch.nn.parallel.replicate")  # (not the function)

    def broadcast(tensors: Any, devices: Any, detach: bool = False) -> list[list[torch.Tensor]]:
        src = [t.detach() if detach else t for t in tensors]
        return [src, *([t.clone() for t in src] for _ in devices[1:])] if tensors else []

    monkeypatch.setattr(torch_replicate, "_broadcast_coalesced_reshape", broadcast)
    monkeypatch.setattr(torch_replicate, "_get_device_index", lambda d, optional=False: d)
    monkeypatch.setattr(rep, "_use_torch_broadcast", lambda module, devs: True)
    net = _net("cpu")
    net.lin.register_forward_hook(lambda m, args, out: out * 2)
    replicas = tg.replicate(net, ["cpu"] * 2)
    x = torch.randn(3, 4)
    for r in replicas:
        assert r.lin._forward_hooks is not net.lin._forward_hooks
        assert [n for n, _ in r.named_parameters()] == [n for n, _ in net.named_parameters()]
        r.head.register_forward_hook(lambda m, args, out: out * 0)
        torch.testing.assert_close(r.eval()(x), torch.zeros(3, 3))
    assert len(net.head._forward_hooks) == 0 and len(net.lin._forward_hooks) == 1
