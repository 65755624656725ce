"""The fused CPU elementwise kernels give what the eager torch ops give (bf16: to the rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.model.kernels import fused_ops
from conveyor.model.kernels.build import kernel_ops

pytestmark = pytest.mark.skipif(kernel_ops() is None,
                                reason="no C++ compiler: the torch path runs")
# float32: a different summation order; bf16: the same plus an occasional one-ulp rounding flip
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 300])  # one row; enough rows for the threads
def test_rms_norm_with_and_without_residual(dtype, rows) -> None:
    wide = _randn(rows, 640, dtype=dtype)
    x = wide[:, :576]  # strided rows, as a view of a wider output
    weight = 1 + 0.1 * _randn(576, dtype=dtype, seed=1)
    residual = _randn(rows, 576, dtype=dtype, seed=2)

    def eager(h):
        hf = h.float()
        return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

    torch.testing.assert_close(fused_ops.rms_norm(x, weight, 1e-5), eager(x), **TOL[dtype])
    expected_residual = residual + x
    res = residual.clone()
    got = fused_ops.rms_norm(x, weight, 1e-5, res)
    torch.testing.assert_close(res, expected_residual, rtol=0, atol=0)  # the add rounds as eager
    torch.testing.assert_close(got, eager(expected_residual), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_into_its_own_input(dtype, with_residual) -> None:
    """``out=x`` (the decoder layer's x is dead after the add) gives what a fresh output gives."""
    x = _randn(300, 576, dtype=dtype)
    weight = 1 + 0.1 * _randn(576, dtype=dtype, seed=1)
    residual = _randn(300, 576, dtype=dtype, seed=2) if with_residual else None
    expected = fused_ops.rms_norm(x, weight, 1e-5, None if residual is None else residual.clone())
    got = fused_ops.rms_norm(x, weight, 1e-5, residual, out=x)
    assert got.data_ptr() == x.data_ptr()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # An unusable buffer (strided) is ignored, not written through.
    wide = _randn(300, 640, dtype=dtype, seed=3)
    strided, before = wide[:, :576], wide.clone()
    got = fused_ops.rms_norm(strided, weight, 1e-5, out=strided)
    assert got.data_ptr() != strided.data_ptr() and torch.equal(wide, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype) -> None:
    gate_up = 4 * _randn(70, 2 * 1536, dtype=dtype)  # large |gate| too: exp's clamped range
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused_ops.silu_mul(gate_up), F.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul(dtype) -> None:
    """Gemma's gate: torch's tanh GeLU to float32 rounding (computed as g / (1 + exp(-2u)), no
    tanh); very negative gates (u far below exp's clamp) give a tiny value, as torch's ~0."""
    gate_up = 4 * _randn(70, 2 * 1536, dtype=dtype)
    gate_up[0, :4] = torch.tensor([-30.0, -12.0, 30.0, 0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(fused_ops.gelu_tanh_mul(gate_up), expected, **TOL[dtype])
    assert fused_ops.gelu_tanh_mul(torch.randn(2, 2 * 24)) is None  # not a multiple of 16


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norms_are_rows_of_the_kernel(dtype) -> None:
    """``CpuBackend.rms_norm`` of [T, heads, head_dim] heads (q/k norms; strided views of the QKV
    rows) is the 2-D kernel over the heads as rows, bit for bit, and close to eager torch."""
    from conveyor.model.backends.cpu_kernels import CpuBackend

    qkv = _randn(5, (4 + 2 * 2) * 32, dtype=dtype)
    q = qkv[:, :128].view(5, 4, 32)
    weight = 1 + 0.1 * _randn(32, dtype=dtype, seed=1)
    backend = CpuBackend(torch.device("cpu"), attention_kernel=True)
    got = backend.rms_norm(q, weight, 1e-6)
    assert got.shape == q.shape
    assert torch.equal(got, fused_ops.rms_norm(q.reshape(20, 32), weight, 1e-6).view(5, 4, 32))
    for t in (0, 2):  # one row's heads: a view of its QKV row, not a copy
        assert torch.equal(backend.rms_norm(q[t:t + 1], weight, 1e-6), got[t:t + 1])
    qf = q.float()
    eager = weight * (qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(got, eager, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(dtype) -> None:
    from conveyor.model.layers.rotary import RotaryEmbedding, rope_inv_freq

    qkv = _randn(33, (9 + 2 * 3) * 64, dtype=dtype)
    q = qkv[:, :576].view(33, 9, 64)  # strided rows, heads packed
    cos, sin = RotaryEmbedding(rope_inv_freq(64, 10000.0, None)).cos_sin(torch.arange(33) * 7, dtype)
    rotated = torch.cat((-q[..., 32:], q[..., :32]), dim=-1)
    expected = q * cos + rotated * sin
    torch.testing.assert_close(fused_ops.rotary(q, cos, sin), expected, **TOL[dtype])
    # In place over q's and k's heads of the qkv rows (the decoder layer's call); v is untouched.
    before = qkv.clone()
    qk = qkv[:, :(9 + 3) * 64].view(33, 12, 64)
    got = fused_ops.rotary(qk, cos, sin, out=qk)
    assert got.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(got[:, :9], expected, **TOL[dtype])
    assert torch.equal(qkv[:, 12 * 64:], before[:, 12 * 64:])


def test_unsupported_calls_fall_back() -> None:
    assert fused_ops.silu_mul(torch.randn(2, 2 * 24)) is None  # width not a multiple of 16
    assert fused_ops.rms_norm(torch.randn(2, 64).half(), torch.ones(64).half(), 1e-5) is None
    assert fused_ops.rotary(torch.randn(2, 3, 64).transpose(0, 1), torch.randn(3, 1, 64),
                            torch.randn(3, 1, 64)) is None  # heads not packed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 16), (3, 48), (64, 49152)])
def test_argmax_is_the_first_maximum(dtype, rows, width) -> None:
    x = _randn(rows, width, dtype=dtype)
    x[0, width // 3] = x[0, width - 1] = x[0].max() + 1  # a tie: the first one wins
    if rows > 1:
        x[1, width - 1] = x[1, 1] = float("nan")  # a NaN wins, the first one, as in torch.max
    if rows > 2:
        x[2] = -float("inf")  # all equal
    got = fused_ops.argmax(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.max(dim=-1).indices)
    assert got[0] == width // 3
    assert fused_ops.argmax(_randn(2, 40, dtype=dtype)) is None  # width not a multiple of 16
