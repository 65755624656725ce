"""A helper shared by tests (``tests/`` is on pytest's python path): run code with torch using
a given number of threads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch uses ``n`` threads inside the block; the previous count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
