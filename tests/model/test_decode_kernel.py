"""The C++ paged decode attention kernel: equal to a float64 reference, and its fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.model.kernels import build
from conveyor.model.kernels.decode_attention import decode_kernel_available, paged_decode_attention
from conveyor.model.layers.attention import build_attention_metadata, paged_attention

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not decode_kernel_available(CPU, torch.float32),
                                  reason="no C++ compiler: the torch path serves decodes")


def _reference(q, k_cache, v_cache, tables, lens):
    """Per sequence: gather its keys/values token by token, attend in float64."""
    num_heads, kv_heads = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    out = []
    for s in range(q.shape[0]):
        n = int(lens[s])
        slots = [(int(tables[s, t // bs]), t % bs) for t in range(n)]
        k = torch.stack([k_cache[b, o] for b, o in slots]).double()  # [n, kv_heads, D]
        v = torch.stack([v_cache[b, o] for b, o in slots]).double()
        g = num_heads // kv_heads
        k = k.repeat_interleave(g, dim=1).transpose(0, 1)
        v = v.repeat_interleave(g, dim=1).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[s].double()[:, None], k, v)[:, 0])
    return torch.stack(out)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "num_heads", "kv_heads", "block_size"), [
    (64, 9, 3, 16),  # SmolLM2-135M
    (128, 32, 8, 16),  # Llama-3-8B
    (80, 4, 4, 1),  # no compile-time head size; one token per block
    (16, 14, 2, 32),  # a group of 7
])
@pytest.mark.parametrize("num_seqs", [3, 12])  # few: a task per KV head; many: per sequence
def test_kernel_equals_reference(dtype, head_dim, num_heads, kv_heads, block_size, num_seqs) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks = 2000
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 97, 2, 150, 16, 33,
                         64, 5, 80][:num_seqs], dtype=torch.int32)
    max_blocks = int((lens.max() + block_size - 1) // block_size)
    perm = torch.randperm(num_blocks, generator=gen)  # scattered blocks
    tables = perm[:len(lens) * max_blocks].view(len(lens), max_blocks).to(torch.int32)
    # q as the model has it: a strided view into a wider row
    q = torch.randn(len(lens), num_heads + 5, head_dim, generator=gen).to(dtype)[:, :num_heads]
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    expected = _reference(q, k_cache, v_cache, tables, lens)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_metadata_with_kernel_equals_torch_path(dtype) -> None:
    """Decodes (kernel) next to two prefill chunks (SDPA): same result as the all-torch path."""
    gen = torch.Generator().manual_seed(7)
    bs, kv_heads, num_heads, head_dim = 4, 2, 6, 32
    k_cache = torch.randn(64, bs, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(64, bs, kv_heads, head_dim, generator=gen).to(dtype)
    tables = [[3, 9, 4], [10], [20, 21, 22, 23, 24], [30, 31, 32], [40, 41]]
    starts, num_new = [9, 0, 18, 0, 3], [1, 1, 1, 10, 4]
    t = sum(num_new)
    q = torch.randn(t, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    outs = []
    for kernel in (False, True):
        meta = build_attention_metadata(tables, starts, num_new, bs, num_heads // kv_heads, CPU,
                                        decode_kernel=kernel)
        assert (meta.decode is not None) == kernel
        outs.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=tol, atol=tol)


def test_env_turns_the_kernels_off(monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_KERNELS", "off")
    build.kernel_library.cache_clear()
    try:
        assert not decode_kernel_available(CPU, torch.float32)
    finally:
        monkeypatch.delenv("CONVEYOR_KERNELS")
        build.kernel_library.cache_clear()


def test_no_compiler_falls_back_with_a_warning(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    build.kernel_library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="torch path"):
            assert not decode_kernel_available(CPU, torch.float32)
        assert not decode_kernel_available(torch.device("cuda"), torch.float32)
    finally:
        build.kernel_library.cache_clear()


@needs_kernel
def test_build_is_cached_per_machine(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    _, first = build.build_kernel("paged_decode_attention.cpp")
    _, second = build.build_kernel("paged_decode_attention.cpp")
    assert first > 0 and second == 0
    assert len(list((tmp_path / "kernels").glob("paged_decode_attention-*.so"))) == 1


def test_kernel_sources_ship_in_the_package() -> None:
    """Every kernel source and header matches a package-data pattern, so an installed (not
    editable) package can still build its kernels."""
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["conveyor"]
    kernels = Path(build.__file__).parent
    sources = [p for p in kernels.iterdir() if p.suffix in (".cpp", ".h")]
    assert any(p.suffix == ".h" for p in sources)
    for path in sources:
        relative = str(path.relative_to(kernels.parents[1]))
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns), relative
