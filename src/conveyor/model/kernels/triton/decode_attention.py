"""Paged decode attention: one query row per sequence against its whole cached context.

Stage 1, grid ``(seqs, kv_heads, splits)``: each program takes the ``g`` query heads that share
one KV head (GQA: the group's keys are read once, and the heads, padded to 16 rows, make a
``tl.dot`` tile) over one split of the context, walking it ``BLOCK_N`` keys at a time through
the block table with an online softmax. It leaves a partial output and its log-sum-exp.
Stage 2, grid ``(seqs, heads)``: merges the splits. Splitting the context (split-K, as in
flash-decoding) keeps the GPU busy when a few long sequences decode alone; the number of splits
is a launch constant, so a CUDA graph captured with it serves every context length. A split
covers at least ``min_split_len`` positions, so a short context fills the first splits and
leaves the rest empty: where splits fall depends on the context length and the split count
only, which is what makes a graph's replay equal an eager step with the same count. A sequence
whose context length is 0 (a padded graph row) gets zeros.

A sliding-window layer (``window``, a launch constant) splits only the window's positions, the
last ``window`` of the context: nothing before them is read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.model.kernels.triton.common import check_attention_inputs, dot_dtype, dot_precision

MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism it adds
MAX_SPLITS = 16


def num_splits_for(max_context_len: int, num_seqs: int, num_kv_heads: int,
                   num_sms: int = 132) -> int:
    """Splits for a batch that may hold contexts of ``max_context_len``: enough programs to fill
    ``num_sms`` streaming multiprocessors, none shorter than ``MIN_TOKENS_PER_SPLIT``."""
    by_length = triton.cdiv(max(max_context_len, 1), MIN_TOKENS_PER_SPLIT)
    by_occupancy = triton.cdiv(num_sms, max(num_seqs * num_kv_heads, 1))
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr,
    scale,
    stride_qt, stride_qh, stride_bt, stride_cblock, stride_cslot, stride_ch,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if WINDOW > 0:  # the window's positions [first, seq_len) are split
        first = tl.maximum(seq_len - WINDOW, 0)
        span = seq_len - first
        per_split = tl.maximum(tl.cdiv(span, NUM_SPLITS), MIN_SPLIT_LEN)
        lo = first + tl.minimum(split * per_split, span)
    else:
        per_split = tl.maximum(tl.cdiv(seq_len, NUM_SPLITS), MIN_SPLIT_LEN)
        lo = tl.minimum(split * per_split, seq_len)
    hi = tl.minimum(lo + per_split, seq_len)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + h
    h_mask = h < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = q.to(DOT)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        block = tl.load(block_table_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0)
        row = block.to(tl.int64) * stride_cblock + (n % BLOCK_SIZE) * stride_cslot
        kv_off = row[:, None] + kv_head * stride_ch + d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PRECISION) * scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    nonempty = hi > lo
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    tl.store(part_o_ptr + seq * stride_ot + heads[:, None] * stride_oh + split * stride_os
             + d[None, :], out, mask=h_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + seq * stride_lt + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_outt, stride_outh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + seq * stride_lt + head * stride_lh + s, mask=s_mask,
                  other=float("-inf"))
    top = tl.max(lse, axis=0)
    finite = top > float("-inf")
    w = tl.where(s_mask & (lse > float("-inf")), tl.exp(lse - tl.where(finite, top, 0.0)), 0.0)
    o = tl.load(part_o_ptr + seq * stride_ot + head * stride_oh + s[:, None] * stride_os
                + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    merged = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_outt + head * stride_outh + d,
             merged.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_attention(
    q: torch.Tensor,  # [S, num_heads, head_dim], head_dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32: context length, the new token included
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,  # [S, num_heads, head_dim]
    block_n: int = 32,
    min_split_len: int = MIN_TOKENS_PER_SPLIT,
    window: int | None = None,  # a sliding-window layer's: the last ``window`` positions
) -> torch.Tensor:
    block_size, kv_heads = check_attention_inputs(q, k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    group = num_heads // kv_heads
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    part_o = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                         device=q.device)
    part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                           device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(num_seqs, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_o, part_lse, scale,
        q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        MIN_SPLIT_LEN=min_split_len, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=block_n,
        DOT=dot_dtype(q.dtype), PRECISION=dot_precision(q.dtype), WINDOW=window or 0,
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_o, part_lse, out,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0),
        part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
    )
    return out
