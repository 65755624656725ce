"""GGUF Q5_0 / Q5_1 / K-quant weights kept as the file's bytes (``layers/gguf_blocks.py``) and
their kernel (``kernels/quant_panels.cpp``): gguf's dequantization bit for bit, the panel GEMM's
bits at every row count (so a row's bits do not depend on its batch), stacks of mixed types,
embedding lookups, and refused arguments."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from conveyor.model.kernels.build import kernel_ops
from conveyor.model.kernels.panel_gemm import pack_panels, panel_gemm, panel_gemm_available
from conveyor.model.layers.block_method import BlockMethod
from conveyor.model.layers.gguf_blocks import (
    LAYOUTS,
    NAMES,
    Q4_K,
    Q5_0,
    Q6_K,
    GGUFBlocks,
    QuantPanels,
    quant_panel_gemm,
    stack_blocks,
)
from conveyor.model.layers.linear import PanelMethod
from gguf_blocks import file_blocks, raw_blocks
from torch_threads import torch_threads

KINDS = [pytest.param(kind, id=name) for kind, name in NAMES.items()]
needs_kernels = pytest.mark.skipif(kernel_ops() is None, reason="the C++ kernels cannot be built here")


def _dtypes() -> list[torch.dtype]:
    return [d for d in (torch.float32, torch.bfloat16) if panel_gemm_available(d)]


def _k(kind: int) -> int:
    return 2 * LAYOUTS[kind].block


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_gguf_bit_for_bit(kind) -> None:
    blocks = raw_blocks(kind, 7, _k(kind), torch.Generator().manual_seed(kind))
    expected = dequantize(blocks.parts[0].data.numpy(), gguf.GGMLQuantizationType(kind))
    got = blocks.dequantize().numpy()
    assert np.array_equal(got.view(np.uint32), np.asarray(expected, np.float32).view(np.uint32))


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", _dtypes())
def test_kernel_is_the_panel_gemm_over_the_dequantized_weight(kind, dtype) -> None:
    """Every row count up to past the most it serves, an output count that ends mid-panel."""
    n, k = 45, _k(kind)
    blocks = raw_blocks(kind, n, k, torch.Generator().manual_seed(kind))
    weight = blocks.dequantize()
    packed = QuantPanels.pack(blocks, dtype)
    x = torch.randn(packed.max_tokens + 1, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    full = panel_gemm(x, pack_panels(weight.to(dtype)), n)
    expected = x.double() @ weight.double().T
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.double(), expected, rtol=tol, atol=tol * expected.abs().max())
    for rows in range(1, x.shape[0] + 1):
        assert torch.equal(packed.matmul(x[:rows]), full[:rows]), rows


@needs_kernels
@pytest.mark.parametrize("dtype", _dtypes())
def test_a_row_does_not_depend_on_its_batch_or_threads(dtype) -> None:
    blocks = raw_blocks(Q4_K, 70, 512, torch.Generator().manual_seed(0))
    packed = QuantPanels.pack(blocks, dtype)
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch_threads(2):
        full = packed.matmul(x)
    for start, rows in [(0, 1), (5, 1), (3, 2), (2, 5), (0, 6), (4, 7), (0, 12)]:
        for threads in (1, 2):
            with torch_threads(threads):
                assert torch.equal(packed.matmul(x[start:start + rows]), full[start:start + rows])
    strided = torch.randn(3, 1024, generator=torch.Generator().manual_seed(3)).to(dtype)[:, ::2]
    assert torch.equal(packed.matmul(strided), packed.matmul(strided.contiguous()))


@needs_kernels
def test_stacked_parts_of_mixed_types() -> None:
    """q, k, v of three types (one of them 8-bit blocks): one weight, each part its own kernel."""
    g = torch.Generator().manual_seed(4)
    parts = [raw_blocks(Q4_K, 64, 256, g), raw_blocks(Q6_K, 32, 256, g),
             GGUFBlocks.of(file_blocks(8, 32, 256, g))]
    stacked = stack_blocks(parts)
    assert isinstance(stacked, GGUFBlocks) and [p.kind for p in stacked.parts] == [Q4_K, Q6_K, 8]
    weight = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(stacked.dequantize(), weight)
    assert stack_blocks([parts[0], None]) is None
    x = torch.randn(3, 256, generator=g)
    method = BlockMethod.pack(stacked, PanelMethod(weight), deterministic=True)
    assert torch.equal(method.apply(x, None), panel_gemm(x, pack_panels(weight), 128))
    # whole panels: not a byte added
    assert method.nbytes() - method.large.nbytes() == stacked.nbytes()


def test_embedding_rows_and_refused_inputs() -> None:
    blocks = raw_blocks(Q5_0, 10, 64, torch.Generator().manual_seed(5))
    ids = torch.tensor([3, 0, 3, 9])
    assert torch.equal(blocks.rows(ids, torch.bfloat16), blocks.dequantize()[ids].bfloat16())
    with pytest.raises(ValueError, match="Q5_0 rows must be uint8"):
        GGUFBlocks.from_file(Q5_0, torch.zeros(2, 23, dtype=torch.uint8))
    with pytest.raises(ValueError, match="no GGUF blocks of type 1"):
        GGUFBlocks.from_file(1, torch.zeros(2, 4, dtype=torch.uint8))
    if kernel_ops() is not None:
        with pytest.raises(ValueError, match="float32 or bf16 activations"):
            QuantPanels.pack(blocks, torch.float16)


@needs_kernels
def test_kernel_refuses_bad_arguments() -> None:
    part = QuantPanels.pack(raw_blocks(Q4_K, 40, 256, torch.Generator().manual_seed(6)),
                            torch.float32).parts[0]
    x = torch.randn(2, 256)
    cases = [
        ((x, 5, part.codes, part.header, 40), "format must be a GGUF type id"),
        ((x, Q4_K, part.codes, part.header, 0), "n must be positive"),
        ((torch.randn(2, 128), Q4_K, part.codes, part.header, 40), "must be a multiple of 256"),
        ((torch.randn(2, 512), Q4_K, part.codes, part.header, 40), "codes must have shape"),
        ((x, Q4_K, part.codes, part.header, 80), "codes must have shape"),
        ((x, Q6_K, part.codes, part.header, 40), "codes must have shape"),
        ((x, Q4_K, part.codes, part.header[..., :8].contiguous(), 40), "header must have shape"),
        ((x, Q4_K, part.codes.float(), part.header, 40), "codes must be uint8"),
        ((x.double(), Q4_K, part.codes, part.header, 40), "x must be float32 or bfloat16"),
        ((torch.randn(256), Q4_K, part.codes, part.header, 40), "x must be 2-D"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            quant_panel_gemm(*args)
