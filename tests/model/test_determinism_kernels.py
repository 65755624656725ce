"""Bit-equality of the kernels that deterministic inference relies on (docs/determinism.md): a row's
result is the same whatever the other rows of the call, their number, the thread count, and (for
attention) whether the token is a decode or sits anywhere in a prefill chunk."""

from __future__ import annotations

import itertools

import pytest
import torch

from conveyor.model.kernels.paged_attention import attention_kernel_available, kernel_attention
from conveyor.model.kernels.panel_gemm import pack_panels, panel_gemm, panel_gemm_available
from conveyor.model.layers.quantized import Int4Blocks, pack_blocks
from gguf_blocks import file_blocks
from torch_threads import torch_threads

CPU = torch.device("cpu")


def _gemm_dtypes():
    return [d for d in (torch.float32, torch.bfloat16) if panel_gemm_available(d)]


@pytest.mark.parametrize("dtype", _gemm_dtypes())
@pytest.mark.parametrize(("n", "k"), [(200, 576), (49, 64)])
def test_panel_gemm_row_is_independent_of_batch_and_threads(dtype, n, k) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(250, k, generator=gen).to(dtype)  # 250 rows: two blocks of 192 rows
    packed = pack_panels(torch.randn(n, k, generator=gen).to(dtype))
    with torch_threads(2):
        full = panel_gemm(x, packed, n)
    for start, rows in [(0, 1), (7, 1), (3, 2), (10, 4), (5, 5), (0, 6), (11, 7), (40, 13),
                        (100, 37), (190, 60)]:
        for t in (1, 2):
            with torch_threads(t):
                part = panel_gemm(x[start:start + rows], packed, n)
            assert torch.equal(part, full[start:start + rows]), (start, rows, t)


@pytest.mark.parametrize("dtype", _gemm_dtypes())
def test_deterministic_blocks_serve_no_rows_without_block_panels(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = Int4Blocks(torch.randint(0, 16, (64, 128), generator=gen, dtype=torch.uint8),
                        torch.rand(64, 4, generator=gen), torch.rand(64, 4, generator=gen))
    odd = Int4Blocks(blocks.codes[:40], blocks.scale[:40], blocks.min[:40])  # not whole panels
    assert pack_blocks(odd, dtype, deterministic=True).max_tokens == 0
    assert pack_blocks(odd, dtype).max_tokens > 0


def _attention_dtypes():
    pairs = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
             (torch.float32, torch.bfloat16)]
    return [pytest.param(q, c, id=f"{q}-{c}".replace("torch.", "")) for q, c in pairs
            if attention_kernel_available(CPU, q, c)]


@pytest.mark.parametrize(("dtype", "cache_dtype"), _attention_dtypes())
@pytest.mark.parametrize(("head_dim", "num_heads", "kv_heads", "block_size"), [
    (64, 9, 3, 16),  # SmolLM2-135M
    (64, 4, 4, 5),  # no grouping, blocks of odd size
    (32, 8, 1, 8),  # a group of 8
])
def test_attention_row_is_independent_of_chunking(dtype, cache_dtype, head_dim, num_heads,
                                                  kv_heads, block_size) -> None:
    """A sequence's tokens attended as one prefill chunk, as chunks split anywhere, and one by one
    as decodes give identical bits per token, with 1 or 2 threads; contexts cross the tiles'
    512-key chunks."""
    gen = torch.Generator().manual_seed(head_dim + block_size)
    length = 700
    num_blocks = (length + block_size - 1) // block_size + 8
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    table = torch.randperm(num_blocks, generator=gen)[:(length + block_size - 1) // block_size]
    table = table.to(torch.int32)[None].contiguous()
    q = torch.randn(length, num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5

    def chunk(lo: int, hi: int) -> torch.Tensor:
        """Tokens lo..hi-1 as one prefill chunk."""
        seqs = torch.zeros(hi - lo, dtype=torch.int32)
        lens = torch.arange(lo + 1, hi + 1, dtype=torch.int32)
        return kernel_attention(q[lo:hi], k_cache, v_cache, table, lens, scale, seqs)

    with torch_threads(2):
        whole = chunk(0, length)
    for t in (1, 2):
        with torch_threads(t):
            for bounds in ([0, 1, 2, 30, 31, 200, 511, 513, 700], [0, 97, 400, 650, 700]):
                parts = torch.cat([chunk(a, b) for a, b in itertools.pairwise(bounds)])
                assert torch.equal(parts, whole), (bounds, t)
            # decodes: each its own sequence row, several in one call, no token_seqs
            picks = [0, 5, 31, 32, 100, 511, 512, 513, 699]
            lens = torch.tensor([p + 1 for p in picks], dtype=torch.int32)
            tables = table.expand(len(picks), -1).contiguous()
            decodes = kernel_attention(q[picks], k_cache, v_cache, tables, lens, scale)
            assert torch.equal(decodes, whole[picks]), t


@pytest.mark.parametrize("dtype", _gemm_dtypes())
@pytest.mark.parametrize("bits", [4, 8])
def test_block_panels_equal_the_dense_panels(dtype, bits) -> None:
    """Small batches on the file's blocks give the dense panels' bits, row for row."""
    from conveyor.model.layers.quantized import BlockPanels

    if not BlockPanels.fits(file_blocks(bits, 32, 32, torch.Generator()), dtype):
        pytest.skip("no block panel kernel for this dtype here")
    gen = torch.Generator().manual_seed(bits)
    n, k = 96, 576
    blocks = file_blocks(bits, n, k, gen)
    packed = pack_blocks(blocks, dtype, deterministic=True)
    assert isinstance(packed, BlockPanels) and packed.max_tokens > 0
    panels = pack_panels(blocks.dequantize().to(dtype))
    x = torch.randn(40, k, generator=gen).to(dtype)
    with torch_threads(2):
        full = panel_gemm(x, panels, n)
    for rows in (1, 2, 3, 4, 5, 7, 12, 40):
        for t in (1, 2):
            with torch_threads(t):
                assert torch.equal(packed.matmul(x[:rows]), full[:rows]), (rows, t)
