"""configure_cpu_allocator + return_freed_memory after a long step: large freed activations go
back to the system (bounded peak RSS)."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux")
                                or "libc" not in (ctypes.util.find_library("c") or ""),
                                reason="glibc's malloc_trim only")

# Tensors of varying sizes, as prefill steps of varying lengths make, each freed before the
# next, with the executor's trim after each "step" where the tuning applies; then the resident
# memory still held over the starting point, in MB.
_PROBE = """
import os, sys
from conveyor.model.device import configure_cpu_allocator, return_freed_memory
applied = configure_cpu_allocator()
import torch

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

torch.ones(1)
start = rss_mb()
for mb in (16, 6, 10, 14, 8, 12, 3, 9):
    held = [torch.ones(mb << 18) for _ in range(3)]  # 3 x mb MB of float32, touched
    del held
    if applied:
        return_freed_memory()
print(applied, rss_mb() - start, os.environ.get("THP_MEM_ALLOC_ENABLE"))
"""


def _probe(env: dict[str, str]) -> tuple[bool, float, str]:
    """(applied, MB still resident, THP_MEM_ALLOC_ENABLE as the probe saw it)."""
    # A model loaded earlier in this process set THP_MEM_ALLOC_ENABLE: the probe starts clean.
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    return out[0] == "True", float(out[1]), out[2]


def test_freed_large_tensors_are_returned_to_the_system() -> None:
    applied, held_mb, huge_pages = _probe({})
    assert applied and huge_pages == "1"
    assert held_mb < 8, f"{held_mb:.0f} MB of freed tensors still resident"


def test_opt_out_leaves_glibc_alone() -> None:
    applied, held_mb, huge_pages = _probe({"CONVEYOR_MALLOC_TUNING": "off"})
    assert not applied and huge_pages == "None"
    # glibc's own dynamic threshold keeps freed blocks on the heap: the behaviour tuned away.
    assert held_mb > 8
