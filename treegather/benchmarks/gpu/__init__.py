"""The GPU check: ``python -m treegather.benchmarks.gpu OUT_DIR [--cpu]``.

One prepared command for a machine with one CUDA device, reached briefly: in at most six
minutes it runs, on ``cuda:0`` repeated twice (standing in for two GPUs, as repeated CPU
devices do in the tests),

1. ``tests``: every ``cuda``-marked test and the rest of the suite's fast tests (those marked
   neither ``distributed``, ``notebook`` nor ``transformers``), with pytest in a subprocess
   under a time limit (:mod:`.suite`);
2. ``scatter_gather``: a CPU batch of 10, 100 and 1000 leaves scattered onto the devices and
   gathered back to the CPU, treegather against per-leaf ``.to()`` and torch's own
   ``scatter``/``gather`` (where they accept the devices), timed side by side (:mod:`.chip`);
3. ``copies``: the host-to-device (and device-to-host) copies of one call of each, counted by
   ``torch.profiler``;
4. ``steps``: a ``data_parallel`` training step of the 12-layer benchmark BERT and of a tiny
   Llama (from a tiny config: no download), kept and fresh replicas, against the same shards
   through the module on the chip, and ``torch.nn.DataParallel`` where it runs; gradients
   checked against the floor's;
5. ``distributed``: ``tgd.all_gather`` (with and without ``sync_grads``) and a ``Collector``
   evaluation with CUDA tensors on two gloo ranks sharing the chip (:mod:`.ranks`).

It writes ``gpu.md`` (one Markdown table per stage, after a summary) and ``gpu.json`` (the
same, as data) to ``OUT_DIR`` after every stage, and exits with 1 when a stage failed (2
without CUDA and without ``--cpu``). A stage that cannot run there (an optional package
missing) is reported as skipped, with the reason.

``--cpu`` is the dry run: every stage on repeated CPU devices, small and short (the test stage
runs the cuda-marked tests of two files, which skip, and a few device checks), the stages that
need CUDA reported as skipped with the reason; the test suite runs it
(``tests/test_benchmarks_gpu.py``), so the command cannot rot unseen. ``--stages`` runs some
stages only.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import treegather as tg

from . import chip, ranks, suite
from .plan import DRY_RUN, ON_CHIP, ROOT, Found, Plan, StageFailed, StageSkipped

__all__ = ["STAGES", "Stage", "format_table", "main", "run"]


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: its title in the table, and what runs it."""

    title: str
    run: Callable[[Plan, Path], Found]


STAGES: dict[str, Stage] = {
    "tests": Stage(
        "every cuda-marked test and the suite's fast tests (pytest, in a subprocess)",
        suite.run_tests,
    ),
    "scatter_gather": Stage(
        "scatter of a CPU batch onto the devices and gather back, against per-leaf .to() and "
        "torch's scatter/gather",
        chip.scatter_gather,
    ),
    "copies": Stage("host-to-device copies of one call, counted by torch.profiler", chip.copies),
    "steps": Stage(
        "a data_parallel training step: kept and fresh replicas, the floor, torch DataParallel",
        chip.training_steps,
    ),
    "distributed": Stage(
        "tgd.all_gather (with and without sync_grads) and a Collector evaluation on 2 gloo ranks",
        ranks.distributed,
    ),
}

JSON_NAME, TABLE_NAME = "gpu.json", "gpu.md"


def run(
    out_dir: str | os.PathLike[str],
    *,
    cpu: bool = False,
    stages: Sequence[str] | None = None,
    test_timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run the stages (all by default) and write ``gpu.md`` and ``gpu.json`` to ``out_dir``
    (after every stage). Returns what ``gpu.json`` holds: ``ok`` (no stage failed),
    ``environment``, ``seconds`` and ``stages`` (each: ``name``, ``title``, ``status`` (ok,
    failed, skipped), ``reason`` (why it skipped or failed), ``summary``, ``seconds``,
    ``rows`` and ``notes``; ``traceback`` for an unexpected error)."""
    plan = DRY_RUN if cpu else ON_CHIP
    if test_timeout_s is not None:
        plan = dataclasses.replace(plan, test_timeout_s=test_timeout_s)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(stages) if stages is not None else list(STAGES)
    result: dict[str, Any] = {"ok": True, "environment": _environment(plan), "stages": []}
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the benchmarks' setting; restored on return)
    try:
        for name in names:
            # (written first as running: a run that dies in a stage shows which)
            result["stages"].append(_running(name))
            _write(result, out)
            result["stages"][-1] = _run_stage(name, plan, out)
            result["ok"] = all(s["status"] != "failed" for s in result["stages"])
            result["seconds"] = time.perf_counter() - start
            _write(result, out)
    finally:
        torch.set_num_threads(threads)
    return result


def _running(name: str) -> dict[str, Any]:
    said = {"reason": "", "summary": "(running, or the run died here)", "seconds": 0.0}
    entry = {"name": name, "title": STAGES[name].title, "status": "running", **said}
    return {**entry, "rows": [], "notes": []}


def _run_stage(name: str, plan: Plan, out: Path) -> dict[str, Any]:
    stage = STAGES[name]
    entry: dict[str, Any] = {"name": name, "title": stage.title, "reason": "", "summary": ""}
    print(f"[gpu check] {name}: {stage.title} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    try:
        found = stage.run(plan, out)
        status, rows, notes, entry["summary"] = "ok", found.rows, found.notes, found.summary
    except StageSkipped as e:
        status, entry["reason"] = "skipped", str(e)
    except StageFailed as e:
        status, entry["reason"], rows = "failed", str(e), e.rows
    except Exception as e:
        status, entry["reason"] = "failed", f"{type(e).__name__}: {e}"
        entry["traceback"] = traceback.format_exc()
    entry.update(status=status, seconds=time.perf_counter() - start, rows=rows, notes=notes)
    said = entry["reason"] or entry["summary"]
    line = said.splitlines()[0] if said else ""
    print(
        f"[gpu check] {name}: {status} ({entry['seconds']:.1f} s) {line}",
        file=sys.stderr,
        flush=True,
    )
    return entry


def _environment(plan: Plan) -> dict[str, Any]:
    cuda = plan.cuda and torch.cuda.is_available()
    return {
        "mode": "cuda" if plan.cuda else "dry run (--cpu)",
        "devices": f"{plan.device} x {plan.replicas}",
        "device_name": torch.cuda.get_device_name(0)
        if cuda
        else platform.processor() or platform.machine(),
        "treegather": tg.__version__,
        "commit": _commit(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def _write(result: dict[str, Any], out: Path) -> None:
    (out / JSON_NAME).write_text(json.dumps(result, indent=1, default=str))
    (out / TABLE_NAME).write_text(format_table(result) + "\n")


def format_table(result: dict[str, Any]) -> str:
    """:func:`run`'s result as Markdown: a header, one line per stage, then each stage's table.

    >>> result = {"ok": True, "seconds": 1.5, "environment": {"mode": "dry run (--cpu)",
    ...     "devices": "cpu x 2", "device_name": "x86_64", "treegather": "0.1", "commit": None,
    ...     "torch": "2.11", "cuda": None, "python": "3.12", "cpus": 2, "started": "today"},
    ...     "stages": [{"name": "copies", "title": "copies counted", "status": "skipped",
    ...     "reason": "needs CUDA", "summary": "", "seconds": 0.0, "rows": [], "notes": []},
    ...     {"name": "steps", "title": "a step", "status": "ok", "reason": "", "summary": "fine",
    ...     "seconds": 1.25, "rows": [{"model": "m", "ms": 1.234, "torch ms": None}], "notes": ["n"]}]}
    >>> print(format_table(result))
    # treegather GPU check: ok
    <BLANKLINE>
    dry run (--cpu) on cpu x 2 (x86_64); treegather 0.1, torch 2.11 (CUDA none), Python 3.12, 2 CPUs; started today, 1.5 s in all
    <BLANKLINE>
    | stage | status | s | result |
    |---|---|---:|---|
    | copies | skipped | 0.0 | needs CUDA |
    | steps | ok | 1.2 | fine |
    <BLANKLINE>
    ## steps: a step
    <BLANKLINE>
    | model | ms | torch ms |
    |---|---:|---:|
    | m | 1.23 | n/a |
    <BLANKLINE>
    - n
    """
    env = result["environment"]
    commit = f" ({env['commit']})" if env.get("commit") else ""
    lines = [
        f"# treegather GPU check: {_verdict(result)}",
        "",
        f"{env['mode']} on {env['devices']} ({env['device_name']}); treegather "
        f"{env['treegather']}{commit}, torch {env['torch']} (CUDA {env['cuda'] or 'none'}), "
        f"Python {env['python']}, {env['cpus']} CPUs; started {env['started']}, "
        f"{result.get('seconds', 0.0):.1f} s in all",
        "",
        "| stage | status | s | result |",
        "|---|---|---:|---|",
    ]
    for s in result["stages"]:
        said = (s["reason"] or s["summary"]).replace("\n", " ").replace("|", "\\|")
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.1f} | {said[:300]} |")
    for s in result["stages"]:
        if not s["rows"] and not s["notes"]:
            continue
        lines += ["", f"## {s['name']}: {s['title']}", ""]
        if s["rows"]:
            lines += _rows_table(s["rows"])
        if s["notes"]:
            lines += ["", *(f"- {note}" for note in s["notes"])]
    return "\n".join(lines)


def _verdict(result: dict[str, Any]) -> str:
    if any(s["status"] == "running" for s in result["stages"]):
        return "unfinished"
    return "ok" if result["ok"] else "FAILED"


def _rows_table(rows: list[dict[str, Any]]) -> list[str]:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    numeric = [
        all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in columns
    ]
    lines = [
        "| " + " | ".join(_cell(c) for c in columns) + " |",
        "|" + "".join("---:|" if n else "---|" for n in numeric),
    ]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    return lines


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.01:
            return f"{value:.1e}"
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value).replace("|", "\\|")


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (``python -m treegather.benchmarks.gpu --help``): 0 when no stage
    failed, 1 otherwise, 2 for a usage error (CUDA asked for and not available)."""
    parser = argparse.ArgumentParser(
        prog="python -m treegather.benchmarks.gpu",
        description="The GPU check on one CUDA device (cuda:0 x 2): tests, scatter/gather, "
        "copies, training steps, gloo ranks; writes gpu.md and gpu.json to OUT_DIR.",
    )
    parser.add_argument("out_dir", type=Path, help="where gpu.md, gpu.json and the logs go")
    parser.add_argument(
        "--cpu", action="store_true", help="the dry run: every stage on repeated CPU devices"
    )
    parser.add_argument(
        "--stages",
        type=lambda text: text.split(","),
        default=None,
        help=f"comma-separated stages to run (default: all of {','.join(STAGES)})",
    )
    parser.add_argument(
        "--test-timeout", type=float, default=None, help="the test stage's limit, s"
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.stages or () if name not in STAGES]
    if unknown:
        parser.error(f"--stages: no stage {', '.join(unknown)} (there are {', '.join(STAGES)})")
    if not args.cpu and not torch.cuda.is_available():
        parser.error(
            "no CUDA device here (torch.cuda.is_available() is False): --cpu is the dry run"
        )
    result = run(args.out_dir, cpu=args.cpu, stages=args.stages, test_timeout_s=args.test_timeout)
    print(format_table(result))
    return 0 if result["ok"] else 1
