"""The LoRA update kernel (``torch.ops.conveyor.lora_apply``, ``kernels/lora_ops.py``) against
per-row float64 math: each row under its own adapter slot, rows of slot 0 untouched, a row's bits
the same whatever else is in the call, and bad arguments refused with a message. (The AVX2 and
baseline builds: test_kernel_targets.py; the Triton kernel: triton/test_triton_lora.py.)"""

from __future__ import annotations

import pytest
import torch

from conveyor.model.kernels.build import kernel_ops
from conveyor.model.kernels.lora_ops import lora_apply_, torch_lora_apply_

ops = kernel_ops()
needs_ops = pytest.mark.skipif(ops is None, reason="no C++ compiler: the torch path runs")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def stacks(slots: int, rank: int, n_in: int, n_out: int, seed: int = 0):
    """a [slots, rank, n_in] and b [slots, rank, n_out], float32, slot 0 all zeros."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, rank, n_in, generator=g) * 0.1
    b = torch.randn(slots, rank, n_out, generator=g) * 0.1
    a[0], b[0] = 0, 0
    return a, b


def inputs(rows: int, n_in: int, n_out: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, n_in, generator=g).to(dtype),
            torch.randn(rows, n_out, generator=g).to(dtype))


def reference(y, x, a, b, slots, width) -> torch.Tensor:
    """Row by row in float64, rounded to y's dtype once."""
    out = y.clone()
    for t, s in enumerate(slots.tolist()):
        if s:
            u = a[s, :width].double() @ x[t].double()
            out[t] = (y[t].double() + u @ b[s, :width].double()).to(y.dtype)
    return out


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_cpp_matches_per_row_math(dtype, rows) -> None:
    a, b = stacks(4, 24, 96, 160)
    x, y = inputs(rows, 96, 160, dtype)
    slots = torch.randint(0, 4, (rows,), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(rows))
    slots[0] = 2  # at least one row under an adapter
    for width in (24, 13, 1):  # all of R, a rank block and a half, one row
        want = reference(y, x, a, b, slots, width)
        got = y.clone()
        ops.lora_apply(got, x, a, b, slots, width)
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
        assert torch.equal(got[slots == 0], y[slots == 0])
        torch.testing.assert_close(torch_lora_apply_(y.clone(), x, a, b, slots, width), want,
                                   atol=TOL[dtype], rtol=TOL[dtype])
    got = y.clone()
    ops.lora_apply(got, x, a, b, slots, 0)
    assert torch.equal(got, y)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_its_batch(dtype) -> None:
    # Real shapes (SmolLM2's q/k/v): a batch of 64 rows is enough work for every thread.
    a, b = stacks(9, 48, 576, 960)
    x, y = inputs(64, 576, 960, dtype)
    slots = torch.arange(64, dtype=torch.int32) % 9
    batch = y.clone()
    ops.lora_apply(batch, x, a, b, slots, 48)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single_thread = y.clone()
        ops.lora_apply(single_thread, x, a, b, slots, 48)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single_thread, batch)
    for t in (0, 5, 40, 63):  # alone, and among rows of its own slot only
        alone = y[t:t + 1].clone()
        ops.lora_apply(alone, x[t:t + 1], a, b, slots[t:t + 1], 48)
        assert torch.equal(alone[0], batch[t])
    same = torch.full((7,), 3, dtype=torch.int32)
    rows = y[[3] * 7].clone()
    ops.lora_apply(rows, x[[3] * 7], a, b, same, 48)
    assert all(torch.equal(row, batch[3]) for row in rows)


@needs_ops
def test_dispatch_takes_the_kernel_on_the_cpu_and_torch_elsewhere() -> None:
    a, b = stacks(3, 8, 32, 48)
    x, y = inputs(5, 32, 48, torch.bfloat16)
    slots = torch.tensor([1, 0, 2, 2, 1], dtype=torch.int32)
    kernel = y.clone()
    ops.lora_apply(kernel, x, a, b, slots, 8)
    assert torch.equal(lora_apply_(y.clone(), x, a, b, slots, 8), kernel)
    # widths the kernel does not take (not a multiple of 16): the torch path
    a, b = stacks(3, 8, 20, 12)
    x, y = inputs(5, 20, 12, torch.float32)
    torch.testing.assert_close(lora_apply_(y.clone(), x, a, b, slots, 8),
                               reference(y, x, a, b, slots, 8))


def strided(t: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


@needs_ops
def test_refuses_bad_arguments() -> None:
    a, b = stacks(3, 8, 32, 48)
    x, y = inputs(4, 32, 48, torch.float32)
    args = dict(y=y, x=x, a=a, b=b, slots=torch.tensor([0, 1, 2, 1], dtype=torch.int32),
                width=8)
    bad = {
        "y": [(y.double(), "y must be float32, bfloat16 or float16"),
              (strided(y), "y must be contiguous"),
              (y[:, :32].contiguous(), "b must have shape")],
        "x": [(x.bfloat16(), "x must be float32, got bfloat16"), (x[:3], "x must have 4 rows"),
              (x[:, :16], "a must have shape")],
        "a": [(a.bfloat16(), "a must be float32"), (a[:, :, :16], "a must have shape"),
              (a[0], "a must be 3-D")],
        "b": [(b[:2], "b must have shape"), (strided(b), "b must be contiguous")],
        "slots": [(args["slots"].long(), "slots must be int32"),
                  (torch.tensor([0, 1, 3, 1], dtype=torch.int32), r"slots\[2\] = 3 is not a slot"),
                  (torch.tensor([0, -1, 0, 0], dtype=torch.int32), r"slots\[1\] = -1")],
        "width": [(9, "width must be in 0..8"), (-1, "width must be in 0..8")],
    }
    for name, cases in bad.items():
        for value, message in cases:
            with pytest.raises(RuntimeError, match=message):
                ops.lora_apply(**{**args, name: value})
    with pytest.raises(RuntimeError, match="x's width must be a multiple of"):
        ops.lora_apply(y, x[:, :20].contiguous(), a[:, :, :20].contiguous(), b, args["slots"], 8)
