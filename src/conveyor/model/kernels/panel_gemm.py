"""Dense matmul on the CPU against a weight packed into column panels
(``torch.ops.conveyor.panel_gemm``, ``panel_gemm.cpp``): what a float32 model's projections and
lm_head run on, and a bf16 model's where the CPU has AVX512-BF16 (``vdpbf16ps``).

``pack_panels`` lays a weight out once (a reshape, at load time), ``panel_gemm`` multiplies,
``unpack_panels`` gives the dense weight back. ``panel_gemm_available(dtype)`` builds the
kernels on first use (see ``build.py``); ``CONVEYOR_KERNELS=off`` turns them off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.model.kernels.build import kernel_features, kernel_ops


def panel_gemm_available(dtype: torch.dtype = torch.float32) -> bool:
    """The bf16 kernel exists only where the build targets AVX512-BF16."""
    if kernel_ops() is None:
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16
                                      and "avx512bf16" in kernel_features())


def panel_width() -> int:
    """Output columns per panel: 16 with AVX2, 32 with AVX-512 (two vectors)."""
    ops = kernel_ops()
    if ops is None:
        raise RuntimeError("the panel GEMM kernel is not available")
    return int(ops.panel_width())


def _pair(dtype: torch.dtype) -> int:
    """Consecutive k that sit side by side in a panel row: 2 for bf16 (vdpbf16ps), else 1."""
    return 2 if dtype == torch.bfloat16 else 1


def pack_panels(weight: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """W [N, K] -> [ceil(N / width), K / pair, width * pair] in W's dtype (float32 or bf16):
    panel p, row i holds W[p * width + j, i * pair + e] at j * pair + e. ``width``: the native
    build's ``panel_width()`` unless given (another target's)."""
    n, k = weight.shape
    if weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"panels hold float32 or bf16 weights, got {weight.dtype}")
    pair = _pair(weight.dtype)
    if k % pair:
        raise ValueError(f"bf16 panels need an even input size, got {k}")
    width = width or panel_width()
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
    ops = kernel_ops()
    if ops is None:
        raise RuntimeError("the panel GEMM kernel is not available")
    return ops.panel_gemm(x, packed, n)


def block_panel_gemm_available(dtype: torch.dtype) -> bool:
    """float32: AVX2 builds (AVX-512 ones included); bf16: AVX512-BF16 ones."""
    if kernel_ops() is None:
        return False
    want = {torch.float32: "avx2", torch.bfloat16: "avx512bf16"}.get(dtype)
    return want is not None and want in kernel_features()


def block_panel_gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                     minimum: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] with W as ``layers/quantized.py``'s ``BlockPanels`` holds it
    (``minimum`` None: 8-bit codes): the same bits as ``panel_gemm`` over W's panels
    (``torch.ops.conveyor.block_panel_gemm``)."""
    ops = kernel_ops()
    if ops is None:
        raise RuntimeError("the block panel GEMM kernel is not available")
    return ops.block_panel_gemm(x, codes, scale, minimum)
