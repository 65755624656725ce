"""Paged attention on the CUDA path: the Triton kernels of ``kernels/triton/``.

A step's tokens are laid out flat, decodes (one token each) first, then prefill chunks, as
``layers/attention.py`` lays them out. ``TritonBatch`` carries what the kernels read: every
entry's block table row and context length, where each chunk's query rows start, and the
decode kernel's number of context splits. One call writes the step's K/V into the cache and
attends: decodes through the split-K decode kernel, chunks through the prefill kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TritonBatch:
    block_tables: torch.Tensor  # [S, max_blocks] int32, decodes first (padding: 0)
    seq_lens: torch.Tensor  # [S] int32: context length, this step's tokens included
    prefill_query_start: torch.Tensor  # [P + 1] int32: chunk p's rows, counted after the decodes
    num_decodes: int
    max_query_len: int  # longest prefill chunk (0 without chunks)
    num_splits: int  # context splits of the decode kernel


@dataclass
class FlatBatch:
    """A step's entries, host side: what ``build_triton_batch`` lays out."""
    slot_mapping: list[int]
    positions: list[int]
    block_tables: list[list[int]]
    seq_lens: list[int]
    prefill_query_start: list[int]
    num_decodes: int
    max_query_len: int


def flatten_entries(block_tables: list[list[int]], starts: list[int], num_new: list[int],
                    block_size: int) -> FlatBatch:
    """Slots, positions and per-entry lengths of entries ordered decodes first."""
    num_decodes = 0
    while num_decodes < len(num_new) and num_new[num_decodes] == 1:
        num_decodes += 1
    if any(n == 1 for n in num_new[num_decodes:]) or any(n < 1 for n in num_new):
        raise ValueError("entries must be ordered with single-token entries first")
    slots, positions = [], []
    for table, start, count in zip(block_tables, starts, num_new, strict=True):
        for pos in range(start, start + count):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
    width = max(len(t) for t in block_tables)
    query_start = [0]
    for count in num_new[num_decodes:]:
        query_start.append(query_start[-1] + count)
    return FlatBatch(slots, positions, [t + [0] * (width - len(t)) for t in block_tables],
                     [s + n for s, n in zip(starts, num_new, strict=True)], query_start,
                     num_decodes, max(num_new[num_decodes:], default=0))


def build_triton_batch(flat: FlatBatch, device: torch.device, num_splits: int) -> TritonBatch:
    return TritonBatch(
        torch.tensor(flat.block_tables, dtype=torch.int32).to(device, non_blocking=True),
        torch.tensor(flat.seq_lens, dtype=torch.int32).to(device, non_blocking=True),
        torch.tensor(flat.prefill_query_start, dtype=torch.int32).to(device, non_blocking=True),
        flat.num_decodes, flat.max_query_len, num_splits)


def triton_paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], rows may be strided
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
    batch: TritonBatch,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns [T, num_heads * head_dim], written into ``out`` when it is a contiguous tensor of
    that shape and q's dtype."""
    from conveyor.model.kernels.triton.decode_attention import decode_attention
    from conveyor.model.kernels.triton.kv_write import write_kv
    from conveyor.model.kernels.triton.prefill_attention import prefill_attention

    num_tokens, num_heads, head_dim = q.shape
    shape = (num_tokens, num_heads * head_dim)
    if out is None or out.shape != shape or out.dtype != q.dtype or not out.is_contiguous():
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
    heads_out = out.view(num_tokens, num_heads, head_dim)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    scale = head_dim ** -0.5
    nd = batch.num_decodes
    if nd:
        decode_attention(q[:nd], k_cache, v_cache, batch.block_tables[:nd], batch.seq_lens[:nd],
                         scale, batch.num_splits, out=heads_out[:nd])
    if nd < batch.seq_lens.shape[0]:
        prefill_attention(q[nd:], k_cache, v_cache, batch.block_tables[nd:],
                          batch.seq_lens[nd:], batch.prefill_query_start, batch.max_query_len,
                          scale, out=heads_out[nd:])
    return out
