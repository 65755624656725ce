"""The one-call decode layer (kernels/decode_layer.cpp) against the layer's Python path: same
outputs, residual stream and KV cache, bit for bit, and used only where it applies."""

from __future__ import annotations

import pytest
import torch

from conveyor.model.config import ModelConfig
from conveyor.model.kernels.decode_attention import decode_kernel_available
from conveyor.model.kernels.decode_layer import decode_layer_available
from conveyor.model.layers.attention import build_attention_metadata
from conveyor.model.layers.quantized import GROUP, Int4Blocks, pack_blocks
from conveyor.model.layers.rotary import RotaryEmbedding, rope_inv_freq
from conveyor.model.llama import DecoderLayer

pytestmark = pytest.mark.skipif(
    not (decode_layer_available() and decode_kernel_available(torch.device("cpu"), torch.float32)),
    reason="the C++ kernels cannot be built here")

CFG = ModelConfig(name="tiny", architecture="llama", num_layers=1, hidden_size=128,
                  intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32,
                  vocab_size=100, max_position_embeddings=512, rms_norm_eps=1e-5)
BLOCK = 16


def quantized_layer(seed: int = 0) -> DecoderLayer:
    """A layer whose dense weights are its random 4-bit blocks, dequantized."""
    g = torch.Generator().manual_seed(seed)
    layer = DecoderLayer(CFG)
    for norm in (layer.input_norm, layer.post_norm):
        norm.weight.data = 1 + 0.1 * torch.randn(norm.weight.shape, generator=g)
    for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        n, k = linear.weight.shape
        scale = torch.rand(n, k // GROUP, generator=g) * 0.02 + 0.005
        blocks = Int4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g), scale,
                            -8 * scale + 0.01 * torch.randn(n, k // GROUP, generator=g))
        linear.weight.data = blocks.dequantize()
        linear.quantized = pack_blocks(blocks, torch.float32)
    return layer


def decode_step(num_seqs: int, seed: int = 1):
    """Inputs of one decode step of ``num_seqs`` sequences with random cached contexts."""
    g = torch.Generator().manual_seed(seed)
    contexts = [int(c) for c in torch.randint(1, 60, (num_seqs,), generator=g)]
    tables, nxt = [], 0
    for c in contexts:
        need = c // BLOCK + 1
        tables.append(list(range(nxt, nxt + need))[::-1])  # scattered blocks
        nxt += need
    shape = (nxt, BLOCK, CFG.num_kv_heads, CFG.head_dim)
    caches = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    meta = build_attention_metadata(tables, contexts, [1] * num_seqs, BLOCK,
                                    CFG.num_queries_per_kv, torch.device("cpu"), True)
    rotary = RotaryEmbedding(rope_inv_freq(CFG.head_dim, 10000.0, None))
    cos, sin = rotary.cos_sin(meta.positions, torch.float32)
    x = torch.randn(num_seqs, CFG.hidden_size, generator=g)
    residual = torch.randn(num_seqs, CFG.hidden_size, generator=g)
    return x, residual, cos, sin, caches, meta


@pytest.mark.parametrize("num_seqs", [1, 3, 5, 12])
def test_fused_layer_equals_python_path(num_seqs):
    layer = quantized_layer()
    assert layer.fuse_for_decode()
    x, residual, cos, sin, (k, v), meta = decode_step(num_seqs)
    assert meta.decode_only
    results = []
    for fused in (layer.fused, None):
        layer.fused = fused
        res, kc, vc = residual.clone(), k.clone(), v.clone()
        out = layer(x, res, cos, sin, kc, vc, meta)
        results.append((out, res, kc, vc))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_fused_layer_is_used_only_where_it_applies(monkeypatch):
    import conveyor.model.llama as llama

    calls = []
    real = llama.decode_layer
    monkeypatch.setattr(llama, "decode_layer", lambda *a: calls.append(1) or real(*a))
    layer = quantized_layer()
    layer.fuse_for_decode()
    for num_seqs, used in ((12, True), (13, False)):  # the 4-bit copies serve up to 12 rows
        x, residual, cos, sin, (k, v), meta = decode_step(num_seqs)
        calls.clear()
        layer(x, residual, cos, sin, k, v, meta)
        assert bool(calls) == used
    bias = quantized_layer()
    bias.qkv_proj.bias = torch.nn.Parameter(torch.zeros(bias.qkv_proj.weight.shape[0]))
    assert not bias.fuse_for_decode() and bias.fused is None  # Qwen2-style QKV bias
    dense = quantized_layer()
    dense.o_proj.quantized = None
    assert not dense.fuse_for_decode()
