"""A tiny random Llama and Qwen3 written to GGUF with Q4_K_M's types (Q4_K projections, Q6_K
V / down projections, Q6_K token embedding and output, F32 norms) load with their K-quant
blocks kept (``layers/gguf_blocks.py``) and generate the greedy tokens of the same model
computed in float from the dequantized weights."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

import conveyor.model.device as device
from conveyor.model.kernels.build import kernel_ops
from conveyor.model.layers.block_method import BlockMethod, Int8BlockMethod
from conveyor.model.layers.gguf_blocks import LAYOUTS, Q4_K, Q6_K, GGUFBlocks, QuantPanels
from conveyor.model.loader import load_model
from gguf_blocks import raw_blocks

pytestmark = pytest.mark.skipif(kernel_ops() is None, reason="the C++ kernels cannot be built here")

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 256, 512, 4, 2, 64, 96, 2
BLOCK = 16


def write_model(path: str, arch: str) -> None:
    """Random bytes of each type (``raw_blocks``): a random model that dequantizes exactly."""
    g = torch.Generator().manual_seed(0)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)

    def quantized(name: str, kind: int, n: int, k: int) -> None:
        data = raw_blocks(kind, n, k, g).parts[0].data.numpy()
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType(kind))

    def norm(name: str, size: int) -> None:
        w.add_tensor(name, (1 + 0.1 * torch.randn(size, generator=g)).numpy())

    quantized("token_embd.weight", Q6_K, VOCAB, HIDDEN)
    quantized("output.weight", Q6_K, VOCAB, HIDDEN)
    norm("output_norm.weight", HIDDEN)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight", HIDDEN)
        norm(f"blk.{i}.ffn_norm.weight", HIDDEN)
        if arch == "qwen3":
            norm(f"blk.{i}.attn_q_norm.weight", HEAD_DIM)
            norm(f"blk.{i}.attn_k_norm.weight", HEAD_DIM)
        quantized(f"blk.{i}.attn_q.weight", Q4_K, HEADS * HEAD_DIM, HIDDEN)
        quantized(f"blk.{i}.attn_k.weight", Q4_K, KV_HEADS * HEAD_DIM, HIDDEN)
        quantized(f"blk.{i}.attn_v.weight", Q6_K, KV_HEADS * HEAD_DIM, HIDDEN)
        quantized(f"blk.{i}.attn_output.weight", Q4_K, HIDDEN, HEADS * HEAD_DIM)
        quantized(f"blk.{i}.ffn_gate.weight", Q4_K, INTER, HIDDEN)
        quantized(f"blk.{i}.ffn_up.weight", Q4_K, INTER, HIDDEN)
        quantized(f"blk.{i}.ffn_down.weight", Q6_K if i % 2 else Q4_K, HIDDEN, INTER)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill, then ``steps`` one-token decodes; the tokens and the last logits."""
    cfg = model.config
    shape = (8, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    dtype = model.embed_tokens.dtype if model.embed_tokens.weight is None else model.embed_tokens.weight.dtype
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
              for _ in range(cfg.num_layers)]
    tokens, start, ids = list(prompt), 0, list(prompt)
    for _ in range(steps):
        meta = model.backend.build_metadata([list(range(8))], [start], [len(ids)], BLOCK,
                                            cfg.num_queries_per_kv, dtype)
        logits = model(torch.tensor(ids), meta.positions, caches, meta,
                       torch.tensor([len(ids) - 1]))
        start += len(ids)
        ids = [int(logits[0].argmax())]
        tokens.append(ids[0])
    return tokens[len(prompt):], logits


def load(path: str, dtype: torch.dtype, deterministic: bool, blocks: bool, monkeypatch,
         weight_compute: str = "float"):
    if not blocks:
        real = device.select_kernels
        monkeypatch.setattr(device, "select_kernels", lambda *a, **k: dataclasses.replace(
            real(*a, **k), block_weights=False))
    model = load_model(path, dtype, torch.device("cpu"), weight_compute,
                       deterministic=deterministic, with_tokenizer=False).model
    monkeypatch.undo()
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
def test_q4_k_m_model_generates_the_float_models_tokens(tmp_path, monkeypatch, arch,
                                                        deterministic) -> None:
    path = str(tmp_path / f"tiny-{arch}-q4_k_m.gguf")
    write_model(path, arch)
    quant = load(path, torch.float32, deterministic, True, monkeypatch)
    dense = load(path, torch.float32, deterministic, False, monkeypatch)

    methods = [p.method for layer in quant.layers for p in layer.projections]
    assert all(isinstance(m, BlockMethod) and isinstance(m.small, QuantPanels) for m in methods)
    qkv = quant.layers[0].qkv_proj.method.small
    assert [p.kind for p in qkv.parts] == [Q4_K, Q6_K]  # q and k as one Q4_K part, then v
    assert isinstance(quant.lm_head.method.small, QuantPanels)
    assert isinstance(quant.embed_tokens.table, GGUFBlocks)  # lookups from the file's bytes
    # A decode step reads the file's bytes: the blocks' size, about the file's.
    layer_bytes = sum(m.bytes_read(1) for m in methods)
    file_bytes = sum(n * k // LAYOUTS[kind].block * LAYOUTS[kind].block_bytes for n, k, kind in [
        (HEADS * HEAD_DIM, HIDDEN, Q4_K), (KV_HEADS * HEAD_DIM, HIDDEN, Q4_K),
        (KV_HEADS * HEAD_DIM, HIDDEN, Q6_K), (HIDDEN, HEADS * HEAD_DIM, Q4_K),
        (2 * INTER, HIDDEN, Q4_K)]) * LAYERS + HIDDEN * INTER // 256 * (144 + 210)
    assert layer_bytes == file_bytes
    assert quant.fused_decode is not None or arch == "qwen3"  # Qwen3's q/k norms run in Python

    prompt = [5, 17, 3, 42, 8]
    got, got_logits = greedy(quant, prompt, 6)
    expected, expected_logits = greedy(dense, prompt, 6)
    assert got == expected
    # the default, integer compute, runs the same blocks on the integer kernels
    integer = load(path, torch.float32, deterministic, True, monkeypatch, "auto")
    assert all(isinstance(p.method, Int8BlockMethod)
               for layer in integer.layers for p in layer.projections)
    assert len(greedy(integer, prompt, 6)[0]) == 6
    if deterministic:
        assert torch.equal(got_logits, expected_logits)
    else:
        torch.testing.assert_close(got_logits, expected_logits, rtol=1e-4, atol=1e-4)
    weight = dense.layers[1].down_proj.dense_weight()
    assert torch.equal(quant.layers[1].down_proj.dense_weight(), weight)
    assert np.isfinite(got_logits.numpy()).all()
