"""Which decode steps of a model run all its layers in one C++ call (``kernels/decode_layer.cpp``):
each layer's weights as that kernel takes them, from its projections' formats
(``LinearMethod.decode_projection``) and its norms, as the architecture's declaration describes
its layers (``model/registry.py``'s ``DecodeLayerKind``: Llama's layers, those with per-head q/k
norms, Gemma 3's with output norms and a tanh GeLU gate)."""

from __future__ import annotations

import logging

from conveyor.model.kernels.decode_layer import DecodeLayers, DecodeLayerWeights
from conveyor.model.llama import DecoderLayer, LlamaForCausalLM
from conveyor.model.registry import DecodeLayerKind, architecture

logger = logging.getLogger(__name__)


def decode_weights(layer: DecoderLayer, kind: DecodeLayerKind) -> DecodeLayerWeights | None:
    """The layer's weights for the kernel, which runs decode steps with the same kernels as the
    layer's Python path, without the Python around each call, as ``kind`` describes it (q/k
    norms or not, no biases; output norms, the gate's activation, attention scale and its kind's
    rotary table); None unless its norms share one eps and its projections all have
    4-bit blocks (``NibbleInt4``, or ``BlockPanels`` in deterministic inference), ``QuantPanels``
    or integer compute. The kernel checks the rest as the layer is added. With every
    projection's panels too (or on integer compute) it serves any batch, else up to the blocks'
    ``max_tokens``."""
    output_norms = kind.output_norms
    projections = [p.method.decode_projection() for p in layer.projections]
    if None in projections or any(p.bias is not None for p in layer.projections):
        return None
    norms = [layer.input_norm, layer.post_norm]
    if layer.q_norm is not None:
        norms += [layer.q_norm, layer.k_norm]
    if output_norms:
        norms += [layer.post_attention_norm, layer.post_feedforward_norm]
    if any(norm.eps != layer.input_norm.eps for norm in norms):
        return None
    qk = layer.q_norm is not None
    return DecodeLayerWeights(
        layer.input_norm.weight, layer.post_norm.weight, projections, layer.num_heads,
        layer.num_kv_heads, layer.head_dim, layer.input_norm.eps, layer.window or 0,
        q_norm=layer.q_norm.weight if qk else None, k_norm=layer.k_norm.weight if qk else None,
        post_attention_norm=layer.post_attention_norm.weight if output_norms else None,
        post_feedforward_norm=layer.post_feedforward_norm.weight if output_norms else None,
        activation=kind.activation, scale=layer.scale,
        rotary=layer.rotary_index)


def fuse_decode_layers(model: LlamaForCausalLM) -> DecodeLayers | None:
    """Every layer of ``model`` for the kernel (after ``process_weights_after_loading``), or None
    where one cannot be (then each layer runs in Python). Not under tensor parallelism: the call
    cannot all-reduce mid-layer; not for an architecture declared without it."""
    kind = architecture(model.config.architecture).decode_layer
    if model.tp is not None or kind is None:
        return None
    layers = [decode_weights(layer, kind) for layer in model.layers]
    if None in layers:
        return None
    try:
        fused = DecodeLayers(layers)
    except RuntimeError as exc:  # sizes the kernel does not take, or no kernels here
        logger.info("decode layers stay separate: %s", exc)
        return None
    if model.lora is not None:
        fused.set_lora([layer.decode_lora() for layer in model.layers])
    return fused
