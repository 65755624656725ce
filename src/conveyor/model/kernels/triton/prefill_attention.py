"""Paged prefill/extend attention: each sequence's chunk of new queries against its whole
context, read from the cache through the block table (the chunk's own keys were written there
first by ``kv_write``), causally masked.

A sequence's context is ``seq_len`` positions; its ``q_len`` new tokens sit at positions
``seq_len - q_len ..``, so a prefix-cache hit or an earlier chunk of a chunked prefill is just
``seq_len > q_len``. Grid ``(seqs, heads, query tiles)``: a program takes ``BLOCK_M`` query rows
of one head and walks the keys up to its last row's position ``BLOCK_N`` at a time, with an
online softmax. GQA maps query head ``h`` to KV head ``h // group``. A sliding-window layer
(``window``, a launch constant) starts the walk at its first row's window and masks each row to
its own: no key before the tile's first window is read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.model.kernels.triton.common import check_attention_inputs, dot_dtype, dot_precision


def prefill_tiles(dtype: torch.dtype, head_dim: int = 128) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 64 x 64 for 16-bit types; 32 x 32 for float32, whose K and V tiles at
    head_dim 128 would need 115 KB of shared memory, more than sm_86/89 cards have; at head_dim
    256 (Gemma), halved again in the query rows (float32) or both (16-bit) for the same reason."""
    if head_dim > 128:
        return (16, 32) if dtype == torch.float32 else (32, 32)
    return (32, 32) if dtype == torch.float32 else (64, 64)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr,
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cblock, stride_cslot,
    stride_ch,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
    PRECISION: tl.constexpr, WINDOW: tl.constexpr = 0,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_first = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_first
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix = seq_len - q_len
        kv_head = head // GROUP
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        m_mask = m < q_len
        d_mask = d < HEAD_DIM
        q_pos = prefix + m
        q_rows = (q_first + m).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32).to(DOT)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        end = tl.minimum(prefix + (tile + 1) * BLOCK_M, seq_len)  # the tile's last row + 1
        if WINDOW > 0:  # from the first row's window on
            begin = tl.maximum(prefix + tile * BLOCK_M - WINDOW + 1, 0)
        else:
            begin = 0
        for start in range(begin, end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_mask = n < end
            block = tl.load(block_table_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_mask,
                            other=0)
            row = block.to(tl.int64) * stride_cblock + (n % BLOCK_SIZE) * stride_cslot
            kv_off = row[:, None] + kv_head * stride_ch + d[None, :]
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
            visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
            if WINDOW > 0:
                visible = visible & (n[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(visible, s, float("-inf"))
            # Rows past q_len see no key; their max stays finite through the 0 fallback.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], head_dim contiguous; the chunks back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32: context length, the chunk included
    query_start: torch.Tensor,  # [S + 1] int32: sequence s's rows of q are [qs[s], qs[s+1])
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]
    block_m: int | None = None,  # default: prefill_tiles
    block_n: int | None = None,
    window: int | None = None,  # a sliding-window layer's: the last ``window`` positions
) -> torch.Tensor:
    block_size, kv_heads = check_attention_inputs(q, k_cache, v_cache)
    _, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    default_m, default_n = prefill_tiles(q.dtype, head_dim)
    block_m, block_n = block_m or default_m, block_n or default_n
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return out
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        DOT=dot_dtype(q.dtype), PRECISION=dot_precision(q.dtype), WINDOW=window or 0,
    )
    return out
