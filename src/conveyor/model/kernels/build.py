"""Build the C++ kernels into one torch operator library, once per machine, and load it.

Each kernel source (``*.cpp``: the kernels, and ``ops.cpp`` and ``decode_layers_op.cpp``, their
typed torch operators) is compiled with the system C++ compiler (``$CXX``, else ``c++``) against
torch's headers, and the objects are linked against torch's libraries
(``torch.utils.cpp_extension``'s paths) into a cache folder (``$CONVEYOR_CACHE_DIR``, else
``~/.cache/conveyor``), keyed by a hash of every kernel source and header here, the commands,
the compiler's version, torch's version and this CPU's feature flags: a library built for one
CPU is never loaded on another. Loading it
registers ``torch.ops.conveyor.*`` (docs/kernels.md lists them).

``kernel_ops()`` is what the model uses: the native build's operators, or None when
``CONVEYOR_KERNELS=off`` or there is no way to build them here (warned once); callers then take
their torch path. ``build_ops`` builds other targets (``TARGETS``: baseline x86-64, AVX2) under
their own operator namespace, so that tests can load them beside the native one.
``CONVEYOR_KERNEL_TARGET=x86-64-v3`` (or ``x86-64``) builds the model's own library for that
target instead of this CPU: an AVX-512 machine then runs the paths of an AVX2-only one
(docs/testing.md).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

BUILD_PROGRESS_S = 15.0
BUILD_TIMEOUT_S = 900.0

SOURCES = Path(__file__).parent
# Target name -> its -march flag: native is this CPU (what the model loads); the others are
# what a machine without AVX-512 or without AVX2 builds, compiled here to test them.
TARGETS = {"native": "-march=native", "x86-64-v3": "-march=x86-64-v3", "x86-64": "-march=x86-64"}
# Hidden symbols: libraries built for other targets load beside the native one and share none.
COMPILE_FLAGS = ["-O3", "-fopenmp", "-std=c++17", "-fPIC", "-fvisibility=hidden"]
LINK_FLAGS = ["-shared", "-fopenmp"]


class KernelBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("CONVEYOR_CACHE_DIR") or Path.home() / ".cache" / "conveyor")


def kernels_enabled() -> bool:
    return os.environ.get("CONVEYOR_KERNELS", "").lower() not in ("0", "off", "false", "no")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def find_compiler(compiler: str | None = None) -> str:
    found = compiler or os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if found is None:
        raise KernelBuildError("no C++ compiler found (set $CXX)")
    return found


def namespace(target: str = "native", compiler: str | None = None) -> str:
    """The operator namespace of a build: ``conveyor`` for the native one with the default
    compiler, which the model uses."""
    if target == "native" and compiler is None:
        return "conveyor"
    tag = re.sub(r"\W", "_", f"{target}_{Path(compiler or 'cxx').name}")
    return f"conveyor_{tag}"


def _march(target: str) -> str:
    if target == "native":
        target = os.environ.get("CONVEYOR_KERNEL_TARGET") or "native"
        if target not in TARGETS:
            raise KernelBuildError(f"CONVEYOR_KERNEL_TARGET must be one of {', '.join(TARGETS)}, "
                                   f"got {target!r}")
    return TARGETS[target]


def _commands(compiler: str, target: str, ns: str, folder: Path,
              output: Path) -> list[list[str]]:
    """The compile command of every source (its object in ``folder``), then the link."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f for path in cpp_extension.include_paths() for f in ("-isystem", path)]
    libraries = [f"-L{path}" for path in cpp_extension.library_paths()]
    rpaths = [f"-Wl,-rpath,{path}" for path in cpp_extension.library_paths()]
    sources = sorted(SOURCES.glob("*.cpp"))
    objects = [str(folder / f"{source.stem}.o") for source in sources]
    compiles = [[compiler, *COMPILE_FLAGS, _march(target), f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                 f"-DCONVEYOR_OPS_NAMESPACE={ns}", *includes, "-c", str(source), "-o", obj]
                for source, obj in zip(sources, objects, strict=True)]
    link = [compiler, *LINK_FLAGS, *objects, "-o", str(output), *libraries, *rpaths, "-lc10",
            "-ltorch_cpu"]
    return [*compiles, link]


def build_ops(target: str = "native", compiler: str | None = None) -> tuple[Path, float]:
    """Build (or reuse) the operator library for ``target`` with ``compiler``; returns its path
    and the build seconds (0 if cached)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    ns = namespace(target, compiler)
    compiler = find_compiler(compiler)
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"cannot run the C++ compiler {compiler!r}: {exc}") from exc
    sources = [p.read_text() for p in sorted(SOURCES.iterdir()) if p.suffix in (".h", ".cpp")]
    # The sources' contents are keyed, not where they lie: every checkout shares one build.
    commands = [" ".join(c).replace(f"{SOURCES}/", "")
                for c in _commands(compiler, target, ns, Path("build"), Path("out.so"))]
    key = hashlib.sha256("\0".join([*sources, *commands, version, torch.__version__,
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    library = cache_dir() / "kernels" / f"{ns}-{key}.so"
    if library.exists():
        return library, 0.0
    library.parent.mkdir(parents=True, exist_ok=True)
    # One builder per library at a time: processes that start together (test workers, a server's
    # ranks) wait for the first one's build instead of each compiling the same sources.
    with open(library.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():
            return library, 0.0
        # A warning, so that it shows without any logging set up: the first start on a machine
        # otherwise sits silent for the build's minute or two.
        logger.warning("building the C++ kernels for %s into %s (once for this machine, "
                       "compiler and torch; a minute or two) ...", target, library.parent)
        start = time.perf_counter()
        # Build beside the target, then rename: concurrent builders never see a partial file.
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            partial = Path(tmp) / library.name
            *compiles, link = _commands(compiler, target, ns, Path(tmp), partial)
            try:
                returncode, stderr = _compile(compiles, start)
                if returncode == 0:
                    returncode, stderr = _compile([link], start)
            except (OSError, subprocess.SubprocessError) as exc:
                raise KernelBuildError(f"building the kernels failed: {exc}") from exc
            if returncode != 0:
                raise KernelBuildError(f"building the kernels for {target} failed:\n"
                                       f"{stderr[-3000:]}")
            os.replace(partial, library)
        seconds = time.perf_counter() - start
    return library, seconds


def _compile(commands: list[list[str]], start: float) -> tuple[int, str]:
    """Run the commands, as many at a time as there are cores, saying every
    ``BUILD_PROGRESS_S`` that they still run; the first failure's (exit code, stderr), else
    (0, "")."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        runs = [pool.submit(subprocess.run, command, capture_output=True, text=True,
                            timeout=BUILD_TIMEOUT_S) for command in commands]
        while wait(runs, timeout=BUILD_PROGRESS_S).not_done:
            logger.warning("... still building the C++ kernels (%.0f s)",
                           time.perf_counter() - start)
    for run in runs:
        result = run.result()
        if result.returncode != 0:
            return result.returncode, result.stderr
    return 0, ""


_loaded: dict[str, Path] = {}  # namespace -> the library that registered it


@functools.cache
def load_ops(target: str = "native", compiler: str | None = None) -> Any:
    """The operators of ``build_ops(target, compiler)``, loaded (``torch.ops.<namespace>``)."""
    library, seconds = build_ops(target, compiler)
    if seconds:
        logger.warning("built the %s kernels in %.0f s", target, seconds)
    ns = namespace(target, compiler)
    # A second library registering a namespace aborts the process (from its static
    # initializers), so one built from changed sources cannot replace a loaded one.
    if _loaded.setdefault(ns, library) != library:
        raise KernelBuildError(f"{_loaded[ns]} already registers torch.ops.{ns}; restart to "
                               f"load {library}")
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        raise KernelBuildError(f"cannot load {library}: {exc}") from exc
    return getattr(torch.ops, ns)


@functools.cache
def kernel_ops() -> Any | None:
    """``torch.ops.conveyor`` built for this CPU, or None: kernels off, or no way to build them
    here (warned)."""
    if not kernels_enabled():
        return None
    try:
        return load_ops()
    except KernelBuildError as exc:
        warnings.warn(f"C++ kernels unavailable, using the torch paths: {exc}", stacklevel=2)
        return None


@functools.cache
def kernel_features() -> frozenset[str]:
    """What the native build targets (``avx2``, ``avx512f``, ``avx512bf16``, and ``avx512vnni``
    or ``avxvnni``: the integer dot product ``int8_block_gemm`` runs on); empty when the kernels
    are off or unavailable."""
    ops = kernel_ops()
    return frozenset(ops.features()) if ops is not None else frozenset()
