"""``Linear``: y = x W^T (+ b), W held by one ``LinearMethod`` (a weight format and the kernel
that multiplies it), through a load's lifecycle as vLLM's linear methods go:

1. ``__init__`` names the parts of a stacked projection (``shards``: q/k/v, gate/up) and
   creates no weight: what a checkpoint brings decides what is kept;
2. ``load`` takes one checkpoint tensor into its shard: a dense one into rows of the dense
   [out, in] Parameter (made by the first), or a GGUF file's blocks (``layers/gguf_blocks.py``'s
   ``GGUFBlocks``, the one stored form of a quantized tensor) as they are, never dequantized;
3. ``process_weights_after_loading`` has the format chosen for this device
   (``layers/formats.py``, from ``conveyor.model.device.select_kernels``' plan) pack its own
   layout from what was loaded: the blocks alone under integer compute, a dense format made from
   them (one weight at a time) where one is needed; the dense Parameter is dropped when the
   format keeps another layout, so memory is not doubled;
4. ``forward`` is the method's ``apply``, plus LoRA adapters' updates (``layers/lora.py``).

The loader finds every ``Linear`` by walking the model's module tree, so a projection of any
shape (an expert's, a router, a projector) goes through the same steps.

The formats of a dense weight, one per CPU capability (vLLM's ``quant_method`` idea):

* ``DenseMethod``: the [out, in] weight and ``F.linear`` (GPUs, CPUs without a better path).
* ``PanelMethod``: column panels for the C++ GEMM of ``kernels/panel_gemm.cpp``, float32, and
  bf16 where the CPU has AVX512-BF16; faster than oneDNN's packed GEMM there
  (docs/performance.md).
* ``OneDnnMethod``: bf16 on CPUs with AMX (oneDNN's AMX GEMM beats the panels) or native bf16
  without AVX512-BF16, and float32 without a C++ compiler: oneDNN's packed layout, made once.

A checkpoint's blocks get ``layers/block_method.py``'s formats, which multiply them as stored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.kernels.panel_gemm import pack_panels, panel_gemm, unpack_panels
from conveyor.model.layers.gguf_blocks import GGUFBlocks, stack_blocks
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
        # the dense [out, in] weight, made by the first dense tensor loaded (load)
        self.weight: nn.Parameter | None = None
        self.bias = new_parameter(out_features, zero=True) if bias else None
        # the checkpoint's blocks of each shard, until process_weights_after_loading
        self.blocks: dict[str | None, GGUFBlocks] = {}
        # DenseMethod over the dense weight once loaded; the device's format after loading
        self.method: LinearMethod | None = None
        self.tied: VocabEmbedding | None = None  # the embedding whose table this layer is
        self.processed = False  # process_weights_after_loading has run
        self.lora: LoRALayer | None = None  # LoRA adapters' updates (model.enable_lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method is None:
            raise RuntimeError("this Linear has no weight: load one (Linear.load)")
        y = self.method.apply(x, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)

    def load(self, param: str, shard: str | None, tensor: torch.Tensor | None,
             blocks: GGUFBlocks | None = None) -> None:
        """One checkpoint tensor into ``param``'s rows of ``shard`` (a bias the layer lacks is
        made, zero where no shard fills it): a weight's ``blocks`` as they are (no dense rows
        then), else the dense ``tensor``."""
        start, stop = self.shards[shard]
        if param == "bias":
            if self.bias is None:
                self.bias = new_parameter(self.out_features, zero=True)
            load_rows(self.bias, start, stop, tensor)
        elif blocks is not None:
            blocks.check_shape(stop - start, self.in_features)
            self.blocks[shard] = blocks
        else:
            if self.weight is None:
                self.weight = new_parameter(self.out_features, self.in_features)
            load_rows(self.weight, start, stop, tensor)
            self.method = DenseMethod(self.weight)

    def tie(self, embedding: VocabEmbedding) -> None:
        """Multiply by a (tied) embedding's table: what the embedding loads, this layer lays
        out in its own format after loading."""
        self.tied = embedding

    def process_weights_after_loading(
            self, choose: Callable[[nn.Parameter | None, GGUFBlocks | None], LinearMethod]
    ) -> None:
        """Lay the loaded weight out in the format ``choose`` gives for the dense weight (None
        where every shard came as blocks) and the checkpoint's blocks (``stack_blocks``: None
        unless every shard came as blocks): ``layers/formats.py``'s ``linear_format``. Where some
        shards came dense and others as blocks, the blocks are dequantized into the dense rows.
        Inference only, after ``.to()``."""
        weight, shard_blocks = self.weight, self.blocks
        if self.tied is not None:
            weight, shard_blocks = self.tied.weight, self.tied.blocks
        parts = [shard_blocks.get(name) for name in self.shards]
        blocks = stack_blocks(parts)
        if blocks is None and any(p is not None for p in parts):
            if weight is None:
                raise ValueError("a stacked weight needs all of its shards loaded")
            for name, part in shard_blocks.items():
                start, stop = self.shards[name]
                weight.data[start:stop] = part.dequantize().to(weight.dtype)
        if weight is None and blocks is None:
            raise ValueError("no weight was loaded")
        self.blocks = {}
        self.set_method(choose(weight, blocks))
        self.processed = True

    def set_method(self, method: LinearMethod) -> None:
        """Hold the weight in ``method``'s format from now on; a format other than
        ``DenseMethod`` drops the dense Parameter."""
        if method.out_features != self.out_features:
            raise ValueError(f"method has {method.out_features} outputs for a "
                             f"{self.out_features}-output layer")
        self.method = method
        self.weight = method.weight if isinstance(method, DenseMethod) else None

    def weight_bytes(self, rows: int) -> int:
        """Bytes of weight a call with ``rows`` rows reads."""
        return self.method.bytes_read(rows)

    def dense_weight(self) -> torch.Tensor:
        """The weight as an [out, in] matrix, whatever its format."""
        return self.method.dense_weight()
