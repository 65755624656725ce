"""The Triton kernels against plain torch: KV write with scattered slots, decode with GQA and
ragged contexts across block boundaries (one split and several), prefill chunks after cached
prefixes. bf16 and fp16, head sizes 64 and 128, on shapes small enough for the interpreter;
sliding windows at Gemma 3's head size 256, the blocks before each window poisoned with NaN
(a kernel that read them would return NaN)."""

import pytest
import torch

from conveyor.model.kernels.triton.decode_attention import decode_attention, num_splits_for
from conveyor.model.kernels.triton.kv_write import write_kv
from conveyor.model.kernels.triton.prefill_attention import prefill_attention

DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [64, 128]
BLOCK_SIZE = 16
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _cache(num_blocks, kv_heads, head_dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    return (torch.randn(shape, generator=g).to(dtype).to(device),
            torch.randn(shape, generator=g).to(dtype).to(device))


def _block_tables(seq_lens, num_blocks, seed=0):
    """Each sequence gets distinct, shuffled blocks: its context crosses block boundaries out of
    order, as a real block table does."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // BLOCK_SIZE) for n in seq_lens)
    tables = []
    for n in seq_lens:
        need = -(-n // BLOCK_SIZE)
        tables.append(perm[:need] + [0] * (width - need))
        perm = perm[need:]
    return torch.tensor(tables, dtype=torch.int32)


def _reference(q, k_cache, v_cache, table, seq_len, q_len, window=None):
    """Attention of q ([q_len, heads, D], the last q_len positions of the sequence) to the
    sequence's first seq_len cached positions, causal (and within ``window`` positions), in
    float32."""
    heads, d = q.shape[1], q.shape[2]
    blocks = table[: -(-seq_len // BLOCK_SIZE)].long().cpu()
    k = k_cache.cpu()[blocks].reshape(-1, k_cache.shape[2], d)[:seq_len].float()
    v = v_cache.cpu()[blocks].reshape(-1, k_cache.shape[2], d)[:seq_len].float()
    if window is not None:  # positions before the first query's window: unread (poisoned)
        before = max(0, seq_len - q_len - window + 1)
        k[:before], v[:before] = 0, 0
    g = heads // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.cpu().float(), k) * d ** -0.5
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    s = s.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    if window is not None:
        s = s.masked_fill(torch.arange(seq_len)[None, :] <= q_pos - window, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_kv_write_scattered_slots(dtype, head_dim, device):
    kv_heads, num_blocks = 2, 4
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([37, 3, 60, -1, 16, 15], device=device)  # -1: a padded row, skipped
    # k and v as strided views of one fused buffer, as the model's QKV output gives them
    qkv = torch.randn(len(slots), 3 * kv_heads, head_dim).to(dtype).to(device)
    k, v = qkv[:, kv_heads:2 * kv_heads], qkv[:, 2 * kv_heads:]
    write_kv(k, v, k_cache, v_cache, slots)
    want_k = torch.zeros_like(k_cache).view(-1, kv_heads, head_dim)
    want_v = torch.zeros_like(want_k)
    real = slots >= 0
    want_k[slots[real]] = k[real]
    want_v[slots[real]] = v[real]
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim), want_k)
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim), want_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_gqa_ragged_contexts(dtype, head_dim, num_splits, device):
    heads, kv_heads, num_blocks = 6, 2, 24
    # one token, one past a block, several blocks, ragged; with 3 splits of at least 16
    # positions, the short ones leave splits empty
    seq_lens = [1, 17, 70, 33]
    k_cache, v_cache = _cache(num_blocks, kv_heads, head_dim, dtype, device)
    tables = _block_tables(seq_lens, num_blocks)
    q = torch.randn(len(seq_lens), heads, head_dim).to(dtype).to(device)
    out = decode_attention(q, k_cache, v_cache, tables.to(device),
                           torch.tensor(seq_lens, dtype=torch.int32, device=device),
                           head_dim ** -0.5, num_splits, block_n=16, min_split_len=16)
    for i, n in enumerate(seq_lens):
        want = _reference(q[i:i + 1], k_cache, v_cache, tables[i], n, 1)
        torch.testing.assert_close(out[i:i + 1].cpu().float(), want, atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])


def test_decode_padded_rows_are_zero(device):
    """A CUDA-graph batch pads with context length 0: those rows come out zero, not NaN."""
    k_cache, v_cache = _cache(4, 1, 64, torch.float16, device)
    q = torch.randn(2, 2, 64).half().to(device)
    out = decode_attention(q, k_cache, v_cache, torch.tensor([[1], [0]], dtype=torch.int32,
                                                             device=device),
                           torch.tensor([5, 0], dtype=torch.int32, device=device), 0.125, 2,
                           block_n=16)
    assert torch.equal(out[1].cpu(), torch.zeros(2, 64, dtype=torch.float16))
    assert torch.isfinite(out[0].float()).all() and out[0].abs().sum() > 0


def test_num_splits_grows_with_context_and_shrinks_with_batch():
    assert num_splits_for(100, 1, 8) == 1
    assert num_splits_for(4096, 1, 8) == 16
    assert num_splits_for(4096, 64, 8) == 1
    assert 1 < num_splits_for(2048, 2, 8) <= 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_prefill_chunks_after_cached_prefixes(dtype, head_dim, device):
    heads, kv_heads, num_blocks = 4, 2, 24
    # (cached prefix, new tokens): a fresh prompt, a prefix-cache hit of whole blocks, a later
    # chunk of a chunked prefill starting mid-block, a one-token chunk
    entries = [(0, 21), (32, 9), (13, 20), (40, 1)]
    seq_lens = [p + n for p, n in entries]
    k_cache, v_cache = _cache(num_blocks, kv_heads, head_dim, dtype, device)
    tables = _block_tables(seq_lens, num_blocks)
    q_lens = [n for _, n in entries]
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), heads, head_dim).to(dtype).to(device)
    out = prefill_attention(q, k_cache, v_cache, tables.to(device),
                            torch.tensor(seq_lens, dtype=torch.int32, device=device),
                            starts.to(device), max(q_lens), head_dim ** -0.5, block_m=16,
                            block_n=16)
    for i, (n, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        want = _reference(q[rows], k_cache, v_cache, tables[i], n, q_len)
        torch.testing.assert_close(out[rows].cpu().float(), want, atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])


WINDOW = 20


def _poison_before_windows(tables, first_positions, k_cache, v_cache):
    """Points the table entries of the blocks wholly before each sequence's first query's window
    at the last cache block, filled with NaN."""
    poison = k_cache.shape[0] - 1
    k_cache[poison], v_cache[poison] = float("nan"), float("nan")
    tables = tables.clone()
    for i, first in enumerate(first_positions):
        tables[i, :max(0, first - WINDOW + 1) // BLOCK_SIZE] = poison
    return tables


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attends_its_window_only(num_splits, device):
    heads, kv_heads, head_dim, num_blocks = 4, 1, 256, 16
    seq_lens = [5, 21, 70, 40]
    k_cache, v_cache = _cache(num_blocks, kv_heads, head_dim, torch.bfloat16, device)
    tables = _poison_before_windows(_block_tables(seq_lens, num_blocks - 1),
                                    [n - 1 for n in seq_lens], k_cache, v_cache)
    q = torch.randn(len(seq_lens), heads, head_dim).to(torch.bfloat16).to(device)
    out = decode_attention(q, k_cache, v_cache, tables.to(device),
                           torch.tensor(seq_lens, dtype=torch.int32, device=device),
                           head_dim ** -0.5, num_splits, block_n=16, min_split_len=8,
                           window=WINDOW)
    for i, n in enumerate(seq_lens):
        want = _reference(q[i:i + 1], k_cache, v_cache, tables[i], n, 1, WINDOW)
        torch.testing.assert_close(out[i:i + 1].cpu().float(), want, atol=2e-2, rtol=2e-2)


def test_prefill_chunks_attend_their_windows(device):
    heads, kv_heads, head_dim, num_blocks = 4, 1, 256, 16
    entries = [(0, 45), (37, 9), (50, 1)]  # a chunk longer than the window; after a prefix
    seq_lens = [p + n for p, n in entries]
    k_cache, v_cache = _cache(num_blocks, kv_heads, head_dim, torch.bfloat16, device)
    tables = _poison_before_windows(_block_tables(seq_lens, num_blocks - 1),
                                    [p for p, _ in entries], k_cache, v_cache)
    q_lens = [n for _, n in entries]
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), heads, head_dim).to(torch.bfloat16).to(device)
    out = prefill_attention(q, k_cache, v_cache, tables.to(device),
                            torch.tensor(seq_lens, dtype=torch.int32, device=device),
                            starts.to(device), max(q_lens), head_dim ** -0.5, block_m=16,
                            block_n=16, window=WINDOW)
    for i, (n, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        want = _reference(q[rows], k_cache, v_cache, tables[i], n, q_len, WINDOW)
        torch.testing.assert_close(out[rows].cpu().float(), want, atol=2e-2, rtol=2e-2)
