"""The format each projection's weight takes, chosen once at load (``Linear``'s
``process_weights_after_loading``) from this device's ``KernelPlan`` and what the checkpoint
gave: the plan's dense format (``layers/linear.py``), and where the checkpoint stored the weight
as blocks, ``BlockMethod`` over them with that format above their rows, or under integer compute
(``KernelPlan.int8_blocks``) ``Int8BlockMethod``, the blocks on integer dot products at every
row count (``layers/block_method.py``), with no dense copy at all."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from conveyor.model.layers.block_method import BlockMethod, Int8BlockMethod
from conveyor.model.layers.gguf_blocks import GGUFBlocks
from conveyor.model.layers.linear import DenseMethod, LinearMethod
from conveyor.model.layers.parameters import new_parameter

if TYPE_CHECKING:
    from conveyor.model.device import KernelPlan


def linear_format(kernels: KernelPlan, dtype: torch.dtype, weight: nn.Parameter | None,
                  blocks: GGUFBlocks | None) -> LinearMethod:
    """The format of a weight loaded as ``weight`` (dense, in ``dtype``; None where it came as
    blocks alone) and ``blocks``; a dense format over blocks alone is made from their
    dequantization (gguf's, bit for bit), one weight at a time."""
    if blocks is not None and kernels.int8_blocks:
        return Int8BlockMethod(blocks, dtype)
    if weight is None:
        weight = new_parameter(0, 0)
        weight.data = blocks.dequantize().to(dtype)
    large = DenseMethod(weight) if kernels.linear is DenseMethod else kernels.linear(weight.data)
    return large if blocks is None else BlockMethod.pack(blocks, large, kernels.deterministic)
