"""The scripts that run under ``torchrun`` (the notebooks' scripts, the README's distributed
blocks), in one launch: each is a test of its own, the launch and the interpreters' start-up
are paid once.

Run by torchrun, this file runs each ``NAME=PATH`` argument in turn as ``__main__`` (each
script makes and destroys its own process group), each rank's stdout of each script in a file
of its own (``NAME.RANK.txt`` in ``$TORCHRUN_SCRIPTS_OUT``); a script that raises ends the
launch, naming it.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launch(
    scripts: dict[str, Path], out_dir: Path, deadline_s: float, nproc: int = 2
) -> dict[str, str]:
    """Each script's stdout (rank 0's lines, then rank 1's, ...), from one ``torchrun
    --standalone`` launch;
    an ``AssertionError`` with the end of stderr when the launch fails, and the whole process
    group killed past ``deadline_s``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    args = [f"{name}={path}" for name, path in scripts.items()]
    proc = subprocess.Popen(
        [*cmd, "--nproc-per-node", str(nproc), __file__, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TORCHRUN_SCRIPTS_OUT": str(out_dir)},
        start_new_session=True,  # one process group: torchrun and its workers
    )
    try:
        out, err = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun failed (rc {proc.returncode}):\n{out[-2000:]}\n{err[-3000:]}"
        )
    return {
        name: "".join(
            (out_dir / f"{name}.{r}.txt").read_text()
            for r in range(nproc)
            if (out_dir / f"{name}.{r}.txt").exists()
        )
        for name in scripts
    }


def _main(argv: list[str]) -> None:
    rank = os.environ.get("RANK", "0")
    out_dir = Path(os.environ["TORCHRUN_SCRIPTS_OUT"])
    for arg in argv:
        name, path = arg.split("=", 1)
        with (out_dir / f"{name}.{rank}.txt").open("w") as out, contextlib.redirect_stdout(out):
            try:
                runpy.run_path(path, run_name="__main__")
            except BaseException:
                print(f"rank {rank}: {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
                sys.stderr.flush()
                os._exit(1)


if __name__ == "__main__":
    _main(sys.argv[1:])
