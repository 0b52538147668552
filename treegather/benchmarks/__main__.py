"""``python -m treegather.benchmarks``: the scatter/gather table (see :mod:`.scatter_gather`)."""

from __future__ import annotations

from .scatter_gather import main

if __name__ == "__main__":
    main()
