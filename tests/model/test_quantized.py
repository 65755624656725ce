"""Quantized weights: each layout against the dequantized weights, with float32 and bf16
activations, and the shipped model's blocks against the loader's dequantized tensors (the block
paths are lossless)."""

import pytest
import torch

from conveyor.model.kernels.block_matmul import block_matmul_available
from conveyor.model.layers.gguf_blocks import Q8_0
from conveyor.model.layers.quantized import (
    BF16_MAX_TOKENS,
    GROUP,
    Int4Blocks,
    Int8Blocks,
    NibbleInt4,
    pack_blocks,
)

needs_kernel = pytest.mark.skipif(not block_matmul_available(),
                                  reason="the block matmul kernel cannot be built here")


def random_blocks(n: int, k: int, seed: int = 0) -> Int4Blocks:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // GROUP, generator=g) * 0.02 + 0.001
    minimum = -8 * scale + torch.randn(n, k // GROUP, generator=g) * 0.01
    return Int4Blocks(codes, scale, minimum)


@needs_kernel
def test_nibble_int4_takes_strided_rows_and_rejects_bad_input():
    blocks = random_blocks(64, 128)
    w = pack_blocks(blocks, torch.float32)
    wide = torch.randn(3, 256)
    x = wide[:, :128]  # row stride 256
    torch.testing.assert_close(w.matmul(x), w.matmul(x.contiguous()))
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16, got float16"):
        w.matmul(torch.randn(2, 128, dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"codes must have shape \[64, 48\]"):
        w.matmul(torch.randn(2, 96))


def random_int8_blocks(n: int, k: int, seed: int = 0) -> Int8Blocks:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    return Int8Blocks(codes, torch.rand(n, k // GROUP, generator=g) * 0.02 + 0.001)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (40, 64)])
@pytest.mark.parametrize("make,layout", [(random_blocks, NibbleInt4),
                                         (random_int8_blocks, Int8Blocks)])
def test_float32_blocks_match_dequantized_weights(rows, n, k, make, layout):
    blocks = make(n, k, seed=rows)
    x = torch.randn(rows, k)
    expected = (x.double() @ blocks.dequantize().double().T).float()
    w = pack_blocks(blocks, torch.float32)
    assert isinstance(w, layout) and w.max_tokens == layout.max_tokens
    torch.testing.assert_close(w.matmul(x), expected, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (40, 96)])
@pytest.mark.parametrize("make,layout", [(random_blocks, NibbleInt4),
                                         (random_int8_blocks, Int8Blocks)])
def test_bf16_blocks_match_dequantized_weights(rows, n, k, make, layout):
    """bf16 x (exact in float64) against the exact weights: only the float32 sums and y's one
    rounding to bf16 separate them, so within a bf16 step of y plus float32 noise."""
    blocks = make(n, k, seed=rows)
    x = torch.randn(rows, k).to(torch.bfloat16)
    expected = x.double() @ blocks.dequantize().double().T
    w = pack_blocks(blocks, torch.bfloat16)
    assert isinstance(w, layout) and w.max_tokens == BF16_MAX_TOKENS
    y = w.matmul(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    torch.testing.assert_close(y.double(), expected, rtol=2 ** -8, atol=1e-5 * k ** 0.5)


def test_int8_rows_are_an_embedding_lookup():
    blocks = random_int8_blocks(100, 64)
    ids = torch.tensor([5, 0, 99, 5])
    dense = blocks.codes.float().view(100, 2, 32).mul(blocks.scale[..., None]).view(100, 64)
    torch.testing.assert_close(blocks.rows(ids, torch.float32), dense[ids], rtol=0, atol=0)
    assert blocks.rows(ids, torch.bfloat16).dtype == torch.bfloat16


def test_pack_blocks_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="divisible by 32"):
        pack_blocks(Int4Blocks(torch.zeros(8, 48, dtype=torch.uint8), torch.ones(8, 1),
                               torch.zeros(8, 1)), torch.float32)
    with pytest.raises(ValueError, match="float16"):
        pack_blocks(random_blocks(8, 64), torch.float16)
    with pytest.raises(ValueError, match="float16"):
        pack_blocks(random_int8_blocks(8, 64), torch.float16)


def test_shipped_model_blocks_are_its_weights():
    gguf = pytest.importorskip("gguf")
    from conveyor.model.gguf_loader import read_gguf_config, read_gguf_tensors
    from conveyor.model.loader import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    config = read_gguf_config(reader, "model.gguf")
    tensors = {t.weight.name: t for t in read_gguf_tensors(reader, config, blocks=True)}
    dense = {t.weight.name: t for t in read_gguf_tensors(reader, config)}  # blocks not asked
    assert all(t.blocks is None and t.dense is not None for t in dense.values())
    with_blocks = [t for t in tensors.values() if t.blocks is not None]
    assert len(with_blocks) >= 4 * config.num_layers  # q, k, v, o, gate, up, down are 4-bit
    assert all(t.dense is None for t in with_blocks)  # kept as blocks: never dequantized
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight",
                 "model.embed_tokens.weight"):  # the embedding is Q8_0
        torch.testing.assert_close(tensors[name].blocks.dequantize(), dense[name].dense,
                                   rtol=0, atol=0)
    assert [p.kind for p in tensors["model.embed_tokens.weight"].blocks.parts] == [Q8_0]


@needs_kernel
def test_block_method_serves_up_to_max_tokens():
    from conveyor.model.layers.block_method import BlockMethod
    from conveyor.model.layers.linear import DenseMethod, Linear

    blocks = random_int8_blocks(40, 64)
    linear = Linear(64, 40)
    dense = torch.nn.Parameter(blocks.dequantize() + 1.0)  # a different weight shows which ran
    linear.set_method(BlockMethod(blocks, DenseMethod(dense)))
    small, large = torch.randn(blocks.max_tokens, 64), torch.randn(blocks.max_tokens + 1, 64)
    torch.testing.assert_close(linear(small), blocks.matmul(small))
    torch.testing.assert_close(linear(large), large @ dense.T)
    assert linear.weight_bytes(blocks.max_tokens) == blocks.nbytes()
    assert linear.weight_bytes(blocks.max_tokens + 1) == 40 * 64 * 4
    assert linear.method.nbytes() == blocks.nbytes() + 40 * 64 * 4
