"""The Triton rotary and SiLU-and-mul against layers/'s torch ops: equal up to the torch ops'
intermediate roundings in bf16/fp16, within float32 rounding in float32."""

import pytest
import torch
import torch.nn.functional as F

from conveyor.model.kernels.triton.elementwise import rotary, silu_mul
from conveyor.model.layers.rotary import RotaryEmbedding, rope_inv_freq

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _torch_rotary(x, cos, sin):
    half = x.shape[-1] // 2
    return x.float() * cos.float() + torch.cat((-x[..., half:], x[..., :half]), -1).float() * sin.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_over_strided_heads_in_place(dtype, head_dim, device):
    torch.manual_seed(0)
    rope = RotaryEmbedding(rope_inv_freq(head_dim, 10000.0, None)).to(device)
    positions = torch.tensor([0, 1, 7, 300, 31], device=device)
    cos, sin = rope.cos_sin(positions, dtype)
    # q and k heads as the fused QKV output holds them: a strided view, rotated in place
    qkv = torch.randn(5, 7 * head_dim).to(dtype).to(device)
    qk = qkv[:, :5 * head_dim].view(5, 5, head_dim)
    want = _torch_rotary(qk.cpu(), cos.cpu(), sin.cpu())
    untouched = qkv[:, 5 * head_dim:].clone()
    got = rotary(qk, cos, sin, out=qk)
    assert got.data_ptr() == qk.data_ptr()
    torch.testing.assert_close(qk.cpu().float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, 5 * head_dim:], untouched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul(dtype, device):
    torch.manual_seed(0)
    gate_up = torch.randn(3, 2 * 96).to(dtype).to(device)
    want = F.silu(gate_up[:, :96].float()) * gate_up[:, 96:].float()
    got = silu_mul(gate_up, block=64)  # two column blocks, the second masked
    torch.testing.assert_close(got.cpu().float(), want.cpu(), atol=TOL[dtype], rtol=TOL[dtype])
