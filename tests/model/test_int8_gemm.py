"""The integer GEMM (kernels/int8_gemm.cpp) against the same arithmetic done in float64 by torch:
activations rounded to 8 bits per block of 32, then multiplied by the exact block weights. And
what that rounding costs against the unrounded product, and the Linear that uses it."""


import pytest
import torch

from conveyor.model.kernels.int8_gemm import int8_gemm_available
from conveyor.model.layers.quantized import GROUP, Int4Blocks, Int8Blocks, Int8Panels

needs_kernel = pytest.mark.skipif(not int8_gemm_available(),
                                  reason="the int8 GEMM needs a compiler targeting AVX512-VNNI")


def random_blocks(n: int, k: int, seed: int, bits: int) -> Int4Blocks | Int8Blocks:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, k // GROUP, generator=g) * 0.02 + 0.001
    if bits == 8:
        return Int8Blocks(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g), scale)
    minimum = -8 * scale + torch.randn(n, k // GROUP, generator=g) * 0.01
    return Int4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g), scale, minimum)


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per row and block of 32, s * round(x * (127 / max|x|)) with
    s = max|x| / 127, in float32 as the kernel computes it."""
    rows, k = x.shape
    blocks = x.float().view(rows, k // GROUP, GROUP)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127)).view(rows, k)


def test_rounding_is_at_most_half_a_step():
    x = torch.randn(7, 96) * torch.logspace(-3, 3, 96)  # blocks of very different sizes
    x[2, 32:64] = 0  # an all-zero block stays zero
    r = rounded_activations(x)
    step = x.view(7, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert ((r - x).view(7, 3, 32).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(r[2, 32:64], torch.zeros(32))


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_packing_keeps_the_blocks_weights(bits):
    blocks = random_blocks(70, 96, 0, bits)  # 70: a partial last panel
    panels = Int8Panels.pack(blocks)
    # 8-bit: (q + 128) d - 128 d rounds where q d did not, by an ulp or so
    tol = 0 if bits == 4 else 1e-6
    torch.testing.assert_close(panels.dequantize(), blocks.dequantize(), rtol=tol, atol=tol)
    assert panels.n_out == 70 and panels.codes.dtype == torch.uint8


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 5, 6, 11, 64, 200])
@pytest.mark.parametrize("n,k,bits", [(960, 576, 4), (576, 1536, 4), (40, 64, 4), (100, 64, 8),
                                      (1000, 576, 8)])
def test_equals_float64_product_of_rounded_activations(dtype, rows, n, k, bits):
    blocks = random_blocks(n, k, rows, bits)
    x = torch.randn(rows, k).to(dtype)
    got = Int8Panels.pack(blocks).matmul(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    expected = rounded_activations(x).double() @ blocks.dequantize().double().T
    # float32 accumulation (and, in bf16, y's rounding) on top of the same arithmetic
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * expected.abs().max())
    # What rounding the activations to 8 bits costs against the exact product: about 0.5%.
    exact = x.double() @ blocks.dequantize().double().T
    assert ((got.double() - exact).norm() / exact.norm()) < 0.012


@needs_kernel
def test_strided_input_is_accepted_and_bad_input_refused():
    panels = Int8Panels.pack(random_blocks(64, 128, 0, 4))
    wide = torch.randn(9, 256)
    x = wide[:, :128]  # row stride 256
    assert torch.equal(panels.matmul(x), panels.matmul(x.contiguous()))
    with pytest.raises(RuntimeError, match=r"codes must have shape \[2, 3, 8, 32, 4\]"):
        panels.matmul(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16, got float16"):
        panels.matmul(torch.randn(2, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="divisible by 32"):
        Int8Panels.pack(Int8Blocks(torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 1)))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [3, 64])
def test_exact_channels_are_kept_out_of_the_rounding(dtype, bits, rows):
    n, k = 70, 192  # a partial last panel
    blocks = random_blocks(n, k, 5, bits)
    exact = torch.tensor([5, 31, 32, 100, 101, 190], dtype=torch.int32)  # two in one pair of blocks
    panels = Int8Panels.pack(blocks, exact)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    x[:, exact] *= 40  # outliers: plain rounding loses their blocks
    x = x.to(dtype)
    got = panels.matmul(x)
    # The rest rounded with the exact channels zeroed; those in bf16 against bf16 columns.
    ex = exact.long()
    zeroed = x.float().clone()
    zeroed[:, ex] = 0
    weight = blocks.dequantize()
    columns = weight[:, ex].bfloat16().double()
    expected = (rounded_activations(zeroed).double() @ weight.double().T
                + x[:, ex].bfloat16().double() @ columns.T)
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * expected.abs().max())
    unrounded = x.double() @ weight.double().T
    plain = Int8Panels.pack(blocks).matmul(x).double()
    error = (got.double() - unrounded).norm() / unrounded.norm()
    assert error < 0.01 and error < (plain - unrounded).norm() / unrounded.norm() / 3
    assert torch.equal(panels.dequantize(), Int8Panels.pack(blocks).dequantize())
    assert panels.nbytes() == Int8Panels.pack(blocks).nbytes() + 6 * 4 + 3 * 96 * 2 * 2


@needs_kernel
def test_bad_exact_channels_are_refused():
    blocks = random_blocks(32, 64, 0, 4)
    for bad in ([1, 2, 3], [4, 4], [0, 64], [-1, 3]):
        with pytest.raises(ValueError, match="exact must be"):
            Int8Panels.pack(blocks, torch.tensor(bad, dtype=torch.int32))
    none = Int8Panels.pack(blocks, torch.zeros(0, dtype=torch.int32))  # none to keep: plain
    assert none.exact is None and none.nbytes() == Int8Panels.pack(blocks).nbytes()
