"""Every device-specific choice in one place: which device, which dtype, which kernels, how the
CPU allocator behaves."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from conveyor.model.backends.base import Backend
    from conveyor.model.layers.linear import LinearMethod

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the values of dtype, kv_cache_dtype and device (EngineArgs; the CLI's choices)
DTYPES = ("auto", *_DTYPES)
KV_CACHE_DTYPES = ("auto", *_DTYPES)
DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in DEVICES:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch sees no CUDA device")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    """True when oneDNN runs bf16 matmuls natively (AVX512-BF16 / AMX), not by emulation."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles (Sapphire Rapids and later Xeons), which oneDNN uses."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: ``"auto"`` is the model's ``dtype``. A bf16 cache for a
    float32 model halves the bytes attention reads and doubles the blocks that fit, at the
    cost of rounding K and V to bf16 (outputs no longer equal a float32 reference's)."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype not in _DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(_DTYPES)}; "
                         f"got {kv_cache_dtype!r}")
    return _DTYPES[kv_cache_dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in _DTYPES.items() if v == dtype)


@dataclass(frozen=True)
class KernelPlan:
    """Which kernels serve a model on this device, chosen once at load (``select_kernels``)."""
    linear: type[LinearMethod]  # every Linear's weight format (layers/linear.py)
    block_weights: bool  # keep a GGUF file's quantized blocks for small batches
    int8_blocks: bool  # integer compute: a GGUF model's quantized matmuls as integers
    backend: Backend  # attention, norm, rotary, activation (model/backends/)
    # same bits however a request is batched (docs/determinism.md): GGUF blocks as BlockPanels
    # (or serving no rows), the bf16 panels rather than oneDNN's AMX GEMM
    deterministic: bool = False


def select_kernels(device: torch.device, dtype: torch.dtype, head_dim: int,
                   cache_dtype: torch.dtype | None = None,
                   weight_compute: str = "auto", deterministic: bool = True) -> KernelPlan:
    """The one place a model's kernels are chosen.

    * ``linear``: on the CPU, ``PanelMethod`` for float32, and for bf16 where the build targets
      AVX512-BF16 and there is no AMX or the model is deterministic (oneDNN's AMX GEMM outruns
      vdpbf16ps panels, but its sums are not known to be the same whatever the batch);
      ``OneDnnMethod`` for bf16 on other CPUs with native bf16 (and float32 when the kernels
      cannot be built); ``DenseMethod`` elsewhere (oneDNN would emulate bf16).
    * ``block_weights``: under integer compute, and wherever the weights are packed for the CPU,
      once the kernels are built (layers/quantized.py, float32 or bf16 activations).
    * ``int8_blocks``: integer compute, by default (``weight_compute="auto"``) and when asked
      (``"int8"``), on the CPU wherever the kernels are built (bf16 without AVX512-BF16 too,
      where the dense weights would be torch's emulated bf16): every projection the file
      stores as blocks then multiplies them as integers against activations rounded to 8 bits
      (``layers/block_method.py``'s ``Int8BlockMethod``), whatever the model's dtype. ``"float"``
      multiplies them in the activations' dtype.
    * ``backend``: on CUDA, ``TritonBackend`` where Triton is installed and head_dim is a power
      of two from 16 to 256; on the CPU, ``CpuBackend`` wherever the kernels build, its
      attention kernel where it takes the queries' and cache's dtypes (float32/bf16; a float32
      model's cache may be bf16) and head_dim (16..256 by 16s); else ``TorchBackend``.
    * ``deterministic``: as asked; the matmuls above then run their deterministic variants
      (``BlockPanels`` for the blocks, the bf16 panels even with AMX). Attention computes every
      query row in one arithmetic either way.
    """
    from conveyor.model.kernels.block_matmul import block_matmul_available
    from conveyor.model.kernels.panel_gemm import panel_gemm_available
    from conveyor.model.layers.linear import DenseMethod, OneDnnMethod, PanelMethod

    weight_compute = resolve_weight_compute(weight_compute, device)
    linear: type[LinearMethod] = DenseMethod
    if device.type == "cpu":
        native_bf16 = dtype == torch.bfloat16 and cpu_has_native_bf16()
        # AMX makes oneDNN's bf16 GEMM the faster one, but only the panels are batch-invariant.
        bf16_panels = dtype == torch.bfloat16 and (deterministic or not cpu_has_amx())
        if (dtype == torch.float32 or bf16_panels) and panel_gemm_available(dtype):
            linear = PanelMethod
        elif (dtype == torch.float32 or native_bf16) and OneDnnMethod.available():
            linear = OneDnnMethod
    kernels_built = device.type == "cpu" and block_matmul_available()
    if weight_compute == "int8" and not kernels_built:
        raise ValueError(f"weight_compute int8 needs the CPU kernels (device {device.type}, "
                         f"dtype {dtype})")
    int8_blocks = weight_compute == "int8"
    return KernelPlan(
        linear=linear,
        block_weights=int8_blocks or (linear is not DenseMethod and kernels_built),
        int8_blocks=int8_blocks,
        backend=select_backend(device, dtype, head_dim, cache_dtype),
        deterministic=deterministic)


BACKENDS = ("torch", "cpu", "triton")
WEIGHT_COMPUTE = ("auto", "float", "int8")  # how quantized weights are multiplied (select_kernels)


def resolve_weight_compute(weight_compute: str, device: torch.device) -> str:
    """What ``weight_compute`` is on ``device``: ``"auto"`` is ``"int8"`` wherever the CPU
    kernels are built, else ``"float"``. Decided by the device alone, so it is the same at
    every tensor-parallel size and on every replica of a machine kind: a request's tokens do
    not depend on how the model is split (docs/parallelism.md). ValueError for another name."""
    from conveyor.model.kernels.block_matmul import block_matmul_available

    if weight_compute not in WEIGHT_COMPUTE:
        raise ValueError(f"weight_compute must be one of {', '.join(WEIGHT_COMPUTE)}, got "
                         f"{weight_compute!r}")
    if weight_compute != "auto":
        return weight_compute
    return "int8" if device.type == "cpu" and block_matmul_available() else "float"


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: int,
                   cache_dtype: torch.dtype | None = None) -> Backend:
    """The backend of ``select_kernels``'s plan; ``CONVEYOR_BACKEND`` (torch, cpu or triton)
    names one instead, where it can run (Triton's interpreter runs ``triton`` on the CPU)."""
    from conveyor.model.backends.cpu_kernels import CpuBackend
    from conveyor.model.backends.sdpa import TorchBackend
    from conveyor.model.kernels.build import kernel_ops
    from conveyor.model.kernels.paged_attention import attention_kernel_available
    from conveyor.model.kernels.triton.common import triton_available

    wanted = os.environ.get("CONVEYOR_BACKEND", "")
    if wanted and wanted not in BACKENDS:
        raise ValueError(f"CONVEYOR_BACKEND must be one of {', '.join(BACKENDS)}; got {wanted!r}")
    if wanted == "triton" or (not wanted and device.type == "cuda"
                              and use_triton_attention(device, head_dim)):
        if not triton_available():
            raise ValueError("CONVEYOR_BACKEND=triton, but triton is not installed")
        from conveyor.model.backends.triton_kernels import TritonBackend

        return TritonBackend(device)
    if wanted == "cpu" or (not wanted and device.type == "cpu" and kernel_ops() is not None):
        if device.type != "cpu" or kernel_ops() is None:
            raise ValueError("CONVEYOR_BACKEND=cpu needs the CPU device and the C++ kernels")
        return CpuBackend(device, attention_kernel_available(device, dtype, cache_dtype, head_dim))
    return TorchBackend(device)


def use_triton_attention(device: torch.device, head_dim: int) -> bool:
    """The Triton paged attention kernels (kernels/triton/, backends/triton_kernels.py): the
    attention of the CUDA path, for head sizes that are powers of two from 16 to 256."""
    from conveyor.model.kernels.triton.common import triton_available

    return (device.type == "cuda" and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0
            and triton_available())


TRIM_AFTER_TOKENS = 256  # steps longer than this hand their freed activations back


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (``malloc_trim``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def return_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it mapped, holes in the middle of the
    heap included): after a model has loaded, for its float32 temporaries (a GGUF load's would
    otherwise stay resident), and after each long step (``configure_cpu_allocator``).
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def configure_cpu_allocator() -> bool:
    """Keep a long prefill's activations from piling up as free-but-resident heap (peak RSS).

    glibc raises its mmap threshold to the largest block freed so far (up to 32 MB), so once
    the first prefill has run, every activation comes from the heap. Steps of different sizes
    then leave holes that the next step cannot reuse, until the heap holds several times a
    step's live peak as free memory. The executor therefore calls
    ``return_freed_memory`` after every step of more than ``TRIM_AFTER_TOKENS`` tokens: within
    a step, the 30 layers' same-sized activations reuse the same heap pages; between steps the
    holes go back. Large tensors also get transparent huge pages (torch's
    ``THP_MEM_ALLOC_ENABLE``), one fault per 2 MB instead of 512 when a step maps them afresh.
    A fixed 2 MB mmap threshold instead would have every layer fault its activations in
    again (docs/performance.md).

    Process-wide, so it is done once, when a CPU model is loaded; ``CONVEYOR_MALLOC_TUNING=off``
    leaves glibc and torch alone and turns the trimming off. torch reads its setting at its
    first allocation, so a process that allocated tensors before loading a model keeps small
    pages. Returns whether it applied (whether to trim).
    """
    if _glibc() is None or os.environ.get("CONVEYOR_MALLOC_TUNING", "").lower() in (
            "0", "off", "false", "no"):
        return False
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return True
