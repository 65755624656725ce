"""Every decoder layer of a decode step in one call (``torch.ops.conveyor.decode_layers``,
``decode_layer.cpp``): Llama's layers, with per-head q/k norms (Qwen3's), or Gemma 3's (norms of
the attention's and the MLP's outputs, the tanh GeLU, an attention scale, a rotary table per
layer kind, a KV-cache group per layer).

``DecodeLayers`` holds a model's layers as the C++ side's ``DecodeLayers`` object, built once at
load time from each layer's ``DecodeLayerWeights`` (its norms, sizes and a ``DecodeProjection``
per projection): the C++ side checks every tensor's dtype, shape and contiguity against the
layer's sizes as it is added, and keeps the tensors alive.
``decode_layer_available()`` builds the kernels on first use (see ``build.py``);
``CONVEYOR_KERNELS=off`` turns them off. ``set_lora`` gives the layers a model's LoRA stacks:
decode steps whose rows run under adapters then add their updates after each projection, as the
Python path does (``kernels/lora_ops.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from conveyor.model.kernels.build import kernel_ops

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def decode_layer_available() -> bool:
    return kernel_ops() is not None


class FourBitBlocks(Protocol):
    """4-bit blocks as ``layers/quantized.py``'s ``NibbleInt4`` or ``BlockPanels`` hold them,
    serving up to ``max_tokens`` rows."""
    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    max_tokens: int


class QuantPart(Protocol):
    """One part of ``layers/gguf_blocks.py``'s ``QuantPanels``: a GGUF type id and its bytes."""
    kind: int
    codes: torch.Tensor
    header: torch.Tensor
    n_out: int


class QuantBlocks(Protocol):
    """``layers/gguf_blocks.py``'s ``QuantPanels``, serving up to ``max_tokens`` rows."""
    parts: list[QuantPart]
    max_tokens: int


class Int8BlockWeights(Protocol):
    """``layers/block_method.py``'s ``Int8BlockMethod``: per part in output order, a GGUF type
    id, the file's bytes and the rows."""
    formats: list[int]
    data: list[torch.Tensor]
    sizes: list[int]


@dataclass(frozen=True)
class DecodeProjection:
    """A projection's weight as the kernel multiplies it: its 4-bit blocks (``panel_order``: as
    ``BlockPanels``, deterministic inference, else as ``NibbleInt4``) or its ``QuantPanels`` up
    to their rows, then what serves more rows, if anything: its panels (``pack_panels``' layout
    in the activations' dtype). ``integer``: ``blocks`` are
    ``Int8BlockWeights``, serving every row on the integer block GEMM."""
    blocks: FourBitBlocks | QuantBlocks | Int8BlockWeights
    panel_order: bool
    panels: torch.Tensor | None = None
    integer: bool = False


ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gate: Llama's, Gemma's


@dataclass
class DecodeLayerWeights:
    """A layer's norms (float32 or bf16: the activations' dtype, one ``eps``) and its
    projections, in ``PROJECTIONS`` order; then what a layer may add to Llama's: per-head q/k
    norms ([head_dim], before the rotary: Qwen3, Gemma 3), norms of the attention's output (after
    o) and of the MLP's (after down), both [hidden] (Gemma 3), the tanh GeLU gate, an attention
    scale of its own (None: head_dim**-0.5), and which of the call's rotary tables it takes
    (``decode_layers``' ``cos``/``sin`` lists)."""
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    projections: list[DecodeProjection]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    window: int = 0  # attention's sliding window (``kernel_attention``); 0: none
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attention_norm: torch.Tensor | None = None
    post_feedforward_norm: torch.Tensor | None = None
    activation: str = "silu"  # one of ACTIVATIONS
    scale: float | None = None
    rotary: int = 0


class LoRAStacks(Protocol):
    """A projection's LoRA adapters (``layers/lora.LoRALayer``): ``a`` [slots, R, in] and ``b``
    [slots, R, out], float32, written in place, and the rows of R in use, ``width``, which
    grows when a wider adapter is loaded."""
    a: torch.Tensor
    b: torch.Tensor
    width: int


class DecodeLayers:
    """A model's layers for ``decode_layers``, in order, and the most rows (decode tokens) they
    serve: None for any number."""

    def __init__(self, layers: list[DecodeLayerWeights]) -> None:
        ops = kernel_ops()
        if ops is None:
            raise RuntimeError("the decode layer kernel is not available")
        self.weights = torch.classes.conveyor.DecodeLayers()
        for w in layers:
            self.weights.add_layer(w.input_norm, w.post_norm, w.num_heads, w.num_kv_heads,
                                   w.head_dim, w.eps, w.window, q_norm=w.q_norm,
                                   k_norm=w.k_norm, post_attention_norm=w.post_attention_norm,
                                   post_feedforward_norm=w.post_feedforward_norm,
                                   activation=w.activation, scale=w.scale, rotary=w.rotary)
            for p in w.projections:
                b = p.blocks
                if p.integer:
                    self.weights.add_int8_projection(b.formats, b.data, b.sizes)
                    continue
                if hasattr(b, "parts"):
                    parts = b.parts
                    self.weights.add_quant_projection(
                        [t.kind for t in parts], [t.codes for t in parts],
                        [t.header for t in parts], [t.n_out for t in parts], b.max_tokens,
                        p.panels)
                    continue
                self.weights.add_projection(b.codes, b.scale, b.min, b.max_tokens,
                                            p.panel_order, p.panels)
        self.num_layers = len(layers)
        self.dtype = layers[0].input_norm.dtype
        max_rows = self.weights.max_rows()
        self.max_rows = None if max_rows < 0 else max_rows
        self.run = ops.decode_layers.default
        self.lora: list[LoRAStacks] | None = None  # every layer's, in PROJECTIONS order

    def serves(self, rows: int) -> bool:
        return self.max_rows is None or rows <= self.max_rows

    def set_lora(self, stacks: Sequence[Sequence[LoRAStacks]]) -> None:
        """Each layer's LoRA stacks, per projection in ``PROJECTIONS`` order. The C++ side checks
        their shapes and holds the tensors: stacks allocated once and written in place serve
        every later call, each call reading the widths."""
        if len(stacks) != self.num_layers:
            raise ValueError(f"need the stacks of {self.num_layers} layers, got {len(stacks)}")
        for i, layer in enumerate(stacks):
            self.weights.set_lora(i, [t for p in layer for t in (p.a, p.b)])
        self.lora = [p for layer in stacks for p in layer]


def decode_layers(layers: DecodeLayers, x: torch.Tensor, residual: torch.Tensor,
                  cos: torch.Tensor | Sequence[torch.Tensor],
                  sin: torch.Tensor | Sequence[torch.Tensor],
                  kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                  slot_mapping: torch.Tensor | Sequence[torch.Tensor],
                  block_tables: torch.Tensor | Sequence[torch.Tensor],
                  context_lens: torch.Tensor | Sequence[torch.Tensor],
                  lora_slots: torch.Tensor | None = None,
                  layer_groups: Sequence[int] = ()) -> torch.Tensor:
    """Runs every layer on ``x`` [T, hidden] (one decode token per row) and returns the last
    layer's output, written over ``x``; ``residual`` is updated in place and each layer's K/V
    are written to their slots, as the Python path does. Every tensor but the index ones is in
    the layers' dtype. ``cos``, ``sin``: the rotary table, or a list of them, a layer taking the
    one its ``DecodeLayerWeights.rotary`` names. ``slot_mapping``, ``block_tables``,
    ``context_lens``: the step's, or with a hybrid KV cache a list of each KV-cache group's, layer
    ``l`` reading group ``layer_groups[l]``'s. ``lora_slots`` [T] int32: each row's LoRA slot (0: none)
    in the stacks of ``set_lora``."""
    widths = []
    if lora_slots is not None:
        if layers.lora is None:
            raise ValueError("lora_slots need the layers' LoRA stacks (set_lora)")
        widths = [p.width for p in layers.lora]
    layers.run(layers.weights, x, residual, _listed(cos), _listed(sin),
               [k for k, _ in kv_caches], [v for _, v in kv_caches], _listed(slot_mapping),
               _listed(block_tables), _listed(context_lens), list(layer_groups),
               lora_slots, widths)
    return x


def _listed(t: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t] if isinstance(t, torch.Tensor) else list(t)
