"""Linear layer whose weight is held by one ``LinearMethod`` (the format and the kernel that
multiplies it, chosen once at load by ``conveyor.model.device.select_kernels``), with an
optional quantized copy for small batches.

The methods, one per weight format and CPU capability (vLLM's ``quant_method`` idea):

* ``DenseMethod``: the [out, in] weight and ``F.linear`` (GPUs, CPUs without a better path).
* ``PanelMethod``: column panels for the C++ GEMM of ``kernels/panel_gemm.cpp``, float32, and
  bf16 where the CPU has AVX512-BF16; faster than oneDNN's packed GEMM there
  (docs/performance.md).
* ``OneDnnMethod``: bf16 on CPUs with AMX (oneDNN's AMX GEMM beats the panels) or native bf16
  without AVX512-BF16, and float32 without a C++ compiler: oneDNN's packed layout, made once.
* ``Int8PanelMethod``: a bf16 model's GGUF 4-bit or 8-bit blocks as ``Int8Panels``
  (``kernels/int8_gemm.cpp``, AVX512-VNNI), activations rounded to 8 bits per block of 32
  (docs/performance.md).

Each replaces the dense weight, so memory is not doubled; ``dense_weight()`` gives the
[out, in] matrix back.

When the checkpoint stored the weight as blocks (GGUF Q4_0 / Q4_1 / Q8_0), ``quantized`` holds
them too (``layers/quantized.py``) and serves calls of up to its ``max_tokens`` rows, where
reading the weight dominates and the blocks are fewer bytes. ``lora`` adds LoRA adapters'
updates to the output (``layers/lora.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.kernels.panel_gemm import pack_panels, panel_gemm, unpack_panels
from conveyor.model.layers.lora import LoRALayer
from conveyor.model.layers.quantized import (
    BlockPanels,
    Int4Blocks,
    Int8Blocks,
    Int8Panels,
    NibbleInt4,
)


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class LinearMethod:
    """A weight [out_features, in_features] in one format, and how to multiply by it."""

    out_features: int
    dtype: torch.dtype  # the activations' (and dense_weight's)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, in] @ W^T (+ bias) -> [M, out]."""
        raise NotImplementedError

    def dense_weight(self) -> torch.Tensor:
        """The weight as an [out, in] matrix."""
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError


class DenseMethod(LinearMethod):
    """The [out, in] weight as it is, through ``F.linear``. It holds the layer's Parameter
    itself, so that loading and ``.to()`` (which change its data) reach it."""

    def __init__(self, weight: nn.Parameter) -> None:
        self.weight = weight

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def dense_weight(self) -> torch.Tensor:
        return self.weight

    def nbytes(self) -> int:
        return _bytes(self.weight)


class PanelMethod(LinearMethod):
    """Column panels (``pack_panels``) for ``kernels/panel_gemm.cpp``."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.dtype = weight.shape[0], weight.dtype
        self.panels = pack_panels(weight)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = panel_gemm(x, self.panels, self.out_features)
        return y if bias is None else y.add_(bias)

    def dense_weight(self) -> torch.Tensor:
        return unpack_panels(self.panels, self.out_features)

    def nbytes(self) -> int:
        return _bytes(self.panels)


PACK_BATCH_HINT = 64  # batch size oneDNN tunes the packed layout for


class OneDnnMethod(LinearMethod):
    """oneDNN's packed layout. ``F.linear`` on bf16 CPU tensors re-lays the weight out for
    oneDNN on every call; packing it once makes the small-batch (decode) matmuls about twice
    as fast."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.dtype = weight.shape[0], weight.dtype
        # torch has no public API that takes a pre-packed oneDNN weight: these private mkldnn
        # ops are the ones torch.compile's CPU backend (inductor) emits for packed linears.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        self._linear = torch.ops.mkldnn._linear_pointwise

    @staticmethod
    def available() -> bool:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                "_linear_pointwise")

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._linear(x, self.packed, bias, "none", [], "")

    def dense_weight(self) -> torch.Tensor:
        return self.packed.to_dense()

    def nbytes(self) -> int:
        return _bytes(self.packed)


class Int8PanelMethod(LinearMethod):
    """A GGUF file's blocks as ``Int8Panels`` (``kernels/int8_gemm.cpp``); ``dtype``: the
    activations' (what ``dense_weight`` gives)."""

    def __init__(self, panels: Int8Panels, dtype: torch.dtype) -> None:
        self.int8, self.dtype = panels, dtype
        self.out_features = panels.n_out

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.int8.matmul(x)
        return y if bias is None else y.add_(bias)

    def dense_weight(self) -> torch.Tensor:
        return self.int8.dequantize().to(self.dtype)

    def nbytes(self) -> int:
        return self.int8.nbytes()


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features),
                                                        requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False) if bias
                     else None)
        self.out_features = out_features
        self.method: LinearMethod = DenseMethod(self.weight)
        # serves up to its max_tokens rows (BlockPanels: deterministic inference)
        self.quantized: NibbleInt4 | Int8Blocks | BlockPanels | None = None
        self.lora: LoRALayer | None = None  # LoRA adapters' updates (model.enable_lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and x.shape[0] <= self.quantized.max_tokens:
            y = self.quantized.matmul(x)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = self.method.apply(x, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)

    def weight_bytes(self, rows: int) -> int:
        """Bytes of weight a call with ``rows`` rows reads."""
        if self.quantized is not None and rows <= self.quantized.max_tokens:
            return self.quantized.nbytes()
        return self.method.nbytes()

    def dense_weight(self) -> torch.Tensor:
        """The weight as an [out, in] matrix, whatever its format."""
        return self.method.dense_weight()

    def share_weight(self, weight: nn.Parameter) -> None:
        """Use ``weight`` (a tied embedding) as this layer's dense weight."""
        self.weight = weight
        self.method = DenseMethod(weight)

    def set_method(self, method: LinearMethod) -> None:
        """Hold the weight in ``method``'s format from now on (inference only, after ``.to()``);
        the dense Parameter is dropped, so memory is not doubled."""
        if method.out_features != self.out_features:
            raise ValueError(f"method has {method.out_features} outputs for a "
                             f"{self.out_features}-output layer")
        self.method = method
        self.weight = None

    def prepack(self, method: type[LinearMethod]) -> None:
        """Lay the dense weight out in ``method``'s format (``PanelMethod``, ``OneDnnMethod``);
        a layer that already left its dense weight keeps its format."""
        if not isinstance(self.method, DenseMethod):
            return
        if method is DenseMethod:
            return
        if method not in (PanelMethod, OneDnnMethod):
            raise ValueError(f"method must be PanelMethod or OneDnnMethod, got {method!r}")
        self.set_method(method(self.weight.data))

    def use_int8_panels(self, blocks: Int4Blocks | Int8Blocks,
                        exact: torch.Tensor | None = None) -> int:
        """Serve calls above the blocks' rows from ``Int8Panels`` of the checkpoint's ``blocks``
        (``exact``: input channels kept out of the rounding) instead of the current format.
        Returns the bytes added."""
        if blocks.codes.shape[0] != self.out_features:
            raise ValueError(f"blocks of {blocks.codes.shape[0]} outputs for a "
                             f"{self.out_features}-output layer")
        method = Int8PanelMethod(Int8Panels.pack(blocks, exact), self.method.dtype)
        self.set_method(method)
        return method.nbytes()
