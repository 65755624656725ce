"""4-bit weights: both layouts against the dequantized weights, and the shipped model's blocks
against the loader's dequantized tensors (the 4-bit path is lossless)."""

import pytest
import torch

from conveyor.model.kernels.q4_matmul import q4_matmul_available
from conveyor.model.layers.int4 import GROUP, Int4Blocks, NibbleInt4, PackedInt4, pack_int4


def random_blocks(n: int, k: int, seed: int = 0) -> Int4Blocks:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // GROUP, generator=g) * 0.02 + 0.001
    minimum = -8 * scale + torch.randn(n, k // GROUP, generator=g) * 0.01
    return Int4Blocks(codes, scale, minimum)


@pytest.mark.skipif(not q4_matmul_available(), reason="the 4-bit kernel cannot be built here")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (40, 64)])
def test_nibble_int4_matches_dequantized_weights(rows, n, k):
    blocks = random_blocks(n, k, seed=rows)
    x = torch.randn(rows, k)
    expected = (x.double() @ blocks.dequantize().double().T).float()
    got = pack_int4(blocks, torch.float32).matmul(x)
    assert isinstance(pack_int4(blocks, torch.float32), NibbleInt4)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not q4_matmul_available(), reason="the 4-bit kernel cannot be built here")
def test_nibble_int4_takes_strided_rows_and_rejects_bad_input():
    blocks = random_blocks(64, 128)
    w = pack_int4(blocks, torch.float32)
    wide = torch.randn(3, 256)
    x = wide[:, :128]  # row stride 256
    torch.testing.assert_close(w.matmul(x), w.matmul(x.contiguous()))
    with pytest.raises(ValueError, match="float32"):
        w.matmul(torch.randn(2, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[M, 128\]"):
        w.matmul(torch.randn(2, 96))


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                    reason="torch has no CPU int4 kernel")
def test_packed_int4_matches_dequantized_weights():
    blocks = random_blocks(192, 576)
    x = torch.randn(3, 576).to(torch.bfloat16)
    w = pack_int4(blocks, torch.bfloat16)
    assert isinstance(w, PackedInt4)
    expected = x.double() @ blocks.dequantize().double().T
    torch.testing.assert_close(w.matmul(x).double(), expected, rtol=2e-2, atol=2e-2)


def test_pack_int4_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="divisible by 32"):
        pack_int4(Int4Blocks(torch.zeros(8, 48, dtype=torch.uint8), torch.ones(8, 1),
                             torch.zeros(8, 1)), torch.float32)
    with pytest.raises(ValueError, match="float16"):
        pack_int4(random_blocks(8, 64), torch.float16)


def test_shipped_model_blocks_are_its_weights():
    gguf = pytest.importorskip("gguf")
    from conveyor.model.gguf_loader import read_gguf_config, read_gguf_int4, read_gguf_weights
    from conveyor.model.loader import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    config = read_gguf_config(reader, "model.gguf")
    blocks = read_gguf_int4(reader, config)
    weights = read_gguf_weights(reader, config)
    assert len(blocks) >= 4 * config.num_layers  # q, k, v, o, gate, up, down are 4-bit
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight"):
        torch.testing.assert_close(blocks[name].dequantize(), weights[name], rtol=1e-6, atol=1e-6)
