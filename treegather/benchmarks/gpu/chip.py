"""The GPU check's stages in this process, on the plan's device repeated (``cuda:0`` x 2, or
the CPU's in the dry run): scatter/gather round trips, the copies they make, training steps.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import treegather as tg
from treegather._parallel.apply import Backend

from .. import steps
from ..architectures import available
from ..cases import nested_tree, transfer_impls
from ..timing import _compare, prepare_allocator
from .plan import Found, Plan, Row, StageFailed, StageSkipped

__all__ = ["copies", "scatter_gather", "training_steps"]

Impls = dict[str, dict[str, Callable[[], Any]]]

HOST = torch.device("cpu")
LABELS = {"floor": "per-leaf .to()", "treegather": "treegather", "recursion": "torch"}
"""The implementations of :func:`~treegather.benchmarks.cases.transfer_impls`, as the table
names them ("recursion" is torch's own ``scatter_gather``)."""


def _round_trips(plan: Plan) -> list[tuple[int, Impls, dict[str, str]]]:
    """Per leaf count: the implementations of a CPU batch's trip to the devices and back
    (each result checked), and why torch's refused an op (those left out)."""
    devices = [torch.device(plan.device)] * plan.replicas
    trips = []
    for n in plan.leaves:
        tree = nested_tree(n, (8 * plan.replicas, 4))
        impls = transfer_impls(tree, devices, list(tg.scatter(tree, devices)), HOST)
        trips.append((n, impls, _checked(tree, devices, impls)))
    return trips


def _checked(tree: Any, devices: Sequence[torch.device], impls: Impls) -> dict[str, str]:
    """Run each implementation once and check treegather's and torch's results against the
    batch; torch's, where it refuses the devices, is left out (the reason kept, per op)."""
    refused: dict[str, str] = {}
    leaves = tg._tree.flatten(tree)[0]
    k = len(devices)
    for op, fns in impls.items():
        for name in list(fns):
            try:
                got = fns[name]()
            except Exception as e:
                if name != "recursion":
                    raise
                del fns[name]
                refused[op] = f"{type(e).__name__}: {e}"
                continue
            who = f"{LABELS[name]}'s {op}"
            if name == "floor":
                continue
            if op == "gather":
                _same(tg._tree.flatten(got)[0], leaves, HOST, who)
                continue
            shards = list(got)
            if len(shards) != k:
                raise StageFailed(f"{who}: {len(shards)} shards for {k} devices")
            for r, shard in enumerate(shards):
                want = [x.tensor_split(k)[r] for x in leaves]
                _same(tg._tree.flatten(shard)[0], want, devices[r], f"{who}, shard {r}")
    return refused


def _same(got: list[Any], want: list[torch.Tensor], device: torch.device, who: str) -> None:
    if len(got) != len(want):
        raise StageFailed(f"{who}: {len(got)} leaves, the batch has {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(g, torch.Tensor) or g.device != device:
            raise StageFailed(f"{who}: leaf {i} is {g!r:.80}, expected a tensor on {device}")
        if not torch.equal(g.cpu(), w):
            raise StageFailed(f"{who}: leaf {i} differs from the batch's")


def scatter_gather(plan: Plan, out: Path) -> Found:
    """A CPU batch of 10, 100 and 1000 ``[8K, 4]`` leaves scattered onto the devices and the
    shards gathered back to the CPU: per-leaf ``.to()``, treegather and torch's own
    ``scatter``/``gather`` (where they accept the devices), timed side by side."""
    prepare_allocator()
    clock = time.perf_counter if plan.cuda else time.thread_time
    rows: list[Row] = []
    refused: dict[str, str] = {}
    for n, impls, why in _round_trips(plan):
        refused |= why
        for op, fns in impls.items():
            found = _compare(fns, "floor", plan.rounds, plan.target_s, clock)
            peer = found.get("recursion")
            rows.append(
                {
                    "op": op,
                    "leaves": n,
                    "per-leaf .to() us": found["floor"][0] * 1e6,
                    "treegather us": found["treegather"][0] * 1e6,
                    "treegather / per-leaf .to()": found["treegather"][1],
                    "torch us": None if peer is None else peer[0] * 1e6,
                    "torch / per-leaf .to()": None if peer is None else peer[1],
                }
            )
    where = f"{plan.device} x {plan.replicas}"
    notes = [
        f"a CPU batch onto {where} and back to the CPU; [{8 * plan.replicas}, 4] float32 "
        f"leaves; median of {plan.rounds} interleaved rounds, ratios the medians of per-round "
        f"ratios; {'wall time, each call waiting for the device' if plan.cuda else 'CPU time'}"
    ]
    notes += [
        f"torch's {op} not run: it refused the devices ({why})" for op, why in refused.items()
    ]
    last = [r for r in rows if r["leaves"] == max(plan.leaves)]
    summary = f"treegather / per-leaf .to() at {max(plan.leaves)} leaves: " + ", ".join(
        f"{r['op']} {r['treegather / per-leaf .to()']:.2f}x" for r in last
    )
    return Found(rows, summary, notes)


HTOD = re.compile(r"HtoD|H2D|HostToDevice")
DTOH = re.compile(r"DtoH|D2H|DeviceToHost")


def copies(plan: Plan, out: Path) -> Found:
    """The host-to-device and device-to-host copies of one warm call of each round trip's
    implementation, as ``torch.profiler`` sees them (CUDA only)."""
    if not plan.cuda:
        raise StageSkipped(
            "needs CUDA: it counts torch.profiler's host-to-device and device-to-host memcpys, "
            "which repeated CPU devices do not make"
        )
    from torch.profiler import ProfilerActivity, profile

    rows: list[Row] = []
    for n, impls, _ in _round_trips(plan):
        for op, fns in impls.items():
            for name, fn in fns.items():
                for _ in range(6):  # warm: past the compiled layer's COMPILE_AFTER sightings
                    fn()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    fn()
                names = [e.name for e in prof.events()]
                rows.append(
                    {
                        "op": op,
                        "leaves": n,
                        "impl": LABELS[name],
                        "host-to-device copies": sum(bool(HTOD.search(x)) for x in names),
                        "device-to-host copies": sum(bool(DTOH.search(x)) for x in names),
                    }
                )
    per_leaf = [r for r in rows if r["op"] == "scatter" and r["impl"] == LABELS["floor"]]
    if any(r["host-to-device copies"] == 0 for r in per_leaf):
        raise StageFailed(
            "the profiler saw no host-to-device copy in per-leaf .to()'s scatter: its counts "
            "cannot be trusted (no CUDA activity recorded: is CUPTI available?)",
            rows,
        )
    top = max(plan.leaves)
    counts = {
        r["impl"]: r["host-to-device copies"]
        for r in rows
        if r["op"] == "scatter" and r["leaves"] == top
    }
    summary = f"host-to-device copies of one scatter of {top} leaves: " + ", ".join(
        f"{impl} {count}" for impl, count in counts.items()
    )
    notes = [
        f"one warm call each (after six: the compiled path), {plan.device} x {plan.replicas}; "
        "copies are the profiler's Memcpy HtoD / DtoH events"
    ]
    return Found(rows, summary, notes)


MODELS = {
    "bert12": "BERT, {bert_layers} layers (hidden 32)",
    "llama": "Llama, 2 layers (tiny config)",
}


def training_steps(plan: Plan, out: Path) -> Found:
    """A data-parallel training step of the 12-layer BERT and a tiny transformers model:
    kept and fresh replicas against the same shards through the module on the device, and
    ``torch.nn.DataParallel`` where it runs; every way's gradients checked against the floor's
    first (eval mode: no dropout)."""
    if not available():
        raise StageSkipped(
            "transformers is not installed: the 12-layer BERT and the tiny transformers model "
            "are built from its configs"
        )
    k = plan.replicas
    backend: Backend = "auto" if plan.cuda else "serial"
    rows: list[Row] = []
    notes = [
        f"one forward + backward per step of a batch of {plan.step_batch} from the CPU on "
        f"{plan.device} x {k}; floor: the same shards, already on {plan.device}, through the "
        f"module one after the other; median of {plan.step_rounds} interleaved rounds; "
        f"data_parallel backend {backend!r}"
    ]
    if not plan.cuda:
        notes.append(
            "torch.nn.DataParallel not run: it needs CUDA devices (on the CPU it is a plain call)"
        )
    for name in plan.step_models:
        agree = steps.check_gradients(
            name,
            k,
            device=plan.device,
            batch=plan.step_batch,
            backend=backend,
            bert_layers=plan.bert_layers,
            bert_vocab=plan.bert_vocab,
        )
        case = steps.run_steps(
            [name],
            [k],
            batch=plan.step_batch,
            rounds=plan.step_rounds,
            target_s=plan.step_target_s,
            bert_layers=plan.bert_layers,
            bert_vocab=plan.bert_vocab,
            device=plan.device,
            backend=backend,
        )
        by_impl = {r["impl"]: r for r in case}
        row: Row = {
            "model": MODELS.get(name, name).format(bert_layers=plan.bert_layers),
            "K": k,
            "floor ms": by_impl["floor"]["median_ms"],
        }
        for impl, label in (
            ("data_parallel", "kept replicas"),
            ("fresh", "fresh replicas"),
            ("DataParallel", "torch DataParallel"),
        ):
            got = by_impl.get(impl, {})
            row[f"{label} ms"] = got.get("median_ms")
            row[f"{label} / floor"] = got.get("ratio")
            if "error" in got:
                notes.append(f"torch.nn.DataParallel on {name} did not run: {got['error']}")
        row["gradients = floor's (ways)"] = ", ".join(agree)
        row["largest grad difference"] = max(agree.values())
        rows.append(row)
    summary = "; ".join(
        f"{r['model']}: kept {r['kept replicas / floor']:.2f}x, fresh {r['fresh replicas / floor']:.2f}x"
        for r in rows
    )
    return Found(rows, summary, notes)
