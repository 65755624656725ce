"""Suite-wide settings. Under pytest-xdist (``make test`` runs ``pytest -n auto``) each worker's
torch, and every server or rank it starts, gets its share of the cores: two workers with two
spinning OpenMP threads each on a 2-core machine make every step many times slower."""

from __future__ import annotations

import os

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // _workers))
