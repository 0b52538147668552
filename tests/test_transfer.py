"""Coalesced host-device copies (:mod:`treegather._compiled.transfer`) and scatter's use of them.

The copies are for CPU batches going to CUDA devices; the packing works between any devices, so
it is tested here on the CPU (and on a GPU by the CUDA-marked test when one is present).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import treegather as tg
from treegather import _caches, _compiled
from treegather._compiled import transfer as _transfer
from treegather._compiled.transfer import SMALL_BYTES, coalesced_to

CPU = torch.device("cpu")


def _mixed() -> list[torch.Tensor]:
    big = torch.randn(SMALL_BYTES // 4 + 1)  # just over the packing threshold
    return [
        torch.randn(3, 4),
        torch.arange(5),
        torch.tensor(2.5),
        torch.zeros(0, 3),
        torch.ones(2, 2, dtype=torch.bool),
        torch.randn(4, 3).t(),  # not contiguous: moved on its own
        torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),  # keeps its format
        torch.randn(6, dtype=torch.float16),
        big,
    ]


def test_coalesced_copies_equal_to() -> None:
    xs = _mixed()
    ys = coalesced_to(xs, CPU)
    for x, y in zip(xs, ys, strict=True):
        ref = x.to(CPU, copy=True)
        assert y.dtype == ref.dtype and y.shape == ref.shape and y.stride() == ref.stride()
        assert (torch.equal(y, ref) and y.data_ptr() != x.data_ptr()) or x.numel() == 0
    # the small contiguous float32 ones share one buffer; the rest do not
    storage = ys[0].untyped_storage().data_ptr()
    assert ys[2].untyped_storage().data_ptr() == storage
    assert all(y.untyped_storage().data_ptr() != storage for y in (ys[1], ys[5], ys[6], ys[8]))


def test_tracked_tensors_get_copies_of_their_own() -> None:
    # Differentiable as .to(), and modifiable in place (a view of a split output is not).
    a = torch.randn(3, 2, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    ya, yb, yc = coalesced_to([a * 2, b[1:], torch.ones(2)], CPU)
    assert ya.grad_fn is not None and yb.grad_fn is not None and yc._base is not None
    yb.mul_(3)
    (ya.sum() + yb.sum()).backward()
    assert torch.equal(a.grad, torch.full((3, 2), 2.0))  # type: ignore[arg-type]
    assert torch.equal(b.grad, torch.tensor([0.0, 3.0, 3.0, 3.0]))  # type: ignore[arg-type]
    with torch.no_grad():  # not tracked: packed with the others
        ya, yc = coalesced_to([a, torch.ones(2)], CPU)
    assert ya.untyped_storage().data_ptr() == yc.untyped_storage().data_ptr()


def _batch() -> dict[str, Any]:
    return {
        "x": torch.randn(10, 3, requires_grad=True),
        "ids": torch.arange(10),
        "nested": [torch.ones(10, 2, dtype=torch.float64), {"m": torch.zeros(10, 1, 4)}],
    }


def test_a_scatter_that_moves_pieces_gives_the_reference_shards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compiled scatter of a CPU batch to CUDA devices, run here with CPU devices standing
    in: one coalesced copy call per device, the same shards as the reference."""
    calls: list[int] = []
    real = _transfer.coalesced_to

    def counted(tensors: Any, device: torch.device) -> Any:
        calls.append(len(tensors))
        return real(tensors, device)

    monkeypatch.setattr(_compiled, "coalesced_to", counted)
    batch = _batch()
    devs = (CPU,) * 3
    for _ in range(_compiled.COMPILE_AFTER + 1):
        leaves, st, _ = _compiled.recognise(batch)
    assert st is not None
    shards = _compiled._scatter_cpu_tensors(leaves, st, devs, 0, move=True)
    assert shards is not None and calls == [4, 4, 4]
    with _caches.reference_only():
        expected = tg.scatter(batch, ["cpu"] * 3)
    assert shards.sizes == expected.sizes == (4, 3, 3)
    for got, want in zip(shards, expected, strict=True):
        for g, w in zip(tg._tree.flatten(got)[0], tg._tree.flatten(want)[0], strict=True):
            assert torch.equal(g, w) and g.dtype == w.dtype
    sum(s["x"].sum() for s in shards).backward()
    assert torch.equal(batch["x"].grad, torch.ones(10, 3))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scatter_to_cuda_and_gather_back_use_coalesced_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = _transfer.coalesced_to
    monkeypatch.setattr(
        _compiled, "coalesced_to", lambda ts, d: calls.append(len(ts)) or real(ts, d)
    )
    batch = {f"k{i}": torch.randn(8, 4) for i in range(50)}
    devices = ["cuda:0"] * 2
    for _ in range(_compiled.COMPILE_AFTER + 2):
        shards = tg.scatter(batch, devices)
    assert calls and all(n == 50 for n in calls)
    for r, shard in enumerate(shards):
        for key, x in batch.items():
            assert shard[key].device.type == "cuda"
            assert torch.equal(shard[key].cpu(), x.tensor_split(2)[r])
    for _ in range(_compiled.COMPILE_AFTER + 2):  # and back to the host, coalesced per replica
        back = tg.gather(list(shards), "cpu")
    assert all(torch.equal(back[key], x) for key, x in batch.items())


def test_gather_of_gpu_replicas_to_the_host_cats_coalesced_copies() -> None:
    """What gather does for replicas on GPUs and a CPU target (run here on CPU replicas): each
    replica's leaves copied in one call, then one cat per leaf, equal to the reference."""
    outs = [{"a": torch.randn(2, 3), "b": [torch.arange(2), torch.ones(2, 1)]} for _ in range(3)]
    columns = list(zip(*[tg._tree.flatten(o)[0] for o in outs]))
    got = _compiled._cat_on_host(columns, CPU, 0)
    with _caches.reference_only():
        want = tg._tree.flatten(tg.gather(outs, "cpu"))[0]
    assert all(torch.equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want, strict=True))
    assert torch.equal(_compiled._cat_on_host(columns[:1], CPU, 1)[0], torch.cat(columns[0], 1))
