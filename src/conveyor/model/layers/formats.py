"""The format each projection's weight takes, chosen once at load (``Linear``'s
``process_weights_after_loading``) from this device's ``KernelPlan`` and what the checkpoint
gave: the plan's dense format (``layers/linear.py``), and where the checkpoint stored the weight
as blocks, ``BlockMethod`` over them with that format, or with ``int8`` (4-bit and 8-bit blocks)
their integer GEMM (``layers/block_method.py``), above their rows."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from conveyor.model.layers.block_method import BlockMethod, Int8PanelMethod
from conveyor.model.layers.gguf_blocks import FileBlocks, GGUFBlocks
from conveyor.model.layers.linear import DenseMethod, LinearMethod

if TYPE_CHECKING:
    from conveyor.model.device import KernelPlan


def linear_format(kernels: KernelPlan, weight: nn.Parameter, blocks: FileBlocks | None,
                  int8: bool = False, exact: torch.Tensor | None = None) -> LinearMethod:
    """``weight`` (and ``blocks``) in their format; ``int8``: the 4-bit and 8-bit blocks' integer
    GEMM in place of the dense format (``exact``: the input channels it keeps exact,
    calibration.py)."""
    if blocks is not None and not isinstance(blocks, GGUFBlocks) and int8:
        large: LinearMethod = Int8PanelMethod.pack(blocks, weight.dtype, exact)
    elif kernels.linear is DenseMethod:
        large = DenseMethod(weight)
    else:
        large = kernels.linear(weight.data)
    return large if blocks is None else BlockMethod.pack(blocks, large, kernels.deterministic)
