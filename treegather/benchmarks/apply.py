"""Time parallel_apply backends on a matmul-heavy model (scripted and eager), CPU.

Run it with ``python -m treegather.benchmarks.apply [--replicas 2] [--repeats 5]``.
Prints the best-of-N wall time per call of each backend and its ratio to serial; writes
``bench-apply.json``. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch

import treegather as tg


class MatmulNet(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(width, width) / width**0.5)
        self.depth = depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.depth):
            x = torch.tanh(x @ self.w)
        return x


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up (profiling executor, pool start)
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)  # least disturbed by other load on the machine


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m treegather.benchmarks.apply", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=30)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--intra-op-threads", type=int, default=1)
    a = parser.parse_args()
    torch.set_num_threads(a.intra_op_threads)
    torch.manual_seed(0)
    warnings.simplefilter("ignore", DeprecationWarning)
    eager = MatmulNet(a.width, a.depth)
    scripted = torch.jit.script(MatmulNet(a.width, a.depth))
    xs = [torch.randn(a.rows, a.width) for _ in range(a.replicas)]
    results: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for name, model in (("scripted", scripted), ("eager", eager)):
            reps = tg.replicate(model, ["cpu"] * a.replicas)
            row = {
                b: _best_time(lambda b=b, r=reps: tg.parallel_apply(r, xs, backend=b), a.repeats)
                for b in ("serial", "threads", "fork")
            }
            results[name] = row
            print(
                f"{name:9s} "
                + "  ".join(
                    f"{b}={t * 1e3:7.1f} ms ({t / row['serial']:.2f}x)" for b, t in row.items()
                )
            )
    info = {
        "torch": torch.__version__,
        "interop_threads": torch.get_num_interop_threads(),
        "intra_op_threads": torch.get_num_threads(),
        "args": vars(a),
        "seconds": results,
    }
    print(json.dumps({k: v for k, v in info.items() if k != "seconds"}))
    with open("bench-apply.json", "w") as f:
        json.dump(info, f, indent=2)


if __name__ == "__main__":
    main()
