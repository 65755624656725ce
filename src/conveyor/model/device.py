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


def linear_packing(device: torch.device, dtype: torch.dtype) -> str | None:
    """How matmul weights are laid out once loaded (layers/linear.py): ``"panels"`` on the CPU
    for float32, and for bf16 where the compiler targets AVX512-BF16 and there is no AMX
    (kernels/panel_gemm.cpp); ``"onednn"`` for bf16 on other CPUs with native bf16 (and float32
    when the panel kernel cannot be built); None (dense, ``F.linear``) elsewhere: oneDNN would
    emulate bf16."""
    if device.type != "cpu":
        return None
    # oneDNN's AMX bf16 GEMM (1.5-1.9 TFLOP/s on the 2-core Xeon) outruns vdpbf16ps panels.
    if dtype == torch.float32 or (dtype == torch.bfloat16 and not cpu_has_amx()):
        from conveyor.model.kernels.panel_gemm import panel_gemm_available

        if panel_gemm_available(dtype):
            return "panels"
    native = dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native_bf16())
    if native and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                     "_linear_pointwise"):
        return "onednn"
    return None


def use_block_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Keep a GGUF file's quantized blocks for small batches (layers/quantized.py, through
    kernels/block_matmul.cpp, float32 or bf16) wherever the weights are packed for the CPU."""
    if linear_packing(device, dtype) is None:
        return False
    from conveyor.model.kernels.block_matmul import block_matmul_available

    return block_matmul_available()


def use_int8_panels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a bf16 model's GGUF 4-bit and 8-bit matmuls above a few rows can run on integer
    dot products (``Linear.use_int8_panels``, kernels/int8_gemm.cpp) in place of bf16 panels,
    when asked (``int8_activations``): where the CPU has AVX512-VNNI and the weights would
    otherwise be bf16 panels (with AMX, oneDNN's bf16 GEMM is faster still). A float32 model
    keeps float32 activations: asking for float32 is asking for its accuracy."""
    if dtype != torch.bfloat16 or linear_packing(device, dtype) != "panels":
        return False
    from conveyor.model.kernels.int8_gemm import int8_gemm_available

    return int8_gemm_available()


def use_attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int,
                         cache_dtype: torch.dtype | None = None) -> bool:
    """The C++ paged attention kernel: CPU, float32/bf16 (a float32 model's cache may be bf16),
    head_dim in 16..256 by 16s."""
    from conveyor.model.kernels.paged_attention import attention_kernel_available

    return (head_dim % 16 == 0 and head_dim <= 256
            and attention_kernel_available(device, dtype, cache_dtype))


def use_triton_attention(device: torch.device, head_dim: int) -> bool:
    """The Triton paged attention kernels (kernels/triton/, layers/triton_attention.py): the
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
    heap included): after a model has loaded, for its float32 temporaries (about 270 MB of a
    GGUF load otherwise stayed resident), and after each long step (``configure_cpu_allocator``).
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def configure_cpu_allocator() -> bool:
    """Keep a long prefill's activations from piling up as free-but-resident heap (peak RSS).

    glibc raises its mmap threshold to the largest block freed so far (up to 32 MB), so once
    the first prefill has run, every activation comes from the heap. Steps of different sizes
    then leave holes that the next step cannot reuse: on W1 the heap held ~320 MB of free
    memory after three prefill steps whose live peak was ~130 MB. The executor therefore calls
    ``return_freed_memory`` after every step of more than ``TRIM_AFTER_TOKENS`` tokens: within
    a step, the 30 layers' same-sized activations reuse the same heap pages; between steps the
    holes go back. Large tensors also get transparent huge pages (torch's
    ``THP_MEM_ALLOC_ENABLE``), one fault per 2 MB instead of 512 when a step maps them afresh.
    See docs/performance.md, changes 15 and 20 (a fixed 2 MB mmap threshold before: every
    layer faulted its activations in again, about 5% of W1's prefill).

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
