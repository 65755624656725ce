"""Where a benchmark result came from: the provenance block every `conveyor bench` result JSON
carries (``report.write_result`` adds it).

The block names when the file was written (UTC), the commit of the source tree that ran and
whether its ``src/`` had uncommitted changes (both null outside a git checkout), the CPU (model
name, the instruction-set flags the kernels choose by, logical cores), and the versions of
Python, torch, Conveyor and of each peer that ran. The machine kind is the result's folder,
``benchmarks/results/<kind>/``. A block written after the run says how in ``backfilled``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from conveyor import __version__

# The instruction sets the CPU kernels and oneDNN choose by, as /proc/cpuinfo spells them.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8")

# peer system -> the distributions whose versions it ran with, installed beside Conveyor
PEER_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "transformers": ("transformers",),
    "transformers-cb": ("transformers",),
    "sentence-transformers": ("sentence-transformers", "transformers"),
}
# peer system -> (distribution, the key of its row's ``extra`` that holds the version): the peers
# that run from environments of their own report their versions themselves
PEER_REPORTED_VERSIONS: dict[str, tuple[str, str]] = {
    "vllm": ("vllm", "vllm_version"),
    "llamacpp": ("llama-cpp-python", "llama_cpp_python_version"),
    "llamacpp-lookup": ("llama-cpp-python", "llama_cpp_python_version"),
}

KEYS = ("date", "commit", "dirty", "conveyor", "python", "torch", "cpu", "peers")


def provenance(peers: dict[str, str | None] | None = None) -> dict[str, Any]:
    """The block for a run made now, by this process. ``peers``: distribution -> version of each
    peer that ran (``peer_versions``)."""
    commit, dirty = git_state(Path(__file__).resolve().parents[1])
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "dirty": dirty,
        "conveyor": __version__,
        "python": platform.python_version(),
        "torch": installed_version("torch"),
        "cpu": cpu_info(),
        "peers": dict(sorted((peers or {}).items())),
    }


def peer_versions(systems: Iterable[str]) -> dict[str, str | None]:
    """Distribution -> installed version for the peers among ``systems`` that run beside
    Conveyor (those in ``PEER_REPORTED_VERSIONS`` say theirs in their rows: the caller adds
    them)."""
    return {dist: installed_version(dist) for system in systems
            for dist in PEER_DISTRIBUTIONS.get(system, ())}


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_state(package_dir: Path) -> tuple[str | None, bool | None]:
    """(HEAD commit, whether ``src/`` differs from it) of the checkout ``package_dir`` sits in as
    ``<checkout>/src/conveyor``; (None, None) for an installed copy or without git."""

    def git(where: Path, *args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(where), *args], capture_output=True,
                                 text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    top = git(package_dir, "rev-parse", "--show-toplevel")
    # a venv inside some other checkout must not lend it its commit
    if top is None or (Path(top) / "src" / "conveyor").resolve() != package_dir.resolve():
        return None, None
    commit = git(Path(top), "rev-parse", "HEAD")
    status = git(Path(top), "status", "--porcelain", "--untracked-files=no", "--", "src")
    return commit, None if commit is None or status is None else bool(status)


def cpu_info() -> dict[str, Any]:
    """Model name, the ``CPU_FLAGS`` this CPU has, logical cores."""
    model, flags = None, set()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {"model": model or platform.processor() or None,
            "flags": [f for f in CPU_FLAGS if f in flags], "cores": os.cpu_count()}


def missing_keys(p: Any) -> list[str]:
    """The keys of the block that ``p`` lacks (all of them when it is not a block)."""
    return [k for k in KEYS if k not in p] if isinstance(p, dict) else list(KEYS)
