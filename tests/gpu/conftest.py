"""Tests that need a real GPU (``make test-gpu``). Where torch sees none, every test here is
skipped with that reason, so ``make test`` on a CPU machine passes through them."""

from __future__ import annotations

import pytest
import torch

NO_GPU = "needs a CUDA GPU: torch sees none (run `make test-gpu` on a GPU machine)"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
