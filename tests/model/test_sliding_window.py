"""Sliding-window attention (Gemma 3's local layers) in the C++ paged attention kernel and in
``TorchBackend``: a token at position p attends to (p - window, p], and no block that lies
wholly before the window is read. Those blocks' table entries point at a block of NaNs here, so
a kernel that read them (even to mask them) would return NaN."""

from __future__ import annotations

import pytest
import torch

from conveyor.model.backends.sdpa import TorchBackend
from conveyor.model.kernels.paged_attention import (
    attention_kernel_available,
    kernel_attention,
    keys_as_rows,
)

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not attention_kernel_available(CPU, torch.float32),
                                  reason="no C++ compiler: the torch path attends")
POISON = -1  # the cache block of NaNs (the last) that every entry before a window names


def windowed_reference(q, k_cache, v_cache, tables, lens, window, token_seqs=None):
    """Per query token (context ``lens[t]``): its last ``window`` positions, attended in float64.
    Returns [T, num_heads * head_dim]."""
    num_heads, kv_heads, bs = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out = []
    for t in range(q.shape[0]):
        n, row = int(lens[t]), t if token_seqs is None else int(token_seqs[t])
        positions = range(max(0, n - window), n)
        k = torch.stack([k_cache[int(tables[row, p // bs]), p % bs] for p in positions]).double()
        v = torch.stack([v_cache[int(tables[row, p // bs]), p % bs] for p in positions]).double()
        g = num_heads // kv_heads
        k = k.repeat_interleave(g, dim=1).transpose(0, 1)  # [heads, n, D]
        v = v.repeat_interleave(g, dim=1).transpose(0, 1)
        s = torch.einsum("hd,hkd->hk", q[t].double(), k) * q.shape[2] ** -0.5
        out.append(torch.einsum("hk,hkd->hd", s.softmax(-1), v))
    return torch.stack(out).flatten(1)


def poisoned_tables(firsts: list[int], ends: list[int], window: int, block_size: int,
                    num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """A table row per sequence, context up to ``ends[i]``: the entries of the blocks wholly
    before the window of its first query (at position ``firsts[i]``) name POISON, the rest
    distinct shuffled blocks."""
    width = (max(ends) + block_size - 1) // block_size
    perm = torch.randperm(num_blocks - 1, generator=gen).tolist()
    rows = []
    for first in firsts:
        keep = max(0, first - window + 1) // block_size  # blocks before it: never read
        rows.append([num_blocks - 1] * keep + perm[:width - keep])
        perm = perm[width - keep:]
    return torch.tensor(rows, dtype=torch.int32)


def caches(num_blocks, block_size, kv_heads, head_dim, dtype, gen):
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    k[POISON], v[POISON] = float("nan"), float("nan")
    return k, v


SHAPES = pytest.mark.parametrize(("head_dim", "num_heads", "kv_heads", "block_size"), [
    (256, 4, 1, 16),  # Gemma 3 270M
    (64, 9, 3, 16),  # SmolLM2's shape (bf16: the vdpbf16ps decode path)
    (64, 16, 2, 5),  # odd blocks: keys gathered, bf16 value pairs across blocks
])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


@needs_kernel
@DTYPES
@SHAPES
@pytest.mark.parametrize("window", [7, 40])
def test_kernel_decodes_attend_their_window_only(dtype, head_dim, num_heads, kv_heads,
                                                 block_size, window) -> None:
    gen = torch.Generator().manual_seed(head_dim + window)
    k_cache, v_cache = caches(300, block_size, kv_heads, head_dim, dtype, gen)
    lens = [1, window - 1, window, window + 1, 3 * block_size + 2, 150, 97, 2 * window + 3]
    tables = poisoned_tables([n - 1 for n in lens], lens, window, block_size, 300, gen)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    got = kernel_attention(q, k_cache, v_cache, tables, lens_t, head_dim ** -0.5, window=window)
    expected = windowed_reference(q, keys_as_rows(k_cache), v_cache, tables, lens_t, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


@needs_kernel
@DTYPES
@SHAPES
@pytest.mark.parametrize("window", [7, 40])
def test_kernel_prefill_chunks_attend_their_windows(dtype, head_dim, num_heads, kv_heads,
                                                    block_size, window) -> None:
    """Chunks after cached prefixes, long enough for the tiles and short ones that go token by
    token, each token masked to its own window; a chunk longer than the window too."""
    gen = torch.Generator().manual_seed(head_dim * window)
    k_cache, v_cache = caches(400, block_size, kv_heads, head_dim, dtype, gen)
    starts, counts = [0, 37, 5, 90, 130], [70, 30, 1, 2, 45]
    ends = [s + n for s, n in zip(starts, counts, strict=True)]
    tables = poisoned_tables(starts, ends, window, block_size, 400, gen)
    token_seqs = torch.repeat_interleave(torch.arange(len(starts)),
                                         torch.tensor(counts)).to(torch.int32)
    lens = torch.cat([torch.arange(s + 1, e + 1) for s, e in zip(starts, ends, strict=True)])
    lens = lens.to(torch.int32)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    got = kernel_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, token_seqs,
                           window=window)
    expected = windowed_reference(q, keys_as_rows(k_cache), v_cache, tables, lens, window,
                                  token_seqs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


@needs_kernel
def test_kernel_without_window_reads_the_whole_context() -> None:
    """window 0/None is the whole context: the poisoned entries are then read (NaN)."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = caches(50, 16, 1, 256, torch.float32, gen)
    tables = poisoned_tables([99], [100], 20, 16, 50, gen)
    q = torch.randn(1, 4, 256, generator=gen)
    lens = torch.tensor([100], dtype=torch.int32)
    assert kernel_attention(q, k_cache, v_cache, tables, lens, 1 / 16).isnan().all()
    assert not kernel_attention(q, k_cache, v_cache, tables, lens, 1 / 16,
                                window=20).isnan().any()


@pytest.mark.parametrize("window", [7, 40])
def test_torch_backend_attends_windows_without_reading_before_them(window) -> None:
    """TorchBackend's step (decodes, then prefill chunks after cached prefixes): each layer's
    group gathers from its window's first block on, and the mask keeps each query's window."""
    head_dim, num_heads, kv_heads, block_size = 256, 4, 1, 16
    gen = torch.Generator().manual_seed(window)
    k_cache, v_cache = caches(300, block_size, kv_heads, head_dim, torch.float32, gen)
    starts, counts = [5, 150, 60, 0, 37, 90], [1, 1, 1, 70, 30, 45]
    ends = [s + n for s, n in zip(starts, counts, strict=True)]
    tables = poisoned_tables(starts, ends, window, block_size, 300, gen)
    backend = TorchBackend(CPU)
    meta = backend.build_metadata(tables.tolist(), starts, counts, block_size,
                                  num_heads // kv_heads, torch.float32)
    t = sum(counts)
    q = torch.randn(t, num_heads, head_dim, generator=gen)
    k = torch.randn(t, kv_heads, head_dim, generator=gen)
    v = torch.randn(t, kv_heads, head_dim, generator=gen)
    got = backend.attention(q, k, v, k_cache, v_cache, meta, window=window)
    token_seqs = torch.repeat_interleave(torch.arange(len(starts)), torch.tensor(counts))
    lens = torch.cat([torch.arange(s + 1, e + 1) for s, e in zip(starts, ends, strict=True)])
    expected = windowed_reference(q, k_cache, v_cache, tables, lens, window, token_seqs)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # a full-attention layer of the same step reads every block (the poisoned ones: NaN)
    assert backend.attention(q, k, v, k_cache, v_cache, meta).isnan().any()
