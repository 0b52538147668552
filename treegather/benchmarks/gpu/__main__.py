"""``python -m treegather.benchmarks.gpu OUT_DIR [--cpu]``: the GPU check (see the package)."""

from __future__ import annotations

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
