"""Integer matmul against a weight kept as a GGUF file's own bytes
(``torch.ops.conveyor.int8_block_gemm``, ``int8_blocks.cpp``): activations rounded to 8 bits per
row and block of 32, multiplied by the weight's codes on the CPU's integer dot products
(AVX512-VNNI, AVX-VNNI, AVX2; plain C++ on the baseline target, with the same bits).

``int8_block_gemm_available()`` builds the kernels on first use (see ``build.py``);
``CONVEYOR_KERNELS=off`` turns them off. The weight's form is ``layers/gguf_blocks.py``'s
``GGUFBlocks``: parts of consecutive outputs, each one GGUF type's rows, the file's bytes laid
out by panels of ``int8_panel_lanes()`` outputs (``GGUFPart.lane_panels``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from conveyor.model.kernels.build import kernel_ops

ACT_BLOCK = 32  # activations per 8-bit scale


def int8_block_gemm_available() -> bool:
    return kernel_ops() is not None


def int8_panel_lanes() -> int:
    """Outputs per panel of the built kernel's weight layout."""
    ops = kernel_ops()
    if ops is None:
        raise RuntimeError("the int8 block GEMM kernel is not available")
    return ops.int8_panel_lanes()


def int8_block_gemm(x: torch.Tensor, formats: Sequence[int], blocks: Sequence[torch.Tensor],
                    sizes: Sequence[int]) -> torch.Tensor:
    """x [M, K] (float32 or bf16) @ W^T -> [M, sum(sizes)] in x's dtype, W's parts in output
    order: part i ``sizes[i]`` rows of GGUF type ``formats[i]``, ``blocks[i]`` uint8, the file's
    bytes by panels (``GGUFPart.lane_panels(int8_panel_lanes())``)."""
    ops = kernel_ops()
    if ops is None:
        raise RuntimeError("the int8 block GEMM kernel is not available")
    return ops.int8_block_gemm(x, list(formats), list(blocks), list(sizes))
