"""Dense matmul on the CPU against a weight packed into column panels (``panel_gemm.cpp`` via
ctypes): what a float32 model's projections and lm_head run on, and a bf16 model's where the
CPU has AVX512-BF16 (``vdpbf16ps``).

``pack_panels`` lays a weight out once (a reshape, at load time), ``panel_gemm`` multiplies,
``unpack_panels`` gives the dense weight back. ``panel_gemm_available(dtype)`` builds the
kernel on first use (see ``build.py``); ``CONVEYOR_KERNELS=off`` turns it off.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from conveyor.model.kernels.build import kernel_function, kernel_library

_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P] * 3 + [_I] * 3 + [ctypes.c_int]
_SYMBOLS = {torch.float32: "panel_gemm_f32", torch.bfloat16: "panel_gemm_bf16"}


def _kernel(dtype: torch.dtype):
    lib = kernel_library("panel_gemm.cpp")
    if dtype not in _SYMBOLS or lib is None or not hasattr(lib, _SYMBOLS[dtype]):
        return None  # the bf16 kernel exists only where the compiler targets AVX512-BF16
    return kernel_function("panel_gemm.cpp", _SYMBOLS[dtype], _ARGTYPES)


def panel_gemm_available(dtype: torch.dtype = torch.float32) -> bool:
    return _kernel(dtype) is not None


def panel_width() -> int:
    """Output columns per panel: 16 with AVX2, 32 with AVX-512 (two vectors)."""
    lib = kernel_library("panel_gemm.cpp")
    if lib is None:
        raise RuntimeError("the panel GEMM kernel is not available")
    return int(lib.panel_gemm_width())


def _pair(dtype: torch.dtype) -> int:
    """Consecutive k that sit side by side in a panel row: 2 for bf16 (vdpbf16ps), else 1."""
    return 2 if dtype == torch.bfloat16 else 1


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [ceil(N / width), K / pair, width * pair] in W's dtype (float32 or bf16):
    panel p, row i holds W[p * width + j, i * pair + e] at j * pair + e."""
    n, k = weight.shape
    if weight.dtype not in _SYMBOLS:
        raise ValueError(f"panels hold float32 or bf16 weights, got {weight.dtype}")
    pair = _pair(weight.dtype)
    if k % pair:
        raise ValueError(f"bf16 panels need an even input size, got {k}")
    width = panel_width()
    if n % width:  # an extra copy, so only when needed: a load's peak memory is set here
        weight = F.pad(weight, (0, 0, 0, -n % width))
    panels = weight.view(-1, width, k // pair, pair).transpose(1, 2)
    return panels.reshape(-1, k // pair, width * pair).contiguous()


def unpack_panels(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The dense [N, K] weight of ``pack_panels``."""
    pair = _pair(packed.dtype)
    panels, steps, row = packed.shape
    width = row // pair
    dense = packed.view(panels, steps, width, pair).transpose(1, 2)
    return dense.reshape(panels * width, steps * pair)[:n]


def panel_gemm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, W given by ``pack_panels`` in that dtype."""
    kernel = _kernel(packed.dtype)
    if kernel is None:
        raise RuntimeError(f"the panel GEMM kernel for {packed.dtype} is not available")
    pair = _pair(packed.dtype)
    panels, steps, row = packed.shape
    k = steps * pair
    if x.dtype != packed.dtype or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be {packed.dtype} [M, {k}], got {x.dtype} {tuple(x.shape)}")
    if not packed.is_contiguous() or panels * row // pair < n:
        raise ValueError("packed must be a contiguous pack_panels result covering n")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    kernel(y.data_ptr(), x.data_ptr(), packed.data_ptr(), x.shape[0], n, k,
           torch.get_num_threads())
    return y


_BLOCK_SYMBOLS = {torch.float32: "block_panel_gemm_f32", torch.bfloat16: "block_panel_gemm_bf16"}
_BLOCK_ARGTYPES = [_P] * 5 + [_I] * 3 + [ctypes.c_int]


def _block_kernel(dtype: torch.dtype):
    lib = kernel_library("panel_gemm.cpp")
    if dtype not in _BLOCK_SYMBOLS or lib is None or not hasattr(lib, _BLOCK_SYMBOLS[dtype]):
        return None  # AVX-512 only (bf16: AVX512-BF16)
    return kernel_function("panel_gemm.cpp", _BLOCK_SYMBOLS[dtype], _BLOCK_ARGTYPES)


def block_panel_gemm_available(dtype: torch.dtype) -> bool:
    return _block_kernel(dtype) is not None


def block_panel_gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                     minimum: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] with W as ``layers/quantized.py``'s ``BlockPanels`` holds it
    (``minimum`` None: 8-bit codes): the same bits as ``panel_gemm`` over W's panels."""
    kernel = _block_kernel(x.dtype)
    if kernel is None:
        raise RuntimeError(f"the block panel GEMM kernel for {x.dtype} is not available")
    n, k = scale.shape[0], scale.shape[1] * 32
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    kernel(y.data_ptr(), x.data_ptr(), codes.data_ptr(), scale.data_ptr(),
           None if minimum is None else minimum.data_ptr(), x.shape[0], n, k,
           torch.get_num_threads())
    return y
