"""How prefill chunks are grouped for scaled_dot_product_attention, and that grouping never changes results."""

from __future__ import annotations

import torch

from conveyor.model.backends import sdpa
from conveyor.model.backends.cpu_kernels import CpuBackend
from conveyor.model.backends.sdpa import TorchBackend, _prefill_ranges
from conveyor.model.kernels.paged_attention import attention_kernel_available, keys_as_rows

CPU = torch.device("cpu")


def test_a_long_prompt_is_not_padded_together_with_short_ones() -> None:
    # one uncached 560-token prompt after 5 prompts of 48 new tokens behind a 512-token cached prefix
    starts, num_new = [512] * 5 + [0], [48] * 5 + [560]
    assert _prefill_ranges(starts, num_new, 0) == [(0, 5), (5, 6)]
    # similar lengths stay in one group
    assert _prefill_ranges([0] * 4, [30, 32, 40, 41], 0) == [(0, 4)]
    # decodes before ``lo`` are not touched
    assert _prefill_ranges([9, 0, 0, 0], [1, 5, 6, 500], 1) == [(1, 3), (3, 4)]


def test_grouping_does_not_change_the_output(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(3)
    bs, kv_heads, num_heads, head_dim = 4, 2, 4, 16
    k_cache = torch.randn(200, bs, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(200, bs, kv_heads, head_dim, generator=gen)
    starts, num_new = [8, 8, 8, 0], [3, 4, 4, 40]  # sorted by length, as the executor orders them
    tables = [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23], list(range(30, 40))]
    t = sum(num_new)
    q = torch.randn(t, num_heads, head_dim, generator=gen)
    k = torch.randn(t, kv_heads, head_dim, generator=gen)
    v = torch.randn(t, kv_heads, head_dim, generator=gen)
    outs = []
    for limit in (float("inf"), 2.0):
        monkeypatch.setattr(sdpa, "PREFILL_PADDING_LIMIT", limit)
        backend = TorchBackend(CPU)
        meta = backend.build_metadata(tables, starts, num_new, bs, num_heads // kv_heads,
                                      torch.float32)
        outs.append((len(meta.groups), backend.attention(q, k, v, k_cache.clone(),
                                                         v_cache.clone(), meta)))
    assert outs[0][0] == 1 and outs[1][0] == 2
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)


def _reference(q, k_cache, v_cache, tables, starts, num_new, bs):
    """Per entry, per head: causal softmax attention over the entry's context, read from the
    (already written) cache one position at a time."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    g = num_heads // k_cache.shape[2]
    out, t = [], 0
    for table, start, n in zip(tables, starts, num_new, strict=True):
        ctx = start + n
        keys = torch.stack([k_cache[table[p // bs], p % bs] for p in range(ctx)])  # [C, kv, D]
        values = torch.stack([v_cache[table[p // bs], p % bs] for p in range(ctx)])
        for i in range(n):
            visible = start + i + 1
            heads = []
            for h in range(num_heads):
                scores = keys[:visible, h // g] @ q[t + i, h] * head_dim ** -0.5
                heads.append(torch.softmax(scores, 0) @ values[:visible, h // g])
            out.append(torch.cat(heads))
        t += n
    return torch.stack(out)


def test_strided_q_mixed_decodes_and_padded_groups_match_a_reference() -> None:
    """The layer's call: q and k are views of one fused QKV buffer, decodes come first, then
    prefill chunks (after cached prefixes) of different lengths padded together."""
    gen = torch.Generator().manual_seed(5)
    bs, kv_heads, num_heads, head_dim = 4, 2, 6, 16
    k_cache = torch.randn(64, bs, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(64, bs, kv_heads, head_dim, generator=gen)
    starts, num_new = [5, 9, 0, 3, 0], [1, 1, 6, 7, 9]
    tables = [[0, 1], [2, 3, 4], [10, 11], [20, 21, 22], [30, 31, 32]]
    t = sum(num_new)
    qkv = torch.randn(t, (num_heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, :num_heads * head_dim].view(t, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v = qkv[:, (num_heads + kv_heads) * head_dim:].view(t, kv_heads, head_dim)
    for kernel in (False, True):
        if kernel and not attention_kernel_available(torch.device("cpu"), q.dtype):
            continue
        backend = CpuBackend(CPU, attention_kernel=True) if kernel else TorchBackend(CPU)
        meta = backend.build_metadata(tables, starts, num_new, bs, num_heads // kv_heads,
                                      q.dtype)
        kc, vc = k_cache.clone(), v_cache.clone()
        buffer = torch.empty(t, num_heads * head_dim)
        got = backend.attention(q, k, v, kc, vc, meta, out=buffer)
        expected = _reference(q, keys_as_rows(kc) if kernel else kc, vc, tables, starts,
                              num_new, bs)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert got.data_ptr() == buffer.data_ptr()


def test_decode_only_steps_get_the_decodes_metadata_of_a_mixed_step() -> None:
    """A step of decodes only (which the fused decode layers may serve) has the metadata the
    same decodes get ahead of a prefill chunk."""
    tables = [[3, 9], [4, 5, 6, 7], [1], [8, 2, 11]]
    starts = [20, 50, 0, 33]
    backend = CpuBackend(CPU, attention_kernel=True)
    only = backend.build_metadata(tables, starts, [1] * 4, 16, 3, torch.float32)
    mixed = backend.build_metadata(tables + [[12, 13]], starts + [0], [1] * 4 + [20], 16, 3,
                                   torch.float32)
    assert only.decode_only and not mixed.decode_only
    assert mixed.token_seqs[:4].tolist() == [0, 1, 2, 3]
    for a, b in ((only.slot_mapping, mixed.slot_mapping[:4]), (only.positions, mixed.positions[:4]),
                 (only.block_tables, mixed.block_tables[:4]),
                 (only.context_lens, mixed.context_lens[:4])):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert only.slot_mapping.tolist() == [9 * 16 + 4, 7 * 16 + 2, 16, 11 * 16 + 1]
