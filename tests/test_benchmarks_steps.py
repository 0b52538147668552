"""The step benchmark runs end to end in seconds (tiny models), and its three ways do the same work."""

from __future__ import annotations

import pytest
import torch

from treegather.benchmarks import steps


def test_run_steps_smoke() -> None:
    pytest.importorskip("transformers")
    rows = steps.run_steps(
        ["bert12", "mlp50"],
        [2],
        rounds=1,
        target_s=0.001,
        bert_layers=1,
        bert_vocab=50,
        mlp_layers=2,
    )
    assert {(r["model"], r["impl"]) for r in rows} == {
        (m, i) for m in ("bert12", "mlp50") for i in ("floor", "data_parallel", "fresh")
    }
    assert all(r["median_ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert all(r["ratio"] == 1.0 for r in rows if r["impl"] == "floor")


@pytest.mark.parametrize("k", [2, 3])
def test_the_three_ways_compute_the_same_gradients(k: int) -> None:
    torch.manual_seed(0)
    model = steps._mlp(3, 8)
    fns = steps._steps("mlp50", model, 10, k)
    grads = []
    for fn in fns.values():
        fn()
        grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b)


def test_the_transformers_architectures_are_a_table_of_their_own() -> None:
    """Every architecture of the conformance tests is one entry; a step of one runs, and its
    three ways compute the same gradients (the model's own loss, gathered by its layout)."""
    pytest.importorskip("transformers")
    from treegather.benchmarks.architectures import ARCHITECTURES

    assert {"bert", "gpt2", "llama", "t5", "vit", "wav2vec2", "clip", "bart"} <= set(ARCHITECTURES)
    rows = steps.run_steps(["wav2vec2"], [2], batch=4, rounds=1, target_s=0.001)
    assert {r["impl"] for r in rows} == {"floor", "data_parallel", "fresh"}
    model = ARCHITECTURES["bert"].build().eval()  # (no dropout: the three ways agree)
    fns = steps._steps("bert", model, 5, 3)
    grads = []
    for fn in fns.values():
        fn()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for other in grads[1:]:
        assert len(other) == len(grads[0])
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b)


def test_the_torch_data_parallel_way_computes_the_floor_gradients() -> None:
    """The GPU check's fourth way, ``torch.nn.DataParallel`` (on CUDA devices there; a plain
    call of the module without CUDA, which is what runs here): its step is wired like the
    others (the batch, the model's own loss), so its gradients are the floor's."""
    pytest.importorskip("transformers")
    if torch.cuda.is_available():
        pytest.skip("checks the plain call DataParallel makes without CUDA")
    for name in ("mlp50", "llama"):
        found = steps.check_gradients(name, 2, batch=4, torch_dp=True, mlp_layers=3)
        assert sorted(found) == ["DataParallel", "data_parallel", "fresh"]
        assert all(diff < 1e-4 for diff in found.values())


def test_the_small_models_run_and_their_ways_compute_the_floor_gradients() -> None:
    """Every small model of the step benchmark (a conv net with BatchNorm, an MLP with
    LayerNorm and Dropout, an LSTM) is a named case whose ways compute the floor's gradients,
    and a step of one is timed."""
    from treegather.benchmarks.small import SMALL

    assert {"convbn", "mlp_ln", "lstm"} <= set(SMALL)
    for name in SMALL:
        found = steps.check_gradients(name, 2, batch=6)
        assert sorted(found) == ["data_parallel", "fresh"]
        assert all(diff < 1e-4 for diff in found.values()), (name, found)
    rows = steps.run_steps(["convbn"], [3], batch=7, rounds=1, target_s=0.001)
    assert {r["impl"] for r in rows} == {"floor", "data_parallel", "fresh"}
