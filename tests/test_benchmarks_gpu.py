"""The GPU check's dry run (``python -m treegather.benchmarks.gpu OUT_DIR --cpu``) runs every
stage on repeated CPU devices and writes its table; a failing stage fails the command.

The dry run is the command itself, in a subprocess (as CI runs it); its figures are checked
for sense (positive, counted), never against timings.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from treegather.benchmarks import gpu
from treegather.benchmarks.gpu import Stage, plan, suite
from treegather.benchmarks.gpu.plan import StageFailed

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 300.0


@pytest.fixture(scope="module")
def dry_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("gpu")
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    args = [sys.executable, "-m", "treegather.benchmarks.gpu", str(out), "--cpu"]
    proc = subprocess.Popen(
        args,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # (its own group: its ranks and pytest go with it at the deadline)
    )
    try:
        stdout, stderr = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the dry run took more than {DEADLINE_S} s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr), out


def _stage(result: dict[str, Any], name: str) -> dict[str, Any]:
    (stage,) = (s for s in result["stages"] if s["name"] == name)
    return stage


@pytest.mark.distributed  # (its last stage spawns two gloo ranks)
@pytest.mark.transformers  # (its step stage builds a BERT and a Llama from tiny configs)
def test_the_dry_run_reports_every_stage(
    dry_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, out = dry_run
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "gpu.json").read_text())
    table = (out / "gpu.md").read_text()
    assert table == gpu.format_table(result) + "\n"
    assert done.stdout.strip() == table.strip()  # (what it prints is the table it wrote)
    assert result["ok"] is True and result["environment"]["mode"] == "dry run (--cpu)"
    assert [s["name"] for s in result["stages"]] == list(gpu.STAGES)
    for stage in result["stages"]:
        assert stage["status"] in ("ok", "skipped"), stage
        assert stage["seconds"] >= 0
        assert (stage["status"] == "skipped") == bool(stage["reason"]), stage
        assert f"| {stage['name']} | {stage['status']} |" in table

    tests = _stage(result, "tests")
    assert tests["status"] == "ok"
    counts = {row["tests"]: row for row in tests["rows"]}
    cuda, rest = counts["cuda-marked tests"], counts["the other fast tests"]
    assert cuda["skipped"] >= 1 and cuda["passed"] == 0  # (no CUDA here: they skip)
    assert rest["passed"] >= 1 and rest["skipped"] == 0
    assert all(row["failed"] == row["errors"] == 0 == row["exit code"] for row in tests["rows"])
    assert (out / "pytest.xml").is_file() and (out / "pytest.log").is_file()

    sg = _stage(result, "scatter_gather")
    assert sg["status"] == "ok"
    assert sorted((r["op"], r["leaves"]) for r in sg["rows"]) == sorted(
        (op, n) for op in ("scatter", "gather") for n in plan.DRY_RUN.leaves
    )
    for row in sg["rows"]:
        assert row["per-leaf .to() us"] > 0 and row["treegather us"] > 0
        assert row["treegather / per-leaf .to()"] > 0
        assert row["torch us"] is None  # torch's scatter/gather take CUDA devices only
    assert sum("torch's" in note and "refused the devices" in note for note in sg["notes"]) == 2

    copies = _stage(result, "copies")
    assert copies["status"] == "skipped" and "needs CUDA" in copies["reason"]

    steps = _stage(result, "steps")
    if importlib.util.find_spec("transformers") is None:
        assert steps["status"] == "skipped" and "transformers" in steps["reason"]
    else:
        assert steps["status"] == "ok" and len(steps["rows"]) == len(plan.DRY_RUN.step_models)
        for row in steps["rows"]:
            assert row["floor ms"] > 0 and row["kept replicas ms"] > 0
            assert row["fresh replicas / floor"] > 0
            assert row["torch DataParallel ms"] is None  # (CUDA only)
            assert row["gradients = floor's (ways)"] == "data_parallel, fresh"
            assert row["largest grad difference"] < 1e-4
        assert any("DataParallel not run" in note for note in steps["notes"])

    dist = _stage(result, "distributed")
    assert dist["status"] == "ok"
    calls = [row["call"] for row in dist["rows"]]
    assert [c for c in calls if c.startswith("all_gather, ")] == [
        f"all_gather, {n} leaves" for n in plan.DRY_RUN.dist_leaves
    ]
    assert any("sync_grads=True), forward + backward" in c for c in calls)
    assert any(c.startswith("Collector evaluation") for c in calls)
    for row in dist["rows"]:
        assert row["ms"] > 0 and row["collectives"] >= 1
    assert "NCCL needs a chip per rank" in table
    _tables_are_well_formed(table)


def _tables_are_well_formed(markdown: str) -> None:
    """Every Markdown table has as many cells in each line as in its header."""
    block: list[int] = []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            block.append(len(re.split(r"(?<!\\)\|", line)))
        elif block:
            assert len(set(block)) == 1, (block, markdown)
            block = []


def _broken(plan: plan.Plan, out: Path) -> Any:
    raise RuntimeError("broken on purpose")


def _failed_with_rows(plan: plan.Plan, out: Path) -> Any:
    raise StageFailed("2 of 3 checks failed", [{"check": "a", "ok": False}])


def test_a_failing_stage_fails_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(gpu.STAGES, "scatter_gather", Stage("raises", _broken))
    monkeypatch.setitem(gpu.STAGES, "steps", Stage("fails a check", _failed_with_rows))
    # (the stages after a failure still run: copies skips here, on the CPU)
    assert gpu.main([str(tmp_path), "--cpu", "--stages", "scatter_gather,steps,copies"]) == 1
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["ok"] is False
    raised, failed, copies = result["stages"]
    assert raised["status"] == "failed" and raised["reason"] == "RuntimeError: broken on purpose"
    assert "broken on purpose" in raised["traceback"]
    assert failed["status"] == "failed" and failed["rows"] == [{"check": "a", "ok": False}]
    assert copies["status"] == "skipped"
    table = (tmp_path / "gpu.md").read_text()
    assert table.startswith("# treegather GPU check: FAILED")
    assert "| scatter_gather | failed |" in table and "| check | ok |" in table
    _tables_are_well_formed(table)
    assert capsys.readouterr().out.strip() == table.strip()


def test_usage_errors_exit_with_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        gpu.main([str(tmp_path), "--cpu", "--stages", "tests,nope"])
    assert info.value.code == 2 and "no stage nope" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as info:
            gpu.main([str(tmp_path)])
        assert info.value.code == 2 and "--cpu is the dry run" in capsys.readouterr().err


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="6">
<testcase classname="tests.test_a" name="test_ok"/>
<testcase classname="tests.test_a" name="test_ok_too"/>
<testcase classname="tests.test_a" name="test_gpu"><properties>
<property name="treegather_marker" value="cuda"/></properties><skipped message="needs CUDA"/></testcase>
<testcase classname="tests.test_a" name="test_gpu_fails"><properties>
<property name="treegather_marker" value="cuda"/></properties><failure message="no"/></testcase>
<testcase classname="tests.test_b" name="test_broken_fixture"><error message="setup"/></testcase>
<testcase classname="tests.test_b" name="test_skips"><skipped message="later"/></testcase>
<testcase classname="" name="tests.test_c"><error message="collection failure">ImportError
E   ModuleNotFoundError: No module named 'not_installed_anywhere.sub'</error></testcase>
<testcase classname="" name="tests.test_d"><error message="collection failure">ImportError
E   ModuleNotFoundError: No module named 'optree'</error></testcase>
<testcase classname="" name="tests.test_e"><error message="collection failure">E   SyntaxError
</error></testcase>
</testsuite></testsuites>
"""


def test_the_test_stage_counts_cuda_marked_tests_and_missing_packages_apart(tmp_path: Path) -> None:
    report = tmp_path / "pytest.xml"
    report.write_text(JUNIT)
    counted = suite._counts(report)
    counts = {row["tests"]: {k: v for k, v in row.items() if k != "tests"} for row in counted.rows}
    assert counts == {
        "cuda-marked tests": {"passed": 0, "failed": 1, "errors": 0, "skipped": 1},
        "the other fast tests": {
            "passed": 2,
            "failed": 0,
            "errors": 3,
            "skipped": 1,
            "modules not collected": 1,
        },
    }
    assert counted.failed == [
        "tests.test_a::test_gpu_fails",
        "tests.test_b::test_broken_fixture",
        "tests.test_d",  # (the suite needs optree: a module that cannot import it is an error)
        "tests.test_e",
    ]
    # a package not installed here (nbformat on the GPU machine): the module is not collected
    assert counted.missing == {"tests.test_c": "not_installed_anywhere"}


def test_the_test_stage_runs_the_cuda_marked_and_fast_tests() -> None:
    args = suite.command(plan.ON_CHIP, Path("pytest.xml"))
    assert args[args.index("-m", 3) + 1] == "cuda or not (distributed or notebook or transformers)"
    assert "-k" not in args and plan.ON_CHIP.test_paths == ("tests",)
    assert args[args.index("--ignore") + 1] == "tests/test_benchmarks_gpu.py"  # (no recursion)
    assert args[args.index("-p") + 1] == "treegather.benchmarks.gpu.suite"
