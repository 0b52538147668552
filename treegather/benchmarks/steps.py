"""The step benchmark: a data-parallel training step against the same shards run directly.

``python -m treegather.benchmarks.steps`` prints one row per (model, K). Each round times, back to
back with the order rotated, three ways to run one forward + backward step of a batch split
into K shards on ``["cpu"] * K`` (serial backend, one intra-op thread):

- ``floor``: the K shards through the module itself, one after the other, each loss weighted by
  its shard's share of the batch (no scatter, replication or gather: the work any data-parallel
  step must do);
- ``data_parallel``: :func:`treegather.data_parallel` with its kept replicas (issue 14);
- ``fresh``: the same call with the kept replicas dropped before each step (replicas rebuilt
  every step, as ``torch.nn.DataParallel`` does);
- ``DataParallel``: ``torch.nn.DataParallel`` over the same devices, where they are CUDA
  devices (:func:`run_steps` with ``device="cuda:0"``, as the GPU check runs it: the model on
  the chip, the batch from the CPU, the floor's shards on the chip; wall time, each step
  waiting for the device).

Models: a 12-layer tiny BERT (``BertConfig(hidden_size=32, num_hidden_layers=12,
num_attention_heads=2, intermediate_size=37)``, needs ``transformers``), a 50-layer MLP and the
small models of :mod:`treegather.benchmarks.small` (a conv net with BatchNorm, an MLP with
LayerNorm and Dropout, an LSTM: ``convbn``, ``mlp_ln``, ``lstm``; ``--quick`` and the default
run); with ``--transformers``, every architecture of the
transformers conformance tests (:mod:`treegather.benchmarks.architectures`: 2 layers, hidden
size 32, each model's own loss from ``labels``, gathered as the tests gather it), whose step
shows treegather's fixed cost. Each ratio is the median over rounds of (time / floor time in the same round), as in
:mod:`treegather.benchmarks.scatter_gather`; times are CPU time of this thread with the garbage collector off
(one collection before each round).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import treegather as tg
from treegather._parallel.apply import Backend
from treegather._parallel.kept import _KEPT

from .architectures import ARCHITECTURES, available
from .small import SMALL
from .timing import prepare_allocator

__all__ = ["run_steps", "check_gradients", "main"]

Step = Callable[[], Any]


def _time(fn: Step, reps: int, clock: Callable[[], float] = time.thread_time) -> float:
    """Seconds of ``clock`` per call (by default CPU seconds of this thread), garbage
    collector off (collect once per round)."""
    gc.disable()
    try:
        t0 = clock()
        for _ in range(reps):
            fn()
        return (clock() - t0) / reps
    finally:
        gc.enable()


def _mlp(layers: int, width: int) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def _bert(layers: int, vocab: int) -> nn.Module | None:
    try:
        from transformers import BertConfig, BertModel
    except ImportError:
        return None
    config = BertConfig(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=37,
        vocab_size=vocab,
    )
    return BertModel(config)


def _steps(
    name: str,
    model: nn.Module,
    batch: int,
    k: int,
    *,
    device: str = "cpu",
    backend: Backend = "serial",
    torch_dp: bool | None = None,
) -> dict[str, Step]:
    """The step functions for one model (on ``device``) and K (each: zero grads, forward,
    backward): the three ways, and with ``torch_dp`` (by default on CUDA)
    ``torch.nn.DataParallel`` too (without CUDA, a plain call of the module). On CUDA each step
    waits for the device."""
    cuda = torch.device(device).type == "cuda"
    devices = [device] * k
    gen = torch.Generator().manual_seed(0)
    out_layout: Any = None
    summed = False
    if name in ARCHITECTURES:  # the model's own loss, gathered as the conformance tests do
        arch = ARCHITECTURES[name]
        kwargs = arch.batch(gen, batch)
        out_layout = arch.out_layout()
        summed = arch.reduce == "sum"

        def loss_of(out: Any) -> torch.Tensor:
            return out.loss

        args: tuple[Any, ...] = ()
    elif name.startswith("bert"):
        vocab: int = getattr(model, "config").vocab_size  # noqa: B009 - a transformers model
        ids = torch.randint(0, vocab, (batch, 16), generator=gen)
        kwargs = {"input_ids": ids}

        def loss_of(out: Any) -> torch.Tensor:
            return out.last_hidden_state.pow(2).mean()

        args = ()
    elif name in SMALL:
        kwargs = {}
        args = (SMALL[name].batch(gen, batch),)

        def loss_of(out: Any) -> torch.Tensor:
            return out.pow(2).mean()

    else:
        kwargs = {}
        width: int = next(model.parameters()).shape[1]
        args = (torch.randn(batch, width, generator=gen),)

        def loss_of(out: Any) -> torch.Tensor:
            return out.pow(2).mean()

    arg_shards, kwarg_shards = tg.scatter_kwargs(args, kwargs, devices)
    weights = [1.0 if summed else n / batch for n in arg_shards.sizes or [batch]]

    def floor() -> None:
        model.zero_grad(set_to_none=True)
        loss = sum(
            loss_of(model(*a, **kw)) * w for a, kw, w in zip(arg_shards, kwarg_shards, weights)
        )
        loss.backward()  # type: ignore[union-attr]

    def data_parallel() -> None:
        model.zero_grad(set_to_none=True)
        out = tg.data_parallel(
            model, args, devices, module_kwargs=kwargs, out_layout=out_layout, backend=backend
        )
        loss_of(out).backward()

    def fresh() -> None:
        _KEPT.pop(model)
        data_parallel()

    fns: dict[str, Step] = {"floor": floor, "data_parallel": data_parallel, "fresh": fresh}
    if torch_dp is None:
        torch_dp = cuda
    if torch_dp:
        fns["DataParallel"] = _torch_data_parallel(model, device, k, args, kwargs, loss_of, summed)
    return {impl: _synced(fn) for impl, fn in fns.items()} if cuda else fns


def _torch_data_parallel(
    model: nn.Module,
    device: str,
    k: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_of: Callable[[Any], torch.Tensor],
    summed: bool,
) -> Step:
    """A step through ``torch.nn.DataParallel`` over ``device`` repeated ``k`` times."""
    index = torch.device(device).index or 0
    wrapped: list[nn.Module] = []  # (made at the first step: where it fails, the step does)

    def data_parallel_torch() -> None:
        if not wrapped:
            wrapped.append(nn.DataParallel(model, device_ids=[index] * k))
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # (torch's gather of 0-dim losses warns each call)
            warnings.simplefilter("ignore", UserWarning)
            out = wrapped[0](*args, **kwargs)
        loss = loss_of(out)
        # torch gathers the shards' losses into a vector (the shards are even: batch % k == 0)
        (loss if loss.dim() == 0 else loss.sum() if summed else loss.mean()).backward()

    return data_parallel_torch


def _synced(fn: Step) -> Step:
    def run() -> None:
        fn()
        torch.cuda.synchronize()

    return run


def check_gradients(
    name: str,
    k: int,
    *,
    device: str = "cpu",
    batch: int = 16,
    backend: Backend = "serial",
    bert_layers: int = 12,
    bert_vocab: int = 30522,
    mlp_layers: int = 50,
    mlp_width: int = 32,
    torch_dp: bool | None = None,
) -> dict[str, float]:
    """Run one step each way on ``name`` (built as :func:`run_steps` builds it, in eval mode:
    no dropout) and check that every way's gradients are the floor's.

    Returns each way's largest absolute difference from the floor's gradients. A way that
    fails to run is left out (``torch.nn.DataParallel`` where it does not run: :func:`run_steps`
    says why); gradients that differ are an ``AssertionError`` naming the way and parameter.
    ``torch_dp`` as for ``_steps`` (by default on CUDA).

    >>> sorted(check_gradients("mlp50", 2, batch=6))
    ['data_parallel', 'fresh']
    """
    model = _model(name, bert_layers, bert_vocab, mlp_layers, mlp_width)
    if model is None:
        raise ImportError(f"{name} needs transformers")
    model.eval().to(device)
    fns = _steps(name, model, batch, k, device=device, backend=backend, torch_dp=torch_dp)
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for impl, fn in fns.items():
        try:
            fn()
        except Exception:
            if impl != "DataParallel":
                raise
            continue
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    floor = grads.pop("floor")
    found = {}
    for impl, got in grads.items():
        if got.keys() != floor.keys():
            raise AssertionError(f"{impl}: gradients of {sorted(got.keys() ^ floor.keys())} differ")
        for param, g in got.items():
            try:
                torch.testing.assert_close(g, floor[param], rtol=1e-3, atol=1e-5)
            except AssertionError as e:
                raise AssertionError(
                    f"{impl}: the gradient of {param} is not the floor's: {e}"
                ) from e
        found[impl] = max(((g - floor[n]).abs().max().item() for n, g in got.items()), default=0.0)
    return found


def _model(name: str, bert_layers: int, bert_vocab: int, mlp_layers: int, mlp_width: int) -> Any:
    """A freshly built model for ``name`` (seeded), or None when it needs transformers."""
    torch.manual_seed(0)
    if name in SMALL:
        return SMALL[name].build()
    if name in ARCHITECTURES:
        return ARCHITECTURES[name].build() if available() else None
    if name.startswith("bert"):
        return _bert(bert_layers, bert_vocab)
    return _mlp(mlp_layers, mlp_width)


def run_steps(
    models: Sequence[str] = ("bert12", "mlp50"),
    ks: Sequence[int] = (2, 4),
    *,
    batch: int = 16,
    rounds: int = 9,
    target_s: float = 0.2,
    bert_layers: int = 12,
    bert_vocab: int = 30522,
    mlp_layers: int = 50,
    mlp_width: int = 32,
    device: str = "cpu",
    backend: Backend = "serial",
) -> list[dict[str, Any]]:
    """Time the step functions per model and K; one row per (model, K, implementation).

    >>> rows = run_steps(["mlp50"], [2], rounds=1, target_s=0.001, mlp_layers=2)
    >>> sorted(r["impl"] for r in rows), rows[0]["model"]
    (['data_parallel', 'floor', 'fresh'], 'mlp50')

    ``models`` are ``bert12``, ``mlp50``, the names of
    :data:`~treegather.benchmarks.small.SMALL` and those of
    :data:`~treegather.benchmarks.architectures.ARCHITECTURES`.
    Runs with one intra-op thread (restored on return). ``bert12`` and the architectures are
    skipped (no rows) when ``transformers`` is not installed. Smaller
    ``bert_layers``, ``bert_vocab`` (BERT's default: 30522) and ``mlp_layers`` make a quick
    smoke run. With a CUDA ``device`` (replicas on ``[device] * K``) the model lives there,
    times are wall seconds of steps that wait for the device, and ``torch.nn.DataParallel``
    is timed too; where it does not run, its row holds ``error`` (the exception) instead of
    times. ``backend`` is ``data_parallel``'s.
    """
    prepare_allocator()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the benchmark's setting; restored on return
    try:
        sizes = (bert_layers, bert_vocab, mlp_layers, mlp_width)
        return _run_steps(models, ks, batch, rounds, target_s, sizes, device, backend)
    finally:
        torch.set_num_threads(threads)


def _run_steps(
    models: Sequence[str],
    ks: Sequence[int],
    batch: int,
    rounds: int,
    target_s: float,
    sizes: tuple[int, int, int, int],
    device: str,
    backend: Backend,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    clock = time.perf_counter if torch.device(device).type == "cuda" else time.thread_time
    for name in models:
        model = _model(name, *sizes)
        if model is None:
            continue
        model.train().to(device)
        for k in ks:
            fns = _steps(name, model, batch, k, device=device, backend=backend)
            for impl, fn in list(fns.items()):  # warm up: kept replicas, scatter/gather caches
                try:
                    for _ in range(3):
                        fn()
                except Exception as e:
                    if impl != "DataParallel":  # (torch's, where it runs)
                        raise
                    del fns[impl]
                    error = f"{type(e).__name__}: {e}"
                    rows.append({"model": name, "replicas": k, "impl": impl, "error": error})
            reps = max(1, int(target_s / max(_time(fns["floor"], 2, clock), 1e-7)))
            samples: dict[str, list[float]] = {impl: [] for impl in fns}
            names = list(fns)
            for r in range(rounds):
                gc.collect()
                for impl in names[r % len(names) :] + names[: r % len(names)]:
                    samples[impl].append(_time(fns[impl], reps, clock))
            for impl, ts in samples.items():
                ratios = [t / f for t, f in zip(ts, samples["floor"])]
                rows.append(
                    {
                        "model": name,
                        "replicas": k,
                        "impl": impl,
                        "batch": batch,
                        "median_ms": statistics.median(ts) * 1e3,
                        "ratio": statistics.median(ratios),
                    }
                )
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the step benchmark and print the table (``python -m treegather.benchmarks.steps --help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m treegather.benchmarks.steps", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    parser.add_argument("--json", metavar="PATH", help="save the rows as JSON")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 9)")
    parser.add_argument(
        "--transformers",
        action="store_true",
        help="the architectures of the transformers conformance tests (K = 2, 3) instead",
    )
    parser.add_argument(
        "--models", metavar="NAMES", help="comma-separated model names (default: the table's)"
    )
    parser.add_argument(
        "--replicas",
        metavar="KS",
        help="comma-separated K values (default 2,4; 2,3 --transformers)",
    )
    parser.add_argument("--batch", type=int, help="rows per step (default 16; 8 --transformers)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rounds = args.rounds or (5 if args.quick else 9)
    target_s = 0.1 if args.quick else 0.2
    names = list(ARCHITECTURES) if args.transformers else ["bert12", "mlp50", *SMALL]
    if args.models:
        names = args.models.split(",")
    ks: tuple[int, ...] = (2, 3) if args.transformers else (2, 4)
    if args.replicas:
        ks = tuple(int(k) for k in args.replicas.split(","))
    batch = args.batch or (8 if args.transformers else 16)
    print(
        f"treegather {tg.__version__}, torch {torch.__version__}, python "
        f"{platform.python_version()}; CPU x K ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores), serial backend; 1 intra-op thread; batch {batch}; "
        f"median of {rounds} interleaved rounds; forward + backward per step"
    )
    print(f"{'model':10} {'K':>2} | {'floor ms':>9} {'data_parallel':>17} {'fresh replicas':>17}")
    rows: list[dict[str, Any]] = []
    for name in names:
        for k in ks:
            case = run_steps([name], [k], batch=batch, rounds=rounds, target_s=target_s)
            if not case:
                print(f"{name:10} {k:>2} | skipped: transformers is not installed", file=sys.stderr)
                continue
            rows.extend(case)
            r = {row["impl"]: row for row in case}
            print(
                f"{name:10} {k:>2} | {r['floor']['median_ms']:>9.2f} "
                f"{r['data_parallel']['median_ms']:>9.2f} {r['data_parallel']['ratio']:>5.2f}x "
                f"{r['fresh']['median_ms']:>9.2f} {r['fresh']['ratio']:>5.2f}x",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
