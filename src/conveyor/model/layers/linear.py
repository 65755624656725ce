"""``Linear``: y = x W^T (+ b), W held by one ``LinearMethod`` (a weight format and the kernel
that multiplies it), through a load's lifecycle as vLLM's linear methods go:

1. the weights are created: ``__init__`` makes the dense [out, in] Parameter every checkpoint
   loads into and names the parts of a stacked projection (``shards``: q/k/v, gate/up);
2. ``load`` copies one checkpoint tensor into its rows, and keeps the file's own quantized
   blocks where it has them (GGUF; ``layers/quantized.py``);
3. ``process_weights_after_loading`` lays the weight out in the format this device runs
   (``layers/formats.py``, from ``conveyor.model.device.select_kernels``' plan), which replaces
   the dense Parameter, so memory is not doubled;
4. ``forward`` is the method's ``apply``, plus LoRA adapters' updates (``layers/lora.py``).

The formats of a dense weight, one per CPU capability (vLLM's ``quant_method`` idea):

* ``DenseMethod``: the [out, in] weight and ``F.linear`` (GPUs, CPUs without a better path).
* ``PanelMethod``: column panels for the C++ GEMM of ``kernels/panel_gemm.cpp``, float32, and
  bf16 where the CPU has AVX512-BF16; faster than oneDNN's packed GEMM there
  (docs/performance.md).
* ``OneDnnMethod``: bf16 on CPUs with AMX (oneDNN's AMX GEMM beats the panels) or native bf16
  without AVX512-BF16, and float32 without a C++ compiler: oneDNN's packed layout, made once.

A checkpoint's blocks get ``layers/block_method.py``'s formats, which multiply them as stored
at small batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.kernels.panel_gemm import pack_panels, panel_gemm, unpack_panels
from conveyor.model.layers.gguf_blocks import FileBlocks, GGUFBlocks, stack_blocks
from conveyor.model.layers.lora import LoRALayer
from conveyor.model.layers.parameters import load_rows, new_parameter

if TYPE_CHECKING:
    from conveyor.model.kernels.decode_layer import DecodeProjection
    from conveyor.model.layers.embedding import VocabEmbedding


def nbytes(*tensors: torch.Tensor) -> int:
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
        """Bytes of the weight as held."""
        raise NotImplementedError

    def bytes_read(self, rows: int) -> int:
        """Bytes of weight a call with ``rows`` rows reads."""
        return self.nbytes()

    def decode_projection(self) -> DecodeProjection | None:
        """The weight as ``kernels/decode_layer.cpp`` multiplies it, or None where it has no
        kernel for this format."""
        return None


class DenseMethod(LinearMethod):
    """The [out, in] weight as it is, through ``F.linear``. It holds the layer's Parameter
    itself, so that ``.to()`` (which changes its data) reaches it."""

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
        return nbytes(self.weight)


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
        return nbytes(self.panels)


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
        return nbytes(self.packed)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shards: Mapping[str, int] | None = None) -> None:
        """``shards``: a stacked projection's parts, by their checkpoint names, and their
        output sizes, in order (q/k/v, gate/up); None: one part, unnamed."""
        super().__init__()
        sizes = dict(shards or {None: out_features})
        ends = list(accumulate(sizes.values()))
        if ends[-1] != out_features:
            raise ValueError(f"shards {sizes} do not add up to {out_features} outputs")
        self.shards: dict[str | None, tuple[int, int]] = {
            name: (end - size, end) for (name, size), end in zip(sizes.items(), ends, strict=True)}
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | None = new_parameter(out_features, in_features)
        self.bias = new_parameter(out_features, zero=True) if bias else None
        # the checkpoint's blocks of each shard, until process_weights_after_loading
        self.blocks: dict[str | None, FileBlocks] = {}
        self.method: LinearMethod = DenseMethod(self.weight)
        self.lora: LoRALayer | None = None  # LoRA adapters' updates (model.enable_lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(x, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)

    def load(self, param: str, shard: str | None, tensor: torch.Tensor,
             blocks: FileBlocks | None = None) -> None:
        """Copy a checkpoint tensor into ``param``'s rows of ``shard`` (a bias the layer lacks is
        made, zero where no shard fills it); ``blocks``: the file's own blocks of a weight."""
        start, stop = self.shards[shard]
        if param == "bias" and self.bias is None:
            self.bias = new_parameter(self.out_features, zero=True)
        load_rows(self.bias if param == "bias" else self.weight, start, stop, tensor)
        if blocks is not None and param == "weight":
            rows = blocks.out_features if isinstance(blocks, GGUFBlocks) else blocks.codes.shape[0]
            if rows != stop - start:
                raise ValueError(f"blocks of {rows} rows for {stop - start}")
            self.blocks[shard] = blocks

    def tie(self, embedding: VocabEmbedding) -> None:
        """Share a (tied) embedding's dense weight and checkpoint blocks, until
        ``process_weights_after_loading`` lays out a copy of its own."""
        self.weight = embedding.weight
        self.blocks = embedding.blocks
        self.method = DenseMethod(self.weight)

    def process_weights_after_loading(
            self, choose: Callable[[nn.Parameter, FileBlocks | None], LinearMethod]) -> None:
        """Lay the loaded weight out in the format ``choose`` gives for it and for the
        checkpoint's blocks, where every shard came as blocks (``stack_blocks``, else None):
        ``layers/formats.py``'s ``linear_format``. Inference only, after ``.to()``."""
        blocks = stack_blocks([self.blocks.get(name) for name in self.shards])
        self.blocks = {}
        self.set_method(choose(self.weight, blocks))

    def set_method(self, method: LinearMethod) -> None:
        """Hold the weight in ``method``'s format from now on; a format other than
        ``DenseMethod`` drops the dense Parameter."""
        if method.out_features != self.out_features:
            raise ValueError(f"method has {method.out_features} outputs for a "
                             f"{self.out_features}-output layer")
        self.method = method
        if not isinstance(method, DenseMethod):
            self.weight = None

    def weight_bytes(self, rows: int) -> int:
        """Bytes of weight a call with ``rows`` rows reads."""
        return self.method.bytes_read(rows)

    def dense_weight(self) -> torch.Tensor:
        """The weight as an [out, in] matrix, whatever its format."""
        return self.method.dense_weight()
