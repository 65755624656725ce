"""The Triton LoRA kernels (shrink, then expand over tiles of output columns) against per-row
float64 math: each row under its own adapter slot, rows of slot 0 untouched."""

import pytest
import torch

from conveyor.model.kernels.triton.lora import BLOCK_N, lora_apply_

# bf16: one rounding, and the interpreter truncates where a GPU rounds to nearest
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lora_apply_matches_per_row_math(dtype, device):
    g = torch.Generator().manual_seed(0)
    n_in, n_out, rank = 200, BLOCK_N + 40, 24  # a partial input step, a partial column tile
    a = torch.randn(3, rank, n_in, generator=g) * 0.1
    b = torch.randn(3, rank, n_out, generator=g) * 0.1
    a[0], b[0] = 0, 0
    x = torch.randn(5, 2 * n_in, generator=g).to(dtype)[:, :n_in]  # strided rows
    y = torch.randn(5, n_out, generator=g).to(dtype)
    slots = torch.tensor([1, 0, 2, 2, 1], dtype=torch.int32)
    width = 20
    want = y.clone()
    for t, s in enumerate(slots.tolist()):
        if s:
            u = a[s, :width].double() @ x[t].double()
            want[t] = (y[t].double() + u @ b[s, :width].double()).to(dtype)
    got, args = y.to(device), [t.to(device) for t in (x, a, b, slots)]
    assert lora_apply_(got, *args, width) is got
    torch.testing.assert_close(got.cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(got[1].cpu(), y[1])
    with pytest.raises(ValueError, match="width must be in 0..24"):
        lora_apply_(got, *args, 25)
