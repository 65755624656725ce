"""The C++ panel GEMM, float32 and (where the CPU has AVX512-BF16) bf16: equal to a float64
reference at every tile and block edge, its packing reversible, bad input refused, and the
Linear layer that uses it."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from conveyor.model.backends.sdpa import TorchBackend
from conveyor.model.device import KernelPlan
from conveyor.model.kernels.panel_gemm import (
    pack_panels,
    panel_gemm,
    panel_gemm_available,
    panel_width,
    unpack_panels,
)
from conveyor.model.layers.formats import linear_format
from conveyor.model.layers.linear import Linear, PanelMethod

pytestmark = pytest.mark.skipif(not panel_gemm_available(), reason="no C++ compiler")
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not panel_gemm_available(torch.bfloat16), reason="the compiler does not target AVX512-BF16"))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 64, 193, 400])  # tiles of 6 rows, blocks of 192
@pytest.mark.parametrize(("n", "k"), [(96, 64), (50, 33), (50, 34), (3 * 32 + 1, 576)])
def test_equals_float64_reference(m, n, k, dtype) -> None:
    if dtype == torch.bfloat16 and k % 2:
        pytest.skip("bf16 panels pair k: an odd k is refused (test_bf16_packing_pairs_k...)")
    gen = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    got = panel_gemm(x, pack_panels(w), n)
    assert got.shape == (m, n) and got.dtype == dtype
    expected = x.double() @ w.double().T
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4 * k ** 0.5)
    else:  # accumulated in float32, rounded once to bf16: within one bf16 step of the exact sum
        torch.testing.assert_close(got.double(), expected, rtol=2 ** -8, atol=1e-5 * k ** 0.5)


@pytest.mark.skipif(not panel_gemm_available(torch.bfloat16),
                    reason="the compiler does not target AVX512-BF16")
def test_bf16_packing_pairs_k_and_refuses_odd_k() -> None:
    w = torch.randn(70, 40).bfloat16()
    packed = pack_panels(w)
    width = panel_width()
    assert packed.shape == (-(-70 // width), 20, 2 * width) and packed.dtype == torch.bfloat16
    assert torch.equal(packed[1, 3, 2 * 2 + 1], w[width + 2, 7])  # k = 2 * 3 + 1, column 2
    assert torch.equal(unpack_panels(packed, 70), w)
    with pytest.raises(ValueError, match="even input size"):
        pack_panels(torch.randn(32, 33).bfloat16())
    with pytest.raises(ValueError, match="float32 or bf16"):
        pack_panels(torch.randn(32, 32).half())


def test_packing_is_a_reversible_reshape() -> None:
    w = torch.randn(70, 40)
    packed = pack_panels(w)
    width = panel_width()
    assert width in (16, 32) and packed.shape == (-(-70 // width), 40, width)
    assert torch.equal(packed[1, 3, 2], w[width + 2, 3])
    assert torch.equal(unpack_panels(packed, 70), w)
    assert torch.count_nonzero(packed.transpose(1, 2).reshape(-1, 40)[70:]) == 0  # zero padding


def test_strided_input_is_accepted_and_bad_input_refused() -> None:
    w = torch.randn(32, 48)
    packed = pack_panels(w)
    x = torch.randn(48, 10).T  # [10, 48], not contiguous
    torch.testing.assert_close(panel_gemm(x, packed, 32), x @ w.T, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="x must have 48 columns"):
        panel_gemm(torch.randn(3, 47), packed, 32)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16, got float64"):
        panel_gemm(x.double(), packed, 32)
    with pytest.raises(RuntimeError, match="packed must have shape"):
        panel_gemm(x, packed, 10_000)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_linear_with_panels_equals_dense_linear_with_bias(dtype) -> None:
    layer = Linear(40, 70, bias=True)
    layer.load("weight", None, torch.randn(70, 40))
    layer.to(dtype)
    layer.bias.data.normal_()
    x = torch.randn(9, 40).to(dtype)
    expected = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    dense = layer.weight.data.clone()
    plan = KernelPlan(linear=PanelMethod, block_weights=False, int8_blocks=False,
                      backend=TorchBackend(torch.device("cpu")))
    layer.process_weights_after_loading(partial(linear_format, plan, dtype))
    assert isinstance(layer.method, PanelMethod) and layer.weight is None
    assert torch.equal(layer.dense_weight(), dense)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7  # bf16: the product and the bias add round
    torch.testing.assert_close(layer(x).double(), expected, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="method has 70 outputs for a 4-output layer"):
        Linear(40, 4).set_method(layer.method)
