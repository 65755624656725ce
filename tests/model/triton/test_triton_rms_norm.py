"""The Triton RMSNorm (with and without the fused residual add) against TorchBackend's torch
ops, which follow transformers: equal in float32, within two rounding steps in bf16 and fp16."""

import pytest
import torch

from conveyor.model.backends.sdpa import TorchBackend
from conveyor.model.kernels.triton.common import interpreting
from conveyor.model.kernels.triton.rms_norm import rms_norm
from conveyor.model.layers.norm import RMSNorm


def _torch_norm(norm, x, residual):
    """TorchBackend's norm."""
    return norm(x[None], None if residual is None else residual[None])[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(dtype, with_residual, device):
    torch.manual_seed(0)
    hidden = 96  # not a power of two: the row is masked
    norm = RMSNorm(hidden, 1e-5, TorchBackend(torch.device("cpu")))
    norm.weight.data = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    x = torch.randn(5, 2 * hidden).to(dtype)[:, :hidden]  # strided rows, as a view gives
    residual = torch.randn(5, hidden).to(dtype) if with_residual else None
    want_res = None if residual is None else residual.clone()
    want = _torch_norm(norm, x.clone(), want_res)
    got_res = None if residual is None else residual.clone().to(device)
    norm.weight.data = norm.weight.data.to(device)
    got = rms_norm(x.to(device), norm.weight, 1e-5, got_res)
    # two roundings (the norm, then the weight product): up to two ulps apart
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
    if residual is None:
        return
    if dtype == torch.bfloat16 and interpreting():
        # the interpreter truncates float32 to bf16 where a GPU rounds to nearest: one ulp
        torch.testing.assert_close(got_res.cpu(), want_res, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(got_res.cpu(), want_res)  # the sum, rounded alike
