"""Compile a C++ kernel of this package into a shared library, once per machine, and load it.

The source is built with the system C++ compiler (``$CXX``, else ``c++``) for this CPU
(``-O3 -march=native -fopenmp``) into a cache folder (``$CONVEYOR_CACHE_DIR``, else
``~/.cache/conveyor``), keyed by a hash of every kernel source and header here (one may include
another), the flags, the compiler's version and this CPU's feature flags: a library built for
one CPU is never loaded on another.
Torch's inductor builds its CPU kernels the same way. A build takes a second or two; later
loads are instant. ``kernel_library`` returns None when there is no compiler or the build fails
(with one warning) or when ``CONVEYOR_KERNELS=off``; callers then take their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]


class KernelBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("CONVEYOR_CACHE_DIR") or Path.home() / ".cache" / "conveyor")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_kernel(source_name: str) -> tuple[ctypes.CDLL, float]:
    """Build (or reuse) ``kernels/<source_name>``; returns the library and the build seconds (0 if cached)."""
    source = Path(__file__).with_name(source_name)
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (set $CXX)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"cannot run the C++ compiler {compiler!r}: {exc}") from exc
    sources = [p.read_text() for p in sorted(source.parent.iterdir()) if p.suffix in (".h", ".cpp")]
    key = hashlib.sha256("\0".join([source.name, *sources, " ".join(FLAGS), version,
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{source.stem}-{key}.so"
    seconds = 0.0
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        # Build beside the target, then rename: concurrent builders never see a partial file.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            partial = Path(tmp) / target.name
            result = subprocess.run([compiler, *FLAGS, str(source), "-o", str(partial)],
                                    capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                raise KernelBuildError(f"building {source.name} failed:\n{result.stderr[-2000:]}")
            os.replace(partial, target)
        seconds = time.perf_counter() - start
    try:
        return ctypes.CDLL(str(target)), seconds
    except OSError as exc:
        raise KernelBuildError(f"cannot load {target}: {exc}") from exc


@functools.cache
def kernel_library(source_name: str) -> ctypes.CDLL | None:
    """The built kernel library, or None: kernels off, or no way to build them here (warned)."""
    if os.environ.get("CONVEYOR_KERNELS", "").lower() in ("0", "off", "false", "no"):
        return None
    try:
        lib, seconds = build_kernel(source_name)
    except KernelBuildError as exc:
        warnings.warn(f"C++ kernel {source_name} unavailable, using the torch path: {exc}",
                      stacklevel=2)
        return None
    if seconds:
        logger.info("built %s in %.1f s", source_name, seconds)
    return lib


def kernel_function(source_name: str, symbol: str, argtypes: list) -> Any | None:
    """``symbol`` of the built ``kernels/<source_name>``, its argument types set (it returns
    nothing), or None where ``kernel_library`` gives None."""
    lib = kernel_library(source_name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    if fn.argtypes is None:
        fn.argtypes, fn.restype = argtypes, None
    return fn
