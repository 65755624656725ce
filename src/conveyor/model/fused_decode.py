"""Which decode steps of a model run all its layers in one C++ call (``kernels/decode_layer.cpp``):
each layer's weights as that kernel takes them, from its projections' formats
(``LinearMethod.decode_projection``)."""

from __future__ import annotations

import logging

from conveyor.model.kernels.decode_layer import DecodeLayers, DecodeLayerWeights
from conveyor.model.llama import DecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)


def decode_weights(layer: DecoderLayer) -> DecodeLayerWeights | None:
    """The layer's weights for the kernel, which runs decode steps with the same kernels as the
    layer's Python path, without the Python around each call; None unless it is a Llama layer
    (no q/k norms, no biases) whose projections all have 4-bit blocks (``NibbleInt4``, or
    ``BlockPanels`` in deterministic inference). The kernel checks the rest as the layer is
    added. With every projection's panels too (or on integer compute) it serves any batch, else
    up to the blocks' ``max_tokens``. A layer with an attention scale of its own, or a layer
    class other than Llama's (Gemma 3's norms and activation), stays on the Python path."""
    projections = [p.method.decode_projection() for p in layer.projections]
    if (type(layer) is not DecoderLayer or layer.scale is not None
            or layer.q_norm is not None or None in projections
            or any(p.bias is not None for p in layer.projections)):
        return None
    return DecodeLayerWeights(layer.input_norm.weight, layer.post_norm.weight, projections,
                              layer.num_heads, layer.num_kv_heads, layer.head_dim,
                              layer.input_norm.eps, layer.window or 0)


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
