"""Dense float32 matmul on the CPU against a weight packed into column panels
(``panel_gemm.cpp`` via ctypes): what a float32 model's projections and lm_head run on.

``pack_panels`` lays a weight out once (a reshape, at load time), ``panel_gemm`` multiplies,
``unpack_panels`` gives the dense weight back. ``panel_gemm_available()`` builds the kernel on
first use (see ``build.py``); ``CONVEYOR_KERNELS=off`` turns it off.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from conveyor.model.kernels.build import kernel_function, kernel_library

_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P] * 3 + [_I] * 3 + [ctypes.c_int]


def _kernel():
    return kernel_function("panel_gemm.cpp", "panel_gemm_f32", _ARGTYPES)


def panel_gemm_available() -> bool:
    return _kernel() is not None


def panel_width() -> int:
    """Output columns per panel: 16 with AVX2, 32 with AVX-512 (two vectors)."""
    lib = kernel_library("panel_gemm.cpp")
    if lib is None:
        raise RuntimeError("the panel GEMM kernel is not available")
    return int(lib.panel_gemm_width())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] float32 -> [ceil(N / width), K, width]: panel p, row k holds W[p * width + j, k]."""
    n, k = weight.shape
    width = panel_width()
    if n % width:  # an extra copy, so only when needed: a load's peak memory is set here
        weight = F.pad(weight, (0, 0, 0, -n % width))
    return weight.float().view(-1, width, k).transpose(1, 2).contiguous()


def unpack_panels(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The dense [N, K] weight of ``pack_panels``."""
    panels, k, width = packed.shape
    return packed.transpose(1, 2).reshape(panels * width, k)[:n]


def panel_gemm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] float32, W given by ``pack_panels``."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the panel GEMM kernel is not available")
    panels, k, width = packed.shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be float32 [M, {k}], got {x.dtype} {tuple(x.shape)}")
    if packed.dtype != torch.float32 or not packed.is_contiguous() or panels * width < n:
        raise ValueError("packed must be a contiguous float32 pack_panels result covering n")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    kernel(y.data_ptr(), x.data_ptr(), packed.data_ptr(), x.shape[0], n, k,
           torch.get_num_threads())
    return y
