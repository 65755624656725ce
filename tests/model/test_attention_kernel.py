"""The C++ paged attention kernel (decodes and prefill chunks): equal to a float64 reference,
and its fallbacks."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.model.backends.cpu_kernels import CpuBackend, KernelMetadata
from conveyor.model.backends.sdpa import TorchBackend
from conveyor.model.kernels import build
from conveyor.model.kernels.paged_attention import (
    attention_kernel_available,
    kernel_attention,
    keys_as_rows,
    keys_from_rows,
)

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not attention_kernel_available(CPU, torch.float32),
                                  reason="no C++ compiler: the torch path attends")
# (queries' dtype, cache's dtype): the model's dtype, and a float32 model over a bf16 cache
dtypes = pytest.mark.parametrize(("dtype", "cache_dtype"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16)], ids=["f32", "bf16", "f32-bf16-cache"])


def _reference(q, k_cache, v_cache, tables, lens, token_seqs=None):
    """Per query token: gather its sequence's first ``lens[t]`` keys/values position by
    position, attend in float64. Returns [T, num_heads * head_dim]."""
    num_heads, kv_heads = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    k_cache = keys_as_rows(k_cache)
    out = []
    for s in range(q.shape[0]):
        n, row = int(lens[s]), s if token_seqs is None else int(token_seqs[s])
        slots = [(int(tables[row, t // bs]), t % bs) for t in range(n)]
        k = torch.stack([k_cache[b, o] for b, o in slots]).double()  # [n, kv_heads, D]
        v = torch.stack([v_cache[b, o] for b, o in slots]).double()
        g = num_heads // kv_heads
        k = k.repeat_interleave(g, dim=1).transpose(0, 1)
        v = v.repeat_interleave(g, dim=1).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[s].double()[:, None], k, v)[:, 0])
    return torch.stack(out).flatten(1)


@needs_kernel
@dtypes
@pytest.mark.parametrize(("head_dim", "num_heads", "kv_heads", "block_size"), [
    (64, 9, 3, 16),  # SmolLM2-135M
    (128, 32, 8, 16),  # Llama-3-8B
    (80, 4, 4, 1),  # no compile-time head size; one token per block
    (16, 14, 2, 32),  # a group of 7
    (32, 8, 1, 12),  # a group of 8 (two register tiles of values); blocks of 8 + 4 rows
    (64, 16, 2, 5),  # bf16 on vdpbf16ps: a group of 8 (two tiles), row pairs in odd blocks
])
@pytest.mark.parametrize("num_seqs", [3, 12])  # few: a task per KV head; many: per sequence
def test_kernel_equals_reference(dtype, cache_dtype, head_dim, num_heads, kv_heads, block_size,
                                 num_seqs) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks = 2000
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 97, 2, 150, 16, 33,
                         64, 5, 80][:num_seqs], dtype=torch.int32)
    max_blocks = int((lens.max() + block_size - 1) // block_size)
    perm = torch.randperm(num_blocks, generator=gen)  # scattered blocks
    tables = perm[:len(lens) * max_blocks].view(len(lens), max_blocks).to(torch.int32)
    # q as the model has it: a strided view into a wider row
    q = torch.randn(len(lens), num_heads + 5, head_dim, generator=gen).to(dtype)[:, :num_heads]
    got = kernel_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    expected = _reference(q, k_cache, v_cache, tables, lens)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


def _chunks(starts, num_new, block_size, num_blocks, gen):
    """Block tables, token_seqs and context lengths for prefill chunks: sequence i's tokens
    starts[i] .. starts[i] + num_new[i] - 1 are this call's query tokens."""
    max_blocks = (max(s + n for s, n in zip(starts, num_new, strict=True)) + block_size - 1) // block_size
    tables = torch.randperm(num_blocks, generator=gen)[:len(starts) * max_blocks]
    tables = tables.view(len(starts), max_blocks).to(torch.int32)
    token_seqs = torch.repeat_interleave(torch.arange(len(starts)), torch.tensor(num_new))
    lens = torch.cat([torch.arange(s + 1, s + n + 1) for s, n in zip(starts, num_new, strict=True)])
    return tables, token_seqs.to(torch.int32), lens.to(torch.int32)


@needs_kernel
@dtypes
@pytest.mark.parametrize(("head_dim", "num_heads", "kv_heads", "block_size"), [
    (64, 9, 3, 16), (80, 4, 4, 1)])
def test_prefill_chunks_attend_their_causal_prefix(dtype, cache_dtype, head_dim, num_heads,
                                                   kv_heads, block_size) -> None:
    """Tokens of several sequences in one call (token_seqs), each chunk after a cached prefix
    of its own length: each token sees exactly the positions up to its own."""
    gen = torch.Generator().manual_seed(11)
    k_cache = torch.randn(400, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(400, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    starts, num_new = [0, 37, 5, 0], [23, 9, 1, 2]  # a decode between chunks: any order works
    tables, token_seqs, lens = _chunks(starts, num_new, block_size, 400, gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    out = torch.empty(len(lens), num_heads * head_dim, dtype=dtype)
    got = kernel_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, token_seqs,
                           out=out)
    assert got.data_ptr() == out.data_ptr()
    expected = _reference(q, k_cache, v_cache, tables, lens, token_seqs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)
    # a token given a longer context than its own sees more: the lengths are what is used
    # (a block more in each table, so that every longer context is in its table)
    wider = torch.cat([tables, tables[:, -1:]], dim=1).contiguous()
    longer = kernel_attention(q, k_cache, v_cache, wider, lens + 1, head_dim ** -0.5,
                              token_seqs)
    assert not torch.allclose(longer.double(), expected, rtol=tol, atol=tol)


@needs_kernel
@dtypes
@pytest.mark.parametrize(("head_dim", "num_heads", "kv_heads", "block_size"), [
    (64, 9, 3, 16), (128, 32, 8, 16), (80, 4, 4, 1), (16, 14, 2, 32), (32, 8, 1, 12)])
def test_long_prefill_chunks_in_tiles_equal_reference(dtype, cache_dtype, head_dim, num_heads,
                                                      kv_heads, block_size) -> None:
    """Long runs of a sequence's tokens go through the tiled path (attention_tile.h): several
    tiles per run, contexts longer than one pass of keys, a cached prefix before a chunk, a run
    too short for a tile and a decode in between; contexts over several 512-key chunks of the
    online softmax, and a run whose first rows end at a chunk's start and last rows cross it."""
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    starts, num_new = [0, 130, 40, 0, 1000, 490], [150, 71, 1, 3, 90, 40]
    num_blocks = len(starts) * (1090 + block_size - 1) // block_size + 8
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    tables, token_seqs, lens = _chunks(starts, num_new, block_size, num_blocks, gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    got = kernel_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, token_seqs)
    expected = _reference(q, k_cache, v_cache, tables, lens, token_seqs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


@needs_kernel
@dtypes
def test_a_tokens_result_does_not_depend_on_its_tile(dtype, cache_dtype) -> None:
    """A prompt attended in one call, or as chunks (each after the previous ones' cached
    prefix, as prefix caching and chunked prefill do): every token's output is the same bits,
    over several of the online softmax's key chunks too."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(72, 16, 3, 64, generator=gen).to(cache_dtype)
    v_cache = torch.randn(72, 16, 3, 64, generator=gen).to(cache_dtype)
    tables, token_seqs, lens = _chunks([0], [1100], 16, 72, gen)
    q = torch.randn(1100, 9, 64, generator=gen).to(dtype)
    whole = kernel_attention(q, k_cache, v_cache, tables, lens, 0.125, token_seqs)
    parts = [kernel_attention(q[a:b], k_cache, v_cache, tables, lens[a:b].contiguous(), 0.125,
                              token_seqs[a:b].contiguous())
             for a, b in ((0, 37), (37, 600), (600, 1100))]
    assert torch.equal(whole, torch.cat(parts))


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(shape=st.sampled_from([(64, 9, 3), (32, 8, 1), (16, 4, 4), (48, 6, 2)]),
       block_size=st.sampled_from([1, 5, 16]),
       steps=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 70)), min_size=1, max_size=5),
       seed=st.integers(0, 2**16))
def test_any_mix_of_chunks_and_decodes_equals_reference(shape, block_size, steps, seed) -> None:
    """Random steps: each entry is a sequence's chunk (a cached prefix of any length, then 1-70
    new tokens; one new token is a decode), in any order: tiles, short runs and single tokens
    side by side."""
    head_dim, num_heads, kv_heads = shape
    gen = torch.Generator().manual_seed(seed)
    starts, num_new = [s for s, _ in steps], [n for _, n in steps]
    num_blocks = len(steps) * (160 // block_size + 1)
    tables, token_seqs, lens = _chunks(starts, num_new, block_size, num_blocks, gen)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    got = kernel_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, token_seqs)
    expected = _reference(q, k_cache, v_cache, tables, lens, token_seqs)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
@dtypes
def test_kernel_writes_the_steps_keys_and_values_first(dtype, cache_dtype) -> None:
    """new_kv: the rows land where index_copy_ of the rounded values would put them, bit for
    bit, and a prefill chunk's tokens already see each other's (written in the same call)."""
    gen = torch.Generator().manual_seed(5)
    bs, kv_heads, num_heads, head_dim = 16, 3, 9, 64
    caches = [torch.randn(8, bs, kv_heads, head_dim, generator=gen).to(cache_dtype)
              for _ in range(2)]
    qkv = torch.randn(20, (num_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :num_heads * head_dim].view(20, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + kv_heads) * head_dim].view(20, kv_heads, head_dim)
    v = qkv[:, (num_heads + kv_heads) * head_dim:].view(20, kv_heads, head_dim)
    tables = torch.tensor([[5, 2]], dtype=torch.int32)  # one sequence, a 20-token chunk
    slots = torch.tensor([5 * bs + i if i < bs else 2 * bs + i - bs for i in range(20)])
    lens = torch.arange(1, 21, dtype=torch.int32)
    seqs = torch.zeros(20, dtype=torch.int32)
    expected = [keys_as_rows(caches[0]).clone(memory_format=torch.contiguous_format),
                caches[1].clone()]  # as rows
    for c, new in zip(expected, (k, v), strict=True):
        c.view(-1, kv_heads, head_dim).index_copy_(0, slots, new.to(cache_dtype))
    got = kernel_attention(q, *caches, tables, lens, head_dim ** -0.5, seqs, new_kv=(k, v, slots))
    assert torch.equal(keys_as_rows(caches[0]), expected[0])
    assert torch.equal(caches[1], expected[1])
    reference = _reference(q, keys_from_rows(expected[0]), expected[1], tables, lens, seqs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), reference, rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="new_k must have shape"):
        kernel_attention(q, *caches, tables, lens, 0.125, seqs, new_kv=(k[:3], v, slots))
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        kernel_attention(q, *caches, tables, lens, 0.125, seqs, new_kv=(k, v, slots.int()))


@needs_kernel
def test_bad_kernel_arguments_are_refused() -> None:
    k_cache = torch.zeros(4, 16, 3, 64)
    q = torch.zeros(2, 9, 64)
    tables = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block_tables must be int32"):
        kernel_attention(q, k_cache, k_cache, tables.long(), lens, 0.125)
    with pytest.raises(RuntimeError, match=r"context_lens must have shape \[2\]"):
        kernel_attention(q, k_cache, k_cache, tables, lens[:1], 0.125)
    with pytest.raises(RuntimeError, match="a row per token"):
        kernel_attention(q, k_cache, k_cache, tables[:1], lens, 0.125)
    with pytest.raises(RuntimeError, match="v_cache must be float32"):
        kernel_attention(q, k_cache, k_cache.bfloat16(), tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="k_cache must be bfloat16 for bfloat16 queries"):
        kernel_attention(q.bfloat16(), k_cache, k_cache, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 0\] = 7 is not a cache block"):
        kernel_attention(q, k_cache, k_cache, tables + 7, lens, 0.125)
    with pytest.raises(RuntimeError, match="context_lens.0. = 17 is outside"):
        kernel_attention(q, k_cache, k_cache, tables, lens + 16, 0.125)


@needs_kernel
@dtypes
def test_metadata_with_kernel_equals_torch_path(dtype, cache_dtype) -> None:
    """Decodes next to two prefill chunks: the kernel gives the all-torch path's result."""
    gen = torch.Generator().manual_seed(7)
    bs, kv_heads, num_heads, head_dim = 4, 2, 6, 32
    k_cache = torch.randn(64, bs, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(64, bs, kv_heads, head_dim, generator=gen).to(cache_dtype)
    tables = [[3, 9, 4], [10], [20, 21, 22, 23, 24], [30, 31, 32], [40, 41]]
    starts, num_new = [9, 0, 18, 0, 3], [1, 1, 1, 10, 4]
    t = sum(num_new)
    q = torch.randn(t, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    outs = []
    for kernel in (False, True):
        backend = CpuBackend(CPU, attention_kernel=True) if kernel else TorchBackend(CPU)
        meta = backend.build_metadata(tables, starts, num_new, bs, num_heads // kv_heads, dtype)
        assert isinstance(meta, KernelMetadata) == kernel
        keys = keys_from_rows(k_cache) if kernel else k_cache.clone()  # the same rows
        outs.append(backend.attention(q, k, v, keys, v_cache.clone(), meta))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=tol, atol=tol)


def _forget_loaded_kernels() -> None:
    for cached in (build.kernel_ops, build.kernel_features):
        cached.cache_clear()


def test_env_turns_the_kernels_off(monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_KERNELS", "off")
    _forget_loaded_kernels()
    try:
        assert not attention_kernel_available(CPU, torch.float32)
    finally:
        monkeypatch.delenv("CONVEYOR_KERNELS")
        _forget_loaded_kernels()


def test_no_compiler_falls_back_with_a_warning(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(build.KernelBuildError, match="cannot run the C"):
        build.build_ops()
    monkeypatch.setattr(build, "load_ops", build.load_ops.__wrapped__)  # not the loaded one
    _forget_loaded_kernels()
    try:
        with pytest.warns(UserWarning, match="torch paths"):
            assert not attention_kernel_available(CPU, torch.float32)
        assert not attention_kernel_available(torch.device("cuda"), torch.float32)
    finally:
        _forget_loaded_kernels()


@needs_kernel
def test_build_is_cached_per_machine() -> None:
    """The model's library was built (or found) under the cache folder; asking again builds
    nothing."""
    library, _ = build.build_ops()
    again, seconds = build.build_ops()
    assert again == library and seconds == 0
    assert library.parent == build.cache_dir() / "kernels" and library.name.startswith("conveyor-")


def test_processes_starting_together_build_once(monkeypatch, tmp_path) -> None:
    """Builders of one library wait for each other (test workers, a server's ranks starting
    together): the first compiles, the others find its library."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    compiled: list[int] = []

    def slow_compile(commands: list[list[str]], start: float) -> tuple[int, str]:
        compiled.append(len(commands))
        time.sleep(0.3)  # long enough for the other builders to arrive and wait
        for command in commands:
            Path(command[command.index("-o") + 1]).write_bytes(b"")
        return 0, ""

    monkeypatch.setattr(build, "_compile", slow_compile)
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: build.build_ops(), range(3)))
    assert len({library for library, _ in results}) == 1 and results[0][0].exists()
    assert sorted(seconds > 0 for _, seconds in results) == [False, False, True]
    assert len(compiled) == 2  # the sources once, the link once


def test_kernel_sources_ship_in_the_package() -> None:
    """Every kernel source and header matches a package-data pattern, so an installed (not
    editable) package can still build its kernels."""
    import fnmatch

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
