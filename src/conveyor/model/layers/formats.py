"""The format each projection's weight takes, chosen once at load (``Linear``'s
``process_weights_after_loading``) from this device's ``KernelPlan`` and what the checkpoint
gave: the plan's dense format (``layers/linear.py``), and where the checkpoint stored the weight
as blocks, ``BlockMethod`` over them with that format above their rows, or under integer compute
(``KernelPlan.int8_blocks``) ``Int8BlockMethod``, the blocks on integer dot products at every
row count (``layers/block_method.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from conveyor.model.layers.block_method import BlockMethod, Int8BlockMethod
from conveyor.model.layers.gguf_blocks import FileBlocks
from conveyor.model.layers.linear import DenseMethod, LinearMethod

if TYPE_CHECKING:
    from conveyor.model.device import KernelPlan


def linear_format(kernels: KernelPlan, weight: nn.Parameter,
                  blocks: FileBlocks | None) -> LinearMethod:
    """``weight`` (and ``blocks``) in their format."""
    if blocks is not None and kernels.int8_blocks:
        integer = Int8BlockMethod.pack(blocks, weight.dtype)
        if integer is not None:
            return integer
    if kernels.linear is DenseMethod:
        large: LinearMethod = DenseMethod(weight)
    else:
        large = kernels.linear(weight.data)
    return large if blocks is None else BlockMethod.pack(blocks, large, kernels.deterministic)
