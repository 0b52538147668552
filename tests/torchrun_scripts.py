"""The scripts that run under ``torchrun`` in the tests (the notebooks' scripts, the README's
distributed blocks), in one launch: each is a test of its own, the launch and the interpreters'
start-up are paid once.

Run by torchrun, this file runs each ``NAME=PATH`` argument in turn as ``__main__``, each rank's
stdout of each script in a file of its own (``NAME.RANK.txt`` in ``$TORCHRUN_SCRIPTS_OUT``).
Each script makes and destroys its own process group; destroying the default group resets
torch's group names, so a second group made on torchrun's store would read the first one's
rendezvous keys. Each script therefore gets a store of its own: rank 0 serves it on a free port
it announces on torchrun's store. A script that raises ends the launch, naming it.

Output goes to files, so that a worker outliving its launcher cannot hold a pipe open; past the
deadline the launch is stopped (SIGTERM, which torchrun passes on to its workers, then SIGKILL).
A rank still in one script after ``STUCK_AFTER_S`` dumps its stacks to stderr, which the
failure shows.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launch(
    scripts: dict[str, Path],
    out_dir: Path,
    deadline_s: float,
    nproc: int = 2,
    stop: threading.Event | None = None,
) -> dict[str, str]:
    """Each script's stdout (rank 0's lines, then rank 1's, ...), from one ``torchrun
    --standalone`` launch; an ``AssertionError`` with the end of stderr when the launch fails
    or is stopped at ``deadline_s`` (or once ``stop`` is set: the session ended)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    args = [f"{name}={path}" for name, path in scripts.items()]
    # (this checkout's treegather first: an installed one elsewhere would stand in for it)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCHRUN_SCRIPTS_OUT": str(out_dir),
        "PYTHONPATH": path,
    }
    with (out_dir / "launch.out").open("wb") as out, (out_dir / "launch.err").open("wb") as err:
        proc = subprocess.Popen(
            [*cmd, "--nproc-per-node", str(nproc), __file__, *args],
            cwd=ROOT,
            stdout=out,
            stderr=err,
            env=env,
            start_new_session=True,  # one process group: torchrun (its workers: their own)
        )
    deadline = time.monotonic() + deadline_s
    while proc.poll() is None and time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
    late = proc.poll() is None
    if late:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun stops its workers
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if late or proc.returncode != 0:
        text = (out_dir / "launch.err").read_text()
        at = text.find(" failed:\n")  # the first script failure a rank reported
        shown = text[max(0, at - 200) :][:4000] if at >= 0 else text[-4000:]
        stacks = text.find(STUCK)  # where a rank was, when it was slow to finish a script
        if stacks >= 0:
            shown += "\n...\n" + text[stacks:][:4000]
        why = f"stopped after {deadline_s:.0f} s" if late else f"failed (rc {proc.returncode})"
        raise AssertionError(f"torchrun {why}:\n{shown}")
    return {
        name: "".join(
            (out_dir / f"{name}.{r}.txt").read_text()
            for r in range(nproc)
            if (out_dir / f"{name}.{r}.txt").exists()
        )
        for name in scripts
    }


def _own_store(name: str, rank: int) -> None:
    """Point ``init_process_group``'s ``env://`` at a store of this script's own."""
    import torch.distributed as dist

    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=STORE_WAIT_S),
    )
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        agent.set(f"torchrun_scripts/{name}", str(port))
    else:
        port = int(agent.get(f"torchrun_scripts/{name}"))
    os.environ.update(
        TORCHELASTIC_USE_AGENT_STORE="False", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


STORE_WAIT_S = 90  # how long a rank waits for rank 0 to start the next script (the launch: 120)
STUCK_AFTER_S = 30  # a script this slow on a rank dumps that rank's stacks to stderr
STUCK = "Timeout ("  # how faulthandler heads the stacks it dumps


def _main(argv: list[str]) -> None:
    rank = int(os.environ["RANK"])
    out_dir = Path(os.environ["TORCHRUN_SCRIPTS_OUT"])
    agent = (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    for arg in argv:
        name, path = arg.split("=", 1)
        os.environ.update(MASTER_ADDR=agent[0], MASTER_PORT=agent[1])
        with (out_dir / f"{name}.{rank}.txt").open("w") as out, contextlib.redirect_stdout(out):
            faulthandler.dump_traceback_later(STUCK_AFTER_S, file=sys.stderr)
            try:
                _own_store(name, rank)
                runpy.run_path(path, run_name="__main__")
                faulthandler.cancel_dump_traceback_later()
            except BaseException:
                print(f"rank {rank}: {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
                sys.stderr.flush()
                os._exit(1)


if __name__ == "__main__":
    _main(sys.argv[1:])
