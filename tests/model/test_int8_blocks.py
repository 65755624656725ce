"""Integer compute (``kernels/int8_blocks.cpp``, ``Int8BlockMethod``): every GGUF type's blocks
times activations rounded to 8 bits per row and block of 32, against a reference in exact
arithmetic over the dequantized weights; a row's bits whatever its batch, its row count and the
threads; stacks of mixed types; bf16 rows; the Linear's format; refused arguments."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from conveyor.model.backends.sdpa import TorchBackend
from conveyor.model.device import KernelPlan, select_kernels
from conveyor.model.kernels.build import kernel_ops
from conveyor.model.kernels.int8_blocks import int8_block_gemm, int8_panel_lanes
from conveyor.model.layers.block_method import Int8BlockMethod
from conveyor.model.layers.formats import linear_format
from conveyor.model.layers.gguf_blocks import (
    LAYOUTS,
    NAMES,
    OFFSETS,
    Q4_0,
    Q4_K,
    Q6_K,
    Q8_0,
    GGUFBlocks,
    GGUFPart,
    _decode,
)
from conveyor.model.layers.linear import Linear, PanelMethod
from gguf_blocks import file_blocks, load_blocks, raw_blocks
from torch_threads import torch_threads

KINDS = [pytest.param(kind, id=name) for kind, name in NAMES.items()]
pytestmark = pytest.mark.skipif(kernel_ops() is None, reason="the C++ kernels cannot be built here")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] rounded as the kernel rounds it: codes [M, K] int64 and scales [M, K / 32]
    float32 (d = max|x| / 127, q = x * (1 / d) to nearest, ties to even)."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return torch.round(xb * inv[..., None]).long().view(m, k), d


def reference(x: torch.Tensor, blocks: GGUFBlocks) -> torch.Tensor:
    """x @ W^T in float64 from the 8-bit rows (exact) and the file's weights w = (u - offset) s
    or u s + m (exact), so the exact value the kernel's float32 rounds."""
    q, d = quantize_rows(x)
    a = (q.double().view(*d.shape, 32) * d.double()[..., None]).view(q.shape)
    ws = []
    for part in blocks.parts:
        u, s, mins = _decode(part.kind, part.blocks())
        rows, nb, subs = s.shape
        codes = u.long().view(rows, nb, subs, -1) - OFFSETS.get(part.kind, 0)
        w = codes.double() * s.double()[..., None]
        if mins is not None:
            w = w + mins.double()[..., None]
        ws.append(w.view(rows, -1))
    return a @ torch.cat(ws).T


def run(x: torch.Tensor, blocks: GGUFBlocks) -> torch.Tensor:
    lanes = int8_panel_lanes()
    return int8_block_gemm(x, [p.kind for p in blocks.parts],
                           [p.lane_panels(lanes) for p in blocks.parts],
                           [p.data.shape[0] for p in blocks.parts])


def bound(x: torch.Tensor, blocks: GGUFBlocks) -> torch.Tensor:
    """How far float32's per-block rounding may take the kernel from ``reference``."""
    q, d = quantize_rows(x)
    a = (q.double().abs().view(*d.shape, 32) * d.double()[..., None]).view(q.shape)
    w = blocks.dequantize().double().abs()
    return 1e-5 * (a @ w.T) + 1e-30


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 9, 70])
def test_kernel_equals_the_exact_integer_reference(kind, rows) -> None:
    g = torch.Generator().manual_seed(kind * 100 + rows)
    k = 2 * LAYOUTS[kind].block
    blocks = raw_blocks(kind, 11, k, g)  # odd outputs: a partial tile of 8
    x = torch.randn(rows, k, generator=g)
    x[0, :32] = 0  # an all-zero block: scale 0
    got, expected = run(x, blocks), reference(x, blocks)
    assert got.dtype == torch.float32 and got.shape == (rows, 11)
    assert ((got.double() - expected).abs() <= bound(x, blocks)).all()


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_does_not_depend_on_its_batch_or_threads(kind) -> None:
    g = torch.Generator().manual_seed(kind)
    k = 2 * LAYOUTS[kind].block
    blocks = raw_blocks(kind, 37, k, g)
    x = torch.randn(67, k, generator=g)
    with torch_threads(2):
        full = run(x, blocks)
    with torch_threads(1):
        assert torch.equal(run(x, blocks), full)
        for start, stop in ((0, 1), (5, 6), (3, 10), (60, 67), (1, 66)):
            assert torch.equal(run(x[start:stop], blocks), full[start:stop])


def test_stacked_parts_of_mixed_types_and_bf16_rows() -> None:
    g = torch.Generator().manual_seed(3)
    parts = [raw_blocks(kind, n, 512, g) for kind, n in ((Q4_K, 24), (Q6_K, 9), (Q8_0, 5))]
    stacked = GGUFBlocks.cat(parts)
    x = torch.randn(6, 512, generator=g)
    y = run(x, stacked)
    assert torch.equal(y, torch.cat([run(x, p) for p in parts], dim=1))
    xb = x.bfloat16()
    assert torch.equal(run(xb, stacked), run(xb.float(), stacked).bfloat16())
    strided = torch.randn(6, 1024, generator=g)[:, ::2]  # rows with a column stride: copied
    assert torch.equal(run(strided, stacked), run(strided.contiguous(), stacked))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_under_integer_compute(bits, dtype) -> None:
    g = torch.Generator().manual_seed(bits)
    blocks = file_blocks(bits, 40, 64, g)
    if bits == 4:  # a Q4_0 file's blocks: minimum -8 scale
        blocks.min = -8 * blocks.scale
    linear = Linear(64, 40, bias=True)
    load_blocks(linear, blocks)
    linear.bias.data = torch.randn(40, generator=g)
    linear.to(dtype)
    kernels = KernelPlan(linear=PanelMethod, block_weights=True, int8_blocks=True,
                         backend=TorchBackend(torch.device("cpu")))
    linear.process_weights_after_loading(partial(linear_format, kernels, dtype))
    method = linear.method
    assert isinstance(method, Int8BlockMethod) and linear.weight is None
    assert method.formats == [Q4_0 if bits == 4 else Q8_0]
    assert torch.equal(linear.dense_weight(), blocks.dequantize().to(dtype))
    assert linear.weight_bytes(1) == method.nbytes() == sum(p.numel() for p in method.data)
    x = torch.randn(5, 64, generator=g).to(dtype)
    expected = run(x, GGUFBlocks.of(blocks)) + linear.bias
    assert torch.equal(linear(x), expected)
    assert linear.method.decode_projection().integer


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lanes", [8, 16])
def test_lane_panels_permute_the_file_bytes(kind, lanes) -> None:
    """The kernel's layout holds the file's bytes, no more (but the last panel's padding), and
    gives them back; each panel block's first 16-bit unit is its outputs' first scale bytes."""
    g = torch.Generator().manual_seed(kind + lanes)
    part = raw_blocks(kind, 21, 2 * LAYOUTS[kind].block, g).parts[0]
    packed = part.lane_panels(lanes)
    rows = -(-21 // lanes) * lanes
    assert packed.shape == (rows, part.data.shape[1]) and packed.dtype == torch.uint8
    back = GGUFPart.from_lane_panels(kind, packed, 21, lanes)
    assert torch.equal(back.data, part.data)
    start = LAYOUTS[kind].header[0]
    first = packed.view(-1)[:2 * lanes].view(lanes, 2)
    assert torch.equal(first, part.data[:lanes, start:start + 2])


def test_refused_arguments() -> None:
    g = torch.Generator().manual_seed(0)
    blocks = raw_blocks(Q4_K, 8, 256, g)
    data = blocks.parts[0].lane_panels(int8_panel_lanes())
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="format must be a GGUF type id"):
        int8_block_gemm(x, [1], [data], [8])
    with pytest.raises(RuntimeError, match="one entry per part"):
        int8_block_gemm(x, [Q4_K, Q4_K], [data], [8])
    with pytest.raises(RuntimeError, match="data must have shape"):
        int8_block_gemm(x, [Q4_K], [data], [8 + int8_panel_lanes()])
    with pytest.raises(RuntimeError, match="input size .* must be a multiple of 256"):
        int8_block_gemm(torch.randn(2, 288), [Q4_K], [data], [8])
    with pytest.raises(RuntimeError, match="must be a multiple of 32"):
        int8_block_gemm(torch.randn(2, 100), [Q4_K], [data], [8])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        int8_block_gemm(x.half(), [Q4_K], [data], [8])
    with pytest.raises(RuntimeError, match="must be uint8"):
        int8_block_gemm(x, [Q4_K], [data.view(torch.int8)], [8])
    with pytest.raises(ValueError, match="float32 or bf16 activations"):
        Int8BlockMethod(blocks, torch.float16)
    with pytest.raises(ValueError, match="weight_compute must be one of"):
        select_kernels(torch.device("cpu"), torch.float32, 64, weight_compute="int4")
