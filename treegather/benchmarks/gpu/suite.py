"""The GPU check's test stage: the suite's fast tests and every cuda-marked test, in a
subprocess, under a time limit.

``pytest`` runs from the checkout (``tests/``, found next to the package) with this module as
a plugin (``-p treegather.benchmarks.gpu.suite``: it tags each cuda-marked test in the JUnit
report), and its JUnit XML (``pytest.xml``) and output (``pytest.log``) are kept in the output
folder. At the time limit the run gets ``SIGINT`` (pytest then writes its report of the tests
that ran), and ``SIGKILL`` if it has not stopped 20 s later. A test module that cannot be
imported because it needs a package missing on that machine (``nbformat``: the notebooks'
tests, deselected there anyway) is reported as not collected, and does not fail the stage; any
other collection error does.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from .plan import FAST_TESTS, ROOT, Found, Plan, Row, StageFailed, StageSkipped

__all__ = ["run_tests", "pytest_itemcollected"]

MARKER = "treegather_marker"
THIS_TEST = "tests/test_benchmarks_gpu.py"  # (it runs this command: never inside it)


def pytest_itemcollected(item: Any) -> None:
    """(The plugin's one hook.) A cuda-marked test carries a ``treegather_marker`` property
    in the JUnit report."""
    if item.get_closest_marker("cuda") is not None:
        item.user_properties.append((MARKER, "cuda"))


def command(plan: Plan, junit: Path) -> list[str]:
    """The pytest command line of ``plan``'s test stage."""
    args = [sys.executable, "-m", "pytest", *plan.test_paths, "-m", FAST_TESTS]
    if plan.test_keyword:
        args += ["-k", plan.test_keyword]
    # A test module that cannot import an optional package (the GPU machine has no nbformat)
    # is one error of the report, not the end of the run.
    args += ["--continue-on-collection-errors", "--ignore", THIS_TEST, "-p", __name__]
    return [*args, "-q", "-rfE", f"--junitxml={junit}"]


def run_tests(plan: Plan, out: Path) -> Found:
    """Run the test stage; one row for the cuda-marked tests and one for the others."""
    if not (ROOT / "tests" / "conftest.py").is_file():
        raise StageSkipped(f"no test suite at {ROOT / 'tests'}: run the command from a checkout")
    junit, log = out / "pytest.xml", out / "pytest.log"
    junit.unlink(missing_ok=True)
    args = command(plan, junit)
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    start = time.perf_counter()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = _wait(proc, plan.test_timeout_s)
    seconds = time.perf_counter() - start
    if timed_out and not junit.is_file():
        raise StageFailed(f"stopped at the time limit ({plan.test_timeout_s:.0f} s), no report yet")
    if not junit.is_file():
        tail = log.read_text(errors="replace")[-2000:]
        raise StageFailed(f"pytest exited with {proc.returncode} and wrote no report:\n{tail}")
    counted = _counts(junit)
    rows = counted.rows
    for row in rows:
        row["exit code"] = proc.returncode
    selection = shlex.join(args[3:-1])  # (the command without the interpreter and the report)
    summary = ", ".join(f"{row['tests']}: {_tally(row)}" for row in rows)
    notes = [f"`pytest {selection}` ({seconds:.0f} s; report: pytest.xml, output: pytest.log)"]
    notes += [
        f"{module} not collected: it imports {package}, not installed here (an optional test "
        "dependency)"
        for module, package in counted.missing.items()
    ]
    if counted.failed:
        shown = ", ".join(counted.failed[:20])
        notes.append(f"failed: {shown}" + (" ..." if len(counted.failed) > 20 else ""))
    if timed_out:
        raise StageFailed(
            f"stopped at the time limit ({plan.test_timeout_s:.0f} s): {summary}", rows
        )
    # (a module not collected for a missing optional package makes pytest exit with 1)
    expected = (0, 1) if counted.missing else (0,)
    if counted.failed or proc.returncode not in expected:
        raise StageFailed(f"pytest exited with {proc.returncode}: {summary}", rows)
    return Found(rows, summary, notes)


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait for ``proc``; at the time limit interrupt its process group (pytest writes its
    report), then kill it. Whether the limit was reached."""
    try:
        proc.wait(timeout_s)
        return False
    except subprocess.TimeoutExpired:
        pass
    for sig, grace in ((signal.SIGINT, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(grace)
            break
        except subprocess.TimeoutExpired:
            continue
    return True


@dataclasses.dataclass
class Counted:
    """What a JUnit report says: a row of counts for the cuda-marked tests and one for the
    others, the tests that failed (or errored), and the test modules not collected because
    they import a package that is not installed (module -> package)."""

    rows: list[Row]
    failed: list[str]
    missing: dict[str, str]


MISSING = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")
NEEDED = {"torch", "optree", "pytest", "hypothesis", "treegather"}
"""What the suite needs: a module that cannot import one of these is an error, not a gap."""


def _counts(junit: Path) -> Counted:
    kinds = ("passed", "failed", "errors", "skipped")
    tally = {kind: dict.fromkeys(kinds, 0) for kind in ("cuda", "rest")}
    failed: list[str] = []
    missing: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        kind = "cuda" if props.get(MARKER) == "cuda" else "rest"
        tags = {child.tag: child for child in case}
        name = "::".join(filter(None, [case.get("classname"), case.get("name")]))
        if "failure" in tags:
            outcome = "failed"
        elif "error" in tags:
            outcome = "errors"
            package = _missing_package(tags["error"])
            if package is not None:
                missing[name] = package
                continue
        else:
            outcome = "skipped" if "skipped" in tags else "passed"
        tally[kind][outcome] += 1
        if outcome in ("failed", "errors"):
            failed.append(name)
    names = {"cuda": "cuda-marked tests", "rest": "the other fast tests"}
    rows = [{"tests": names[kind], **counts} for kind, counts in tally.items()]
    rows[-1]["modules not collected"] = len(missing)
    return Counted(rows, failed, missing)


def _missing_package(error: ET.Element) -> str | None:
    """The package a test module failed to import at collection, where it is not installed
    here and the suite does not need it; else ``None``."""
    if error.get("message") != "collection failure":
        return None
    found = MISSING.search(error.text or "")
    if found is None:
        return None
    package = found.group(1).split(".")[0]
    if package in NEEDED or importlib.util.find_spec(package) is not None:
        return None
    return package


def _tally(row: Row) -> str:
    return (
        ", ".join(f"{row[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if row[k])
        or "none"
    )
