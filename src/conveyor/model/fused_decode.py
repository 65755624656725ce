"""Which decode steps of a model run all its layers in one C++ call (``kernels/decode_layer.cpp``):
each layer's weights as that kernel takes them, from its projections' formats
(``LinearMethod.decode_projection``) and its norms. Llama's layers, those with per-head q/k
norms (Qwen3's) and Gemma 3's qualify."""

from __future__ import annotations

import logging

from conveyor.model.gemma3 import Gemma3DecoderLayer
from conveyor.model.kernels.decode_layer import DecodeLayers, DecodeLayerWeights
from conveyor.model.llama import DecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)


def decode_weights(layer: DecoderLayer) -> DecodeLayerWeights | None:
    """The layer's weights for the kernel, which runs decode steps with the same kernels as the
    layer's Python path, without the Python around each call; None unless it is a Llama layer
    (q/k norms or not, no biases) or a Gemma 3 layer (its output norms, tanh GeLU, attention
    scale and its kind's rotary table) whose norms share one eps and whose projections all have
    4-bit blocks (``NibbleInt4``, or ``BlockPanels`` in deterministic inference), ``QuantPanels``
    or integer compute. The kernel checks the rest as the layer is added. With every
    projection's panels too (or on integer compute) it serves any batch, else up to the blocks'
    ``max_tokens``."""
    gemma = type(layer) is Gemma3DecoderLayer
    projections = [p.method.decode_projection() for p in layer.projections]
    if ((type(layer) is not DecoderLayer and not gemma) or None in projections
            or any(p.bias is not None for p in layer.projections)):
        return None
    norms = [layer.input_norm, layer.post_norm]
    if layer.q_norm is not None:
        norms += [layer.q_norm, layer.k_norm]
    if gemma:
        norms += [layer.post_attention_norm, layer.post_feedforward_norm]
    if any(norm.eps != layer.input_norm.eps for norm in norms):
        return None
    qk = layer.q_norm is not None
    return DecodeLayerWeights(
        layer.input_norm.weight, layer.post_norm.weight, projections, layer.num_heads,
        layer.num_kv_heads, layer.head_dim, layer.input_norm.eps, layer.window or 0,
        q_norm=layer.q_norm.weight if qk else None, k_norm=layer.k_norm.weight if qk else None,
        post_attention_norm=layer.post_attention_norm.weight if gemma else None,
        post_feedforward_norm=layer.post_feedforward_norm.weight if gemma else None,
        activation="gelu_tanh" if gemma else "silu", scale=layer.scale,
        rotary=layer.rotary_index)


def fuse_decode_layers(model: LlamaForCausalLM) -> DecodeLayers | None:
    """Every layer of ``model`` for the kernel (after ``process_weights_after_loading``), or None
    where one cannot be (then each layer runs in Python). Not under tensor parallelism: the call
    cannot all-reduce mid-layer."""
    if model.tp is not None:
        return None
    layers = [decode_weights(layer) for layer in model.layers]
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
