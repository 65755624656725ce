"""Every device-specific choice in one place: which device, which dtype, which kernels, how the
CPU allocator behaves."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
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


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in _DTYPES.items() if v == dtype)


def linear_packing(device: torch.device, dtype: torch.dtype) -> str | None:
    """How matmul weights are laid out once loaded (layers/linear.py): ``"panels"`` for float32
    on the CPU (kernels/panel_gemm.cpp), ``"onednn"`` for bf16 where the CPU has native bf16 (and
    float32 when the panel kernel cannot be built), None (dense, ``F.linear``) elsewhere: oneDNN
    would emulate bf16."""
    if device.type != "cpu":
        return None
    if dtype == torch.float32:
        from conveyor.model.kernels.panel_gemm import panel_gemm_available

        if panel_gemm_available():
            return "panels"
    native = dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native_bf16())
    if native and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                     "_linear_pointwise"):
        return "onednn"
    return None


def use_block_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Keep a GGUF file's quantized blocks for small batches (layers/quantized.py): on the CPU,
    4-bit in bf16 through torch's int4 kernel; 4- and 8-bit in float32 through
    kernels/block_matmul.cpp."""
    if linear_packing(device, dtype) is None:
        return False
    if dtype == torch.bfloat16:
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    from conveyor.model.kernels.block_matmul import block_matmul_available

    return block_matmul_available()


def use_attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """The C++ paged attention kernel: CPU, float32/bf16, head_dim in 16..256 by 16s."""
    from conveyor.model.kernels.paged_attention import attention_kernel_available

    return head_dim % 16 == 0 and head_dim <= 256 and attention_kernel_available(device, dtype)


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD_BYTES = 2 << 20


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (``mallopt``, ``malloc_trim``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def return_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it mapped): called once a model has
    loaded, for its float32 temporaries. Without it about 270 MB of a GGUF load stayed resident
    for the process's lifetime (before ``configure_cpu_allocator``)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def configure_cpu_allocator() -> bool:
    """Keep a long prefill's activations from piling up as free-but-resident heap (peak RSS).

    glibc raises its mmap threshold to the largest block freed so far (up to 32 MB), so once
    the first prefill has run, every activation comes from the heap. Steps of different sizes
    then leave holes that the next step cannot reuse: on W1 the heap held ~320 MB of free
    memory after three prefill steps whose live peak was ~130 MB. A fixed 2 MB threshold
    returns each large activation to the system when it is freed (a decode step's activations,
    under 1 MB a tensor at 64 sequences, stay on the heap). Fresh mappings must be faulted in
    again, so large tensors also get transparent huge pages (torch's ``THP_MEM_ALLOC_ENABLE``):
    one fault per 2 MB instead of 512. W1's prefill pays ~8% for it (20-25% without huge
    pages); decode nothing. See docs/performance.md, change 15.

    Process-wide, so it is done once, when a CPU model is loaded; ``CONVEYOR_MALLOC_TUNING=off``
    leaves both alone. torch reads its setting at its first allocation, so a process that
    allocated tensors before loading a model keeps small pages. Returns whether it applied.
    """
    libc = _glibc()
    if libc is None or os.environ.get("CONVEYOR_MALLOC_TUNING", "").lower() in (
            "0", "off", "false", "no"):
        return False
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
