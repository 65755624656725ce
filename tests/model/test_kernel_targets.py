"""Every kernel, built for each target (baseline x86-64, AVX2, this CPU) with each installed
compiler (GCC; clang where present), against torch's math on small shapes: the branches an
AVX-512 machine never runs natively are compiled and run here too.

Each build is its own operator namespace (``build.namespace``), loaded beside the model's.
A first build takes a minute or more (torch's headers); later runs reuse the cache.
"""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from conveyor.model.kernels import build
from conveyor.model.kernels.paged_attention import keys_as_rows
from conveyor.model.kernels.panel_gemm import pack_panels
from conveyor.model.layers.gguf_blocks import LAYOUTS, NAMES, QuantPanels
from conveyor.model.layers.quantized import (
    GROUP,
    BlockPanels,
    Int4Blocks,
    NibbleInt4,
)
from gguf_blocks import file_blocks, raw_blocks

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the targets are x86-64 levels")]


def _openmp_missing(compiler: str) -> str | None:
    """Why ``compiler`` cannot build OpenMP code here, or None when it can."""
    path = shutil.which(compiler)
    if path is None:
        return f"{compiler} is not installed"
    probe = subprocess.run([path, "-fopenmp", "-x", "c++", "-fsyntax-only", "-"],
                           input="#include <omp.h>\nint f() { return omp_get_max_threads(); }\n",
                           capture_output=True, text=True, timeout=60)
    return None if probe.returncode == 0 else f"{compiler} has no OpenMP runtime (libomp-dev)"


def _compiler_param(name: str | None):
    if name is None:
        return pytest.param(None, id="cxx")
    missing = _openmp_missing(name)
    return pytest.param(name, id=name, marks=pytest.mark.skipif(missing is not None,
                                                                reason=missing or ""))


@pytest.fixture(scope="module", params=list(build.TARGETS))
def target(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=[_compiler_param(None), _compiler_param("clang++")])
def ops(request, target):
    compiler = request.param
    try:
        return build.load_ops(target, shutil.which(compiler) if compiler else None)
    except build.KernelBuildError as exc:
        if compiler is None and "no C++ compiler" in str(exc):
            pytest.skip("no C++ compiler")
        raise


def _dtypes(ops) -> list[torch.dtype]:
    return [torch.float32] + ([torch.bfloat16] if "avx512bf16" in ops.features() else [])


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    tol = (1e-4 if dtype == torch.float32 else 2e-2) * scale
    torch.testing.assert_close(got.double(), expected.double(), rtol=tol, atol=tol)


def test_features_match_the_target(ops, target) -> None:
    features = set(ops.features())
    if target == "x86-64":
        assert features == set() and ops.panel_width() == 16
    elif target == "x86-64-v3":
        assert features == {"avx2"} and ops.panel_width() == 16
    else:
        assert ops.panel_width() == (32 if "avx512f" in features else 16)


def test_panel_gemm(ops) -> None:
    for dtype in _dtypes(ops):
        w, x = _randn(50, 64).to(dtype), _randn(7, 64, seed=1).to(dtype)
        packed = pack_panels(w, ops.panel_width())
        _close(ops.panel_gemm(x, packed, 50), x.double() @ w.double().T, dtype, 8)


def _int4(n: int, k: int, seed: int = 0) -> Int4Blocks:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, k // GROUP, generator=g) * 0.02 + 0.001
    return Int4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g), scale,
                      -8 * scale)


def test_block_matmul(ops) -> None:
    blocks = _int4(40, 128)
    packed = NibbleInt4.pack(blocks)
    for dtype in (torch.float32, torch.bfloat16):  # bf16 is widened where there is no BF16
        x = _randn(3, 128).to(dtype)
        got = ops.block_matmul(x, packed.codes, packed.scale, packed.min)
        _close(got, x.double() @ blocks.dequantize().double().T, dtype, 4)


@pytest.mark.parametrize("bits", [4, 8])
def test_block_panel_gemm_equals_the_panels(ops, bits) -> None:
    """Every build with AVX2 multiplies BlockPanels to the dense panels' bits, at every row count
    (the deterministic mode's small batches); a build without AVX2 refuses them."""
    width = ops.panel_width()
    blocks = file_blocks(bits, 3 * width, 96, torch.Generator().manual_seed(bits))
    for dtype in _dtypes(ops):
        packed = BlockPanels.pack(blocks, dtype, width)
        x = _randn(13, 96, seed=1).to(dtype)
        if "avx2" not in ops.features():
            with pytest.raises(RuntimeError, match="BlockPanels need a build targeting AVX2"):
                ops.block_panel_gemm(x, packed.codes, packed.scale, packed.min)
            continue
        full = ops.panel_gemm(x, pack_panels(blocks.dequantize().to(dtype), width), 3 * width)
        for rows in (1, 2, 3, 5, 6, 7, 13):
            got = ops.block_panel_gemm(x[:rows], packed.codes, packed.scale, packed.min)
            assert torch.equal(got, full[:rows]), (dtype, rows)


def test_quant_panel_gemm_equals_the_panels(ops) -> None:
    """Every GGUF type QuantPanels holds, on every build: the dense panels' bits at every row
    count (bf16 rows widened to float32 where the build has no AVX512-BF16)."""
    width = ops.panel_width()
    for kind in NAMES:
        k = 512 if kind >= 12 else 64
        blocks = raw_blocks(kind, width + 5, k, torch.Generator().manual_seed(kind))
        weight = blocks.dequantize()
        for dtype in (torch.float32, torch.bfloat16):
            part = QuantPanels.pack(blocks, dtype, width=width).parts[0]
            x = _randn(13, k, seed=1).to(dtype)
            if dtype in _dtypes(ops):
                full = ops.panel_gemm(x, pack_panels(weight.to(dtype), width), width + 5)
            else:
                full = ops.panel_gemm(x.float(), pack_panels(weight, width), width + 5).to(dtype)
            for rows in (1, 2, 5, 6, 7, 13):
                got = ops.quant_panel_gemm(x[:rows], kind, part.codes, part.header, width + 5)
                assert torch.equal(got, full[:rows]), (NAMES[kind], dtype, rows)


def test_fused_ops(ops) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        x, residual, weight = _randn(5, 64).to(dtype), _randn(5, 64, seed=1).to(dtype), _randn(64, seed=2).to(dtype)
        out, res = torch.empty_like(x), residual.clone()
        ops.rms_norm(x, weight, 1e-5, res, out)
        total = residual.float() + x.float()
        _close(res, total.to(dtype), dtype, 2)
        normed = total.to(dtype).float()
        expected = (normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * weight
        _close(out, expected, dtype, 2)
        gate_up = _randn(4, 64).to(dtype)
        _close(ops.silu_mul(gate_up), F.silu(gate_up[:, :32].float()) * gate_up[:, 32:].float(),
               dtype, 2)
        _close(ops.gelu_tanh_mul(gate_up),
               F.gelu(gate_up[:, :32].float(), approximate="tanh") * gate_up[:, 32:].float(),
               dtype, 2)
        heads = _randn(3, 2, 32).to(dtype)
        angles = _randn(3, 1, 32, seed=3)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        rotated = torch.empty_like(heads)
        ops.rotary(heads, cos, sin, rotated)
        turned = torch.cat((-heads[..., 16:], heads[..., :16]), dim=-1)
        _close(rotated, heads.float() * cos.float() + turned.float() * sin.float(), dtype, 2)
        logits = _randn(3, 48).to(dtype)
        assert torch.equal(ops.argmax(logits), logits.max(dim=-1).indices)



def test_lora_apply(ops) -> None:
    """Every dtype on every build (fp16 converted in software without F16C), over enough rows for
    the threads; columns whose B is zero keep y's values exactly (special ones included)."""
    a, b = _randn(3, 24, 64) * 0.1, _randn(3, 24, 96, seed=1) * 0.1
    a[0], b[0], b[:, :, :16] = 0, 0, 0
    slots = torch.arange(40, dtype=torch.int32) % 3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, y = _randn(40, 64, seed=2).to(dtype), _randn(40, 96, seed=3).to(dtype)
        y[:, :5] = torch.tensor([2.0 ** -20, 65504.0, float("inf"), -float("inf"), 1 / 3])
        got = y.clone()
        ops.lora_apply(got, x, a, b, slots, 20)
        expected = y.double() + torch.stack([
            (a[s, :20].double() @ x[t].double()) @ b[s, :20].double()
            for t, s in enumerate(slots.tolist())])
        _close(got[:, 16:], expected[:, 16:].to(dtype), dtype, 4)
        assert torch.equal(got[:, :16], y[:, :16])

def test_paged_attention(ops) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        block_size, kv_heads, heads, head_dim = 4, 2, 4, 32
        k_cache = _randn(8, block_size, kv_heads, head_dim).to(dtype)
        v_cache = _randn(8, block_size, kv_heads, head_dim, seed=1).to(dtype)
        q = _randn(2, heads, head_dim, seed=2).to(dtype)
        tables = torch.tensor([[3, 1, 5], [0, 7, 2]], dtype=torch.int32)
        lens = torch.tensor([9, 5], dtype=torch.int32)
        out = torch.empty(2, heads * head_dim, dtype=dtype)
        ops.paged_attention(q, k_cache, v_cache, tables, lens, None, head_dim ** -0.5, out,
                            None, None, None)
        for t in range(2):
            rows = torch.cat([keys_as_rows(k_cache)[b] for b in tables[t].tolist()])[:lens[t]]
            values = torch.cat([v_cache[b] for b in tables[t].tolist()])[:lens[t]]
            keys = rows.repeat_interleave(heads // kv_heads, dim=1).double()
            vals = values.repeat_interleave(heads // kv_heads, dim=1).double()
            scores = torch.einsum("hd,thd->ht", q[t].double(), keys) * head_dim ** -0.5
            expected = torch.einsum("ht,thd->hd", scores.softmax(-1), vals).reshape(-1)
            _close(out[t], expected, dtype, 2)


@pytest.mark.parametrize("kind", [pytest.param(kind, id=name) for kind, name in NAMES.items()])
def test_int8_block_gemm_bits_equal_on_every_target(ops, kind):
    """Integer compute's bits are the same on every build target (int8_blocks.cpp)."""
    native = build.load_ops()
    g = torch.Generator().manual_seed(kind)
    k = 2 * LAYOUTS[kind].block
    part = raw_blocks(kind, 13, k, g).parts[0]
    # each build's own panel layout of the same bytes
    args, native_args = (([kind], [part.lane_panels(o.int8_panel_lanes())], [13])
                         for o in (ops, native))
    for rows in (1, 6):
        x = torch.randn(rows, k, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            got = ops.int8_block_gemm(x.to(dtype), *args)
            assert torch.equal(got, native.int8_block_gemm(x.to(dtype), *native_args))
